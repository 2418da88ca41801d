"""Connecting to barreld: find the socket, start the daemon when nobody answers, and wrap RPC errors."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from barrelctl.errors import EXIT_UNREACHABLE, CliError, exit_code_for
from barreld.paths import SYSTEM_SOCKET, default_socket, private_dir

READY_TIMEOUT = 60.0
CALL_TIMEOUT = 10.0


def _answers(path: Path, timeout: float = 1.0) -> bool:
    import grpc

    if not path.exists():
        return False
    channel = grpc.insecure_channel(f"unix:{path}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


class Client:
    """One channel to the daemon; `stub` is the generated Barrel stub."""

    def __init__(self, socket: Path | None, *, autostart: bool) -> None:
        self.explicit = socket is not None or bool(os.environ.get("BARREL_SOCKET"))
        self.socket = socket or default_socket()
        self.autostart = autostart
        self._channel = None
        self._stub = None

    @property
    def stub(self):
        if self._stub is None:
            self._connect()
        return self._stub

    def _connect(self) -> None:
        import grpc

        from barreld.rpc import barrel_pb2_grpc as pb_grpc

        if not _answers(self.socket):
            if not self.explicit and _answers(SYSTEM_SOCKET):
                self.socket = SYSTEM_SOCKET
            elif self.autostart:
                self._start_daemon()
            else:
                raise CliError(
                    f"no barreld answers on {self.socket}; start it with `barreld` or drop --no-autostart",
                    EXIT_UNREACHABLE,
                )
        self._channel = grpc.insecure_channel(
            f"unix:{self.socket}", options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self._stub = pb_grpc.BarrelStub(self._channel)

    def _start_daemon(self) -> None:
        """Starts barreld in the background under a lock, so racing clients end with one daemon."""
        sock_dir = self.socket.parent
        private_dir(sock_dir)
        fd = os.open(sock_dir / "autostart.lock", os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _answers(self.socket):
                return
            log_path = sock_dir / "barreld.log"
            with open(log_path, "ab") as log:
                os.chmod(log_path, 0o600)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "barreld", "--socket", str(self.socket)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            deadline = time.monotonic() + READY_TIMEOUT
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                    raise CliError(
                        f"barreld exited with code {proc.returncode} while starting: {tail[0]} (log: {log_path})",
                        EXIT_UNREACHABLE,
                    )
                if _answers(self.socket, timeout=0.5):
                    return
                time.sleep(0.05)
            raise CliError(
                f"barreld did not become ready on {self.socket} within {READY_TIMEOUT:.0f}s (log: {log_path})",
                EXIT_UNREACHABLE,
            )

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


@contextlib.contextmanager
def rpc_errors() -> Iterator[None]:
    """Turns an RpcError into a CliError carrying the daemon's message and the contract's exit code."""
    import grpc

    try:
        yield
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or "").lower():
            raise CliError(f"barreld is not reachable: {exc.details()}", EXIT_UNREACHABLE) from None
        raise CliError(exc.details() or code.name.lower(), exit_code_for(code.name)) from None

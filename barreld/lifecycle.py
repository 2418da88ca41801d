"""barreld's process lifecycle: the data-dir lock, the directory of a socket it listens on, systemd's
notifications, the shutdown signal, and the error that stops a start. Both front ends and the daemon use it,
so it imports neither gRPC nor the web stack."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket as socketlib
import threading
from pathlib import Path

from barreld.paths import lock_file, private_dir, socket_answers

log = logging.getLogger(__name__)

LOCK_NAME = "barreld.lock"


class StartupError(Exception):
    """barreld cannot start; the message is the one line printed before exiting 1."""


class DataDirLock:
    """An exclusive flock on <data_dir>/barreld.lock holding the owner's pid: one daemon per data dir.

    flock dies with its process, so a SIGKILLed daemon never leaves a stale lock behind.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = lock_file(self.path, wait=False)
        if fd is None:
            try:
                holder = self.path.read_text(errors="replace")[:64].strip() or "another process"
            except OSError:
                holder = "another process"
            raise StartupError(
                f"data dir {self.path.parent} is in use by barreld pid {holder}; "
                f"stop it (`barrelctl daemon stop`) or pass another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def prepare_socket(path: Path, group: int | None = None) -> None:
    """Creates the socket's directory (0700, or 0750 with a group) and removes a stale socket file."""
    parent = path.parent
    if not parent.exists():
        private_dir(parent)
    st = parent.stat()
    if st.st_uid != os.getuid():
        raise StartupError(f"socket directory {parent} belongs to uid {st.st_uid}, not to us; choose another")
    if group is not None:
        os.chown(parent, -1, group)
        os.chmod(parent, 0o750)
    elif st.st_mode & 0o077:
        os.chmod(parent, 0o700)
    if path.exists() or path.is_symlink():
        if socket_answers(path):
            raise StartupError(f"another process already answers on {path}; stop it or choose another path")
        path.unlink()


def notify_systemd(message: str) -> None:
    """sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET, if systemd gave us one."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM) as s:
        s.connect(addr)
        s.send(message.encode())


class ShutdownSignal:
    """SIGTERM/SIGINT (or a Shutdown RPC) set one event the main thread waits on."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        self.event.set()

    def request(self) -> None:
        self.event.set()

    def wait(self) -> None:
        while not self.event.wait(1.0):
            pass

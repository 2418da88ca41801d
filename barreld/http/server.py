"""The HTTP listener: a socket bound at start (so a taken port or a refused address stops barreld with one
line), served by uvicorn on its own thread and event loop inside the daemon process."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

import uvicorn
from starlette.types import ASGIApp

from barreld.address import ListenAddress
from barreld.lifecycle import StartupError, prepare_socket

log = logging.getLogger(__name__)

BACKLOG = 128
START_TIMEOUT = 10.0
GRACE_S = 5  # after shutdown begins, in-flight requests get this long before they are cut off


def check_exposure(address: ListenAddress, has_keys: bool) -> None:
    """Refuses an address other machines can reach unless bearer keys guard it."""
    if not address.loopback and not has_keys:
        raise StartupError(
            f"refusing to serve HTTP on {address}, which other machines can reach, without API keys: "
            f"set [http] api_keys_file to a file of bearer keys (mode 0600), or listen on 127.0.0.1"
        )


class HttpServer:
    def __init__(self, address: ListenAddress, *, group: int | None = None) -> None:
        self.requested = address
        self.group = group
        self.address = address  # as bound: port 0 becomes the port the kernel chose
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def bind(self) -> None:
        try:
            self._sock = self._unix() if self.requested.path is not None else self._tcp()
        except OSError as exc:
            raise StartupError(f"cannot listen for HTTP on {self.requested}: {exc.strerror or exc}") from None
        self._sock.listen(BACKLOG)
        log.info("HTTP API on %s", self.address)

    def _tcp(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.requested.host else socket.AF_INET
        # Naming the protocol is what makes asyncio set TCP_NODELAY on accepted connections (it checks the
        # socket's proto, which they inherit): without it a streamed chunk written while the previous one is
        # unacknowledged waits for the client's delayed ACK, about 40 ms on back-to-back requests.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.requested.host, self.requested.port))
        except OSError:
            sock.close()
            raise
        self.address = self.requested.with_port(sock.getsockname()[1])
        return sock

    def _unix(self) -> socket.socket:
        """Owner-only (0600, or 0660 with the daemon's socket group), like the gRPC socket."""
        path = self.requested.path
        prepare_socket(path, self.group)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        if self.group is not None:
            os.chown(path, -1, self.group)
            os.chmod(path, 0o660)
        return sock

    def start(self, app: ASGIApp) -> None:
        """Serves `app` on the bound socket from a thread of its own; returns once uvicorn is serving."""
        config = uvicorn.Config(
            app, http="httptools", loop="asyncio", lifespan="off", log_config=None, access_log=False,
            server_header=False, timeout_graceful_shutdown=GRACE_S,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, args=([self._sock],), name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise StartupError(f"the HTTP server on {self.address} did not start; see the log above")
            time.sleep(0.01)

    def stop_accepting(self) -> None:
        """Begins uvicorn's shutdown: no new connections; in-flight requests end as their workers stop."""
        if self._server is not None:
            self._server.should_exit = True
        if self.requested.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.requested.path.unlink()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()

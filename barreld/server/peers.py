"""Which Unix user a gRPC call comes from, so that each user of a shared socket is a tenant of its own.

gRPC's Python server never shows a call's socket, so the kernel's word on the peer (SO_PEERCRED) is taken on a
socket beside it, `SOCKET.peer`, as guarded as the socket itself: a client connects, barreld reads the uid
the kernel reports and answers with that uid's token, an HMAC under a secret made at start (it never leaves
the process). The client sends `uid:token` with every call (metadata `barrel-peer`). A token says nothing of
another uid's, so no user can speak as another.

A call without a valid token comes from the daemon's own user when the socket is private (mode 0600: nobody else
can connect but root); on a socket shared through `socket_group`, it is refused. The secret is kept in the data
dir (mode 0600), so a client's token still holds after the daemon restarts.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
from pathlib import Path

import grpc

from barreld.errors import Unauthenticated
from barreld.paths import peer_socket
from barreld.tenants import uid_tenant

log = logging.getLogger(__name__)

METADATA = "barrel-peer"
_UCRED = struct.Struct("3i")  # pid, uid, gid


class Peers:
    """The identity socket and the check of each call's token."""

    def __init__(self, path: Path, group: int | None, secret_file: Path, owner: int | None = None) -> None:
        self.path = peer_socket(path)
        self.group = group
        self.owner = os.geteuid() if owner is None else owner
        self._secret = _secret(secret_file)
        self._sock: socket.socket | None = None

    def token(self, uid: int) -> str:
        return hmac.new(self._secret, str(uid).encode(), hashlib.sha256).hexdigest()

    def start(self) -> None:
        """Listens beside the gRPC socket, with its mode and group (the directory is already prepared)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        if self.group is not None:
            os.chown(self.path, -1, self.group)
            os.chmod(self.path, 0o660)
        sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._serve, name="peers", daemon=True).start()

    def stop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def _serve(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed: barreld is stopping
            with conn:
                try:
                    _pid, uid, _gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                    _UCRED.size))
                    conn.settimeout(1.0)
                    conn.sendall(f"{uid}:{self.token(uid)}\n".encode())
                except OSError as exc:
                    log.debug("a peer left before its token was sent: %s", exc)

    def uid(self, context: grpc.ServicerContext) -> int:
        """The caller's uid, proven by its token; the daemon's own with no token on a private socket. Aborts
        the call otherwise (Unauthenticated)."""
        given = dict(context.invocation_metadata()).get(METADATA)
        uid, _, token = str(given or "").partition(":")
        if uid.isdigit() and hmac.compare_digest(token.encode(), self.token(int(uid)).encode()):
            return int(uid)
        if self.group is None:
            return self.owner
        if given is None:
            raise Unauthenticated(f"this socket is shared (daemon.socket_group): a client proves its user through "
                                  f"{self.path} first, as barrelctl does; upgrade the client or use barrelctl")
        raise Unauthenticated(f"the peer token is not this daemon's (another data dir?); ask {self.path} again")

    def tenant(self, context: grpc.ServicerContext) -> str:
        """The caller's tenant (see `barreld.tenants.uid_tenant`)."""
        return uid_tenant(self.uid(context), self.owner)

    def operator(self, context: grpc.ServicerContext) -> bool:
        """The daemon's own user or root: sees every tenant's rows, may stop the daemon and evict."""
        return self.uid(context) in (self.owner, 0)


def _secret(path: Path) -> bytes:
    """The HMAC secret of the tokens: read from `path`, or made there (mode 0600) the first time."""
    with contextlib.suppress(FileNotFoundError):
        data = path.read_bytes()
        if len(data) == 32:
            return data
    data = secrets.token_bytes(32)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return data

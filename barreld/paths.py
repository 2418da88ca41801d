"""Default socket location, private directories and lock files, per the operator's contract.

Both barreld and barrelctl import this module, so it stays free of heavy imports. Under systemd the
unit passes --socket /run/barrel/barreld.sock and --data-dir /var/lib/barrel explicitly.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket as socketlib
from collections.abc import Iterator
from pathlib import Path

SOCKET_ENV = "BARREL_SOCKET"
SYSTEM_SOCKET = Path("/run/barrel/barreld.sock")


def default_socket() -> Path:
    """$BARREL_SOCKET, else $XDG_RUNTIME_DIR/barrel/barreld.sock, else /tmp/barrel-$UID/barreld.sock."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "barrel" / "barreld.sock"
    return Path(f"/tmp/barrel-{os.getuid()}") / "barreld.sock"


def lock_file(path: Path, *, wait: bool) -> int | None:
    """An exclusive flock on `path` (created 0600): the descriptor that holds it until it is closed. The kernel
    drops it when its holder dies, so a killed process leaves no stale lock. Without `wait`, None while another
    process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def locked(path: Path) -> Iterator[int]:
    """Holds `path`'s lock (waiting for it) for the `with` block; yields its descriptor."""
    fd = lock_file(path, wait=True)
    assert fd is not None
    try:
        yield fd
    finally:
        os.close(fd)


def private_dir(path: Path) -> Path:
    """Create path (and parents) and make the leaf 0700, so only its owner can write or list it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def socket_answers(path: Path) -> bool:
    """Whether something accepts connections on path (a live daemon) rather than a stale file, which
    refuses at once."""
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def peer_socket(path: Path) -> Path:
    """The identity socket beside a gRPC socket (see `barreld.server.peers`)."""
    return path.with_name(path.name + ".peer")


def peer_token(path: Path, timeout: float = 2.0) -> str | None:
    """The client's side: `uid:token` from the identity socket beside the gRPC socket `path`; None when there is
    none (an older daemon, or one still starting)."""
    with contextlib.suppress(OSError), socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(peer_socket(path)))
        data = b""
        while not data.endswith(b"\n") and len(data) < 256:
            chunk = sock.recv(256)
            if not chunk:
                break
            data += chunk
        text = data.decode("ascii", "replace").strip()
        return text if ":" in text else None
    return None

"""Default socket location and private directories, per the operator's contract.

Both barreld and barrelctl import this module, so it stays free of heavy imports. Under systemd the
unit passes --socket /run/barrel/barreld.sock and --data-dir /var/lib/barrel explicitly.
"""

from __future__ import annotations

import os
import socket as socketlib
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

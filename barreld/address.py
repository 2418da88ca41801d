"""Where the HTTP API listens. Pure: the config reader and the command line check it here without importing
the web stack (the keys that guard it are `barreld.tenants`)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

UNIX_PREFIX = "unix:"
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
LOCALHOST = "localhost"


@dataclass(frozen=True)
class ListenAddress:
    """A TCP host and port (port 0: any free one), or a Unix socket path."""

    host: str = ""
    port: int = 0
    path: Path | None = None

    @property
    def loopback(self) -> bool:
        """Only this machine can connect: a loopback IP, or a Unix socket (guarded by its file mode)."""
        return self.path is not None or ipaddress.ip_address(self.host).is_loopback

    def with_port(self, port: int) -> ListenAddress:
        return ListenAddress(self.host, port, self.path)

    def __str__(self) -> str:
        if self.path is not None:
            return f"{UNIX_PREFIX}{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_listen(text: str, base: Path | None = None) -> ListenAddress:
    """`HOST:PORT` (an IPv4 literal or localhost), `[IPv6]:PORT`, or `unix:/path.sock` (a relative path is
    taken from `base`, else the current directory); ValueError says why not."""
    if text.startswith(UNIX_PREFIX):
        raw = text[len(UNIX_PREFIX) :]
        if not raw or "\0" in raw:
            raise ValueError(f"bad address {text!r}: expected unix:/path/to/http.sock")
        path = ((base or Path.cwd()) / Path(raw).expanduser()).absolute()
        if len(os.fsencode(path)) > MAX_UNIX_PATH:
            raise ValueError(f"bad address {text!r}: a Unix socket path holds at most {MAX_UNIX_PATH} bytes")
        return ListenAddress(path=path)
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 literal must be bracketed, or its last group reads as the port
    if host == LOCALHOST:
        host = "127.0.0.1"
    try:
        ipaddress.ip_address(host)
        number = int(port, 10) if sep and port.isascii() and port.isdigit() else -1
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ValueError(
            f"bad address {text!r}: expected HOST:PORT (an IP address or localhost), [IPv6]:PORT or unix:PATH"
        )
    return ListenAddress(str(ipaddress.ip_address(host)), number)

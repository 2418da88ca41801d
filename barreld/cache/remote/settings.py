"""The Redis tier's settings and URL rules, without importing the client: a bad URL stops barreld at start
cheaply. The URL is where the password lives, so everything shown to a person goes through `redact_url`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit, urlunsplit

SCHEMES: tuple[str, ...] = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
CLUSTER_SUFFIX = "+cluster"
"""`redis+cluster://HOST:PORT` (or `rediss+cluster://`) names a Redis Cluster by any one of its nodes: the scheme
says it, so $BARREL_REDIS_URL alone can switch a host between a server and a cluster."""
DEFAULT_PREFIX = "barrel:"
DEFAULT_TIMEOUT_MS = 1000
URL_ENV = "BARREL_REDIS_URL"
"""Overrides `[tiers.redis] url`, so a password can stay out of the config file."""

# Query options the URL may carry. Everything else (socket_timeout, retries, ...) would override Barrel's
# own settings, since the client lets the URL win; a password belongs in the user-info part.
_QUERY_KEYS = frozenset({"db", "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"})
# No braces (they would become the hash tag) and no glob characters (the prefix is a SCAN pattern).
_PREFIX = re.compile(r"[A-Za-z0-9_.:/-]{1,64}", re.ASCII)


def redact_url(url: str) -> str:
    """The URL without its user-info and query (which may hold credentials): safe to log."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unparsable URL)"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


def url_problem(url: str) -> str | None:
    """Why `url` cannot name a Redis server for Barrel, or None when it can; never repeats a password."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:  # its message may quote the URL, password and all
        return f"not a valid URL: {redact_url(url)}"
    try:
        port = parts.port
    except ValueError:
        return f"{redact_url(url)}: the port must be a number from 1 to 65535"
    if parts.scheme not in SCHEMES:
        return (f"unsupported scheme in {redact_url(url)}: expected redis://, rediss://, unix://, "
                "redis+cluster:// or rediss+cluster://")
    unknown = sorted(set(query) - _QUERY_KEYS)
    if unknown:
        return f"unsupported URL option(s) {', '.join(unknown)}: allowed are {', '.join(sorted(_QUERY_KEYS))}"
    db = query.get("db", [None])[-1]
    if parts.scheme == "unix":
        if not parts.path.startswith("/"):
            return f"{redact_url(url)} names no socket: expected unix:///absolute/path.sock"
    else:
        if not parts.hostname:
            return f"{redact_url(url)} names no host: expected {parts.scheme}://HOST:PORT/DB"
        if port == 0:
            return f"{redact_url(url)}: port 0 is not a port"
        db = parts.path.strip("/") or db
    if db is not None and not (db.isascii() and db.isdigit()):
        return f"{redact_url(url)}: the database must be a whole number, got {db!r}"
    if parts.scheme.endswith(CLUSTER_SUFFIX) and db not in (None, "0"):
        return f"{redact_url(url)}: a Redis Cluster has only database 0"
    return None


def prefix_problem(prefix: str) -> str | None:
    """Why `prefix` cannot namespace Barrel's keys, or None when it can."""
    if _PREFIX.fullmatch(prefix):
        return None
    return "use 1 to 64 letters, digits and . _ : / - (no braces, no glob characters)"


@dataclass(frozen=True)
class RedisSettings:
    """`[tiers.redis]`: where the server is and how Barrel uses it. The URL stays out of repr (credentials)."""

    url: str = field(repr=False)
    quota: int | None = None  # bytes Barrel's keys may hold in Redis; None: only Redis's maxmemory bounds them
    prefix: str = DEFAULT_PREFIX
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    write: bool = True  # False: this host reads only (no puts, no deletes)

    def __post_init__(self) -> None:
        problem = url_problem(self.url) or prefix_problem(self.prefix)
        if problem:
            raise ValueError(problem)
        if self.timeout_ms < 1 or (self.quota is not None and self.quota < 0):
            raise ValueError("timeout_ms must be >= 1 and quota >= 0")

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    @property
    def cluster(self) -> bool:
        """Whether the URL names a Redis Cluster (redis+cluster://, rediss+cluster://)."""
        return urlsplit(self.url).scheme.endswith(CLUSTER_SUFFIX)

    @property
    def client_url(self) -> str:
        """The URL as redis-py reads it: a cluster's scheme without its suffix."""
        scheme, rest = self.url.split(":", 1)
        return scheme.removesuffix(CLUSTER_SUFFIX) + ":" + rest

    @property
    def address(self) -> str:
        """host:port, or the socket's path: how errors name the server."""
        parts = urlsplit(self.url)
        return parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}"

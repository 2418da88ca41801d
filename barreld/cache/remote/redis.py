"""RedisStore: Barrel's objects in a Redis or Valkey server that is trusted for nothing.

Values: each object is stored as a small header (magic, payload length, xxh3-128 checksum over the object's
name and payload) followed by the payload. A value that is missing, cut short, overwritten, or copied from
another key is a miss, counted, and never data.

Names: `<prefix>{<tag hex>}:<kind>:<key hex>`. The braces are a Redis Cluster hash tag: every name with one
tag hashes to one slot. A row's parts are written under the row's tag so that they live on the row's node,
are fetched from it in one round trip, and move with the row when slots migrate or fail over; a reader
never finds a row on one node whose parts went to another.

Failures: a refused connection, a timeout, a reset, refused credentials or an error reply make that call a
miss (or a write that did not happen), counted by kind and logged at most once a minute per kind. After a
failure to reach the server the store is down for a backoff that doubles up to a cap: calls fail at once
instead of each waiting out the timeout, until one call is let through to try again. Only programming
errors (an unknown kind, a key that is not bytes) raise.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import redis
import xxhash
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.exceptions import NoPermissionError, OutOfMemoryError, RedisClusterException
from redis.retry import Retry

from ..checkpoint import Buffer
from .settings import RedisSettings

log = logging.getLogger("barreld.cache.redis")

HEADER = struct.Struct("<4sQ16s")
"""magic, payload length, xxh3-128 of (name without prefix + payload)."""
MAGIC = b"BRv1"
ROW_KIND = "row"
ERROR_KINDS: tuple[str, ...] = ("refused", "timeout", "reset", "auth", "connection", "oom", "response")
MISS_KINDS: tuple[str, ...] = ("missing", "corrupt", "unreachable")
QUOTA_REFRESH_S = 30.0
"""How old the measured usage may be before a write measures it again (a SCAN of Barrel's keys)."""
LOG_PERIOD_S = 60.0

_KIND = re.compile(r"[a-z][a-z0-9_]{0,15}", re.ASCII)
_NAME = re.compile(rb"\{([0-9a-f]+)\}:([a-z][a-z0-9_]*):([0-9a-f]+)")
_SCAN_COUNT = 1000
_ADDRESS = re.compile(r"[A-Za-z0-9.-]+:[0-9]{1,5}\b")
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


class Ref(NamedTuple):
    """One object's address: its kind, its key, and the hash tag it shares (None: its own key)."""

    kind: str
    key: bytes
    tag: bytes | None = None


class RemoteObject(NamedTuple):
    """One of Barrel's values in Redis; `size` counts the bytes Redis holds for it (header included)."""

    kind: str
    tag: bytes
    key: bytes
    size: int
    idle_s: int | None = None  # since last read or written, by Redis's clock; None under an LFU policy


def error_kind(exc: BaseException) -> str:
    """Which of ERROR_KINDS an exception from the client is: the counters and the log say it by name."""
    if isinstance(exc, redis.AuthenticationError | NoPermissionError):
        return "auth"
    if isinstance(exc, redis.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, OutOfMemoryError):
        return "oom"
    if isinstance(exc, redis.ResponseError):
        return "response"
    cause: BaseException | None = exc
    while cause is not None:  # the client wraps the socket's own error; look underneath
        if isinstance(cause, ConnectionRefusedError | FileNotFoundError):
            return "refused"
        if isinstance(cause, ConnectionResetError | BrokenPipeError) or "closed by server" in str(cause):
            return "reset"
        cause = cause.__cause__ or cause.__context__
    return "connection"


class _Backoff:
    """Down/up for the server: after a failure, refuse calls until the backoff passes, then let one through."""

    def __init__(self, first_s: float, cap_s: float, clock: Callable[[], float]) -> None:
        self._first, self._cap, self._clock = first_s, cap_s, clock
        self._lock = threading.Lock()
        self._delay = first_s
        self._until = 0.0
        self.down = False

    def allow(self) -> bool:
        """Whether a call may go out now; while down, the one let through holds the gate for the others."""
        with self._lock:
            now = self._clock()
            if now < self._until:
                return False
            if self.down:
                self._until = now + self._delay
            return True

    def failed(self) -> None:
        with self._lock:
            if self.down:
                self._delay = min(self._delay * 2, self._cap)
            self.down = True
            self._until = self._clock() + self._delay

    def succeeded(self) -> bool:
        """Mark the server up; True when it was down until now."""
        with self._lock:
            was_down = self.down
            self.down, self._delay, self._until = False, self._first, 0.0
        return was_down


class OncePerPeriod:
    """A warning per kind at most once a period, saying how many of that kind it held back since."""

    def __init__(self, clock: Callable[[], float], period_s: float = LOG_PERIOD_S) -> None:
        self._clock, self._period = clock, period_s
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def warn(self, kind: str, message: str) -> None:
        with self._lock:
            now = self._clock()
            last = self._last.get(kind)
            if last is not None and now - last[0] < self._period:
                self._last[kind] = (last[0], last[1] + 1)
                return
            self._last[kind] = (now, 0)
        held = f" ({last[1]} more since the last report)" if last and last[1] else ""
        log.warning("%s%s", message, held)


class RedisStore:
    """Opaque byte objects under content keys in one Redis database, safe to call from many threads."""

    def __init__(
        self,
        settings: RedisSettings,
        *,
        backoff_s: tuple[float, float] = (0.1, 10.0),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._client: redis.Redis | redis.RedisCluster | None = None if settings.cluster else _open_client(settings)
        self._connecting = threading.Lock()
        self._prefix = settings.prefix.encode()
        self._secrets = _secrets(settings.url)
        self._clock = clock
        self._backoff = _Backoff(*backoff_s, clock)
        self._warn = OncePerPeriod(clock)
        self._lock = threading.Lock()
        self._stats: dict[str, Any] = dict.fromkeys(
            ("round_trips", "skipped_down", "hits", "bytes_read", "bytes_written", "writes", "writes_failed",
             "writes_over_quota", "corrupt_deleted"), 0)
        self._stats.update(misses=dict.fromkeys(MISS_KINDS, 0), errors=dict.fromkeys(ERROR_KINDS, 0))
        self._node_errors: dict[str, dict[str, int]] = {}
        self._reachable = False
        self._rtt_ms: float | None = None
        self._usage: tuple[float, int] | None = None  # (when measured, bytes of Barrel's values then + since)
        self._measuring = threading.Lock()

    def __repr__(self) -> str:
        return f"RedisStore({self.settings.redacted_url}, prefix={self.settings.prefix!r})"

    def close(self) -> None:
        """Close the pooled connections."""
        if self._client is not None:
            self._client.close()

    # ---- reading ------------------------------------------------------------------------------

    def ping(self) -> bool:
        """One PING (to every node of a cluster): whether the server answers now (it also times the round trip
        for stats)."""
        return self._call("ping", lambda client: [client.ping()], probe=True) is not None

    def exists_many(self, kind: str, keys: Sequence[bytes], *, tag: bytes | None = None) -> list[bool]:
        """Which keys have a value, in one round trip (all False when Redis cannot be asked)."""
        return self.exists_refs([Ref(kind, key, tag) for key in keys])

    def exists_refs(self, refs: Sequence[Ref], *, touch: bool = False) -> list[bool]:
        """Which objects, of any kinds, have a value: one round trip (all False when Redis cannot be asked).
        `touch` also marks them used, so an LRU policy keeps a value that a writer relies on: it asks STRLEN,
        a read, where EXISTS leaves the idle time alone (and TOUCH, a multi-key command, a cluster's pipeline
        drops)."""
        names = [self._name(*ref) for ref in refs]
        if not names:
            return []
        ask = "strlen" if touch else "exists"
        replies = self._round_trip("probe", lambda p: [getattr(p, ask)(n) for n in names], probe=True)
        if replies is None or len(replies) != len(names):
            return [False] * len(names)
        return [isinstance(r, int) and r > 0 for r in replies]

    def get_many(self, kind: str, keys: Sequence[bytes], *, tag: bytes | None = None) -> list[memoryview | None]:
        """Each key's payload, verified, or None for a miss; one round trip."""
        return [payload for payload, _ in self.fetch_refs([Ref(kind, key, tag) for key in keys])]

    def fetch_refs(self, refs: Sequence[Ref], *, probe: bool = False) -> list[tuple[memoryview | None, str | None]]:
        """Each object's payload, verified, and None; or None and the kind of miss (one of MISS_KINDS). One
        round trip; `probe` times it for stats (small values only).

        Pipelined GETs rather than MGET: a cluster refuses an MGET whose keys hash to different slots. The
        payloads are views into the received values, so a 35 MB object is not copied again.
        """
        names = [self._name(*ref) for ref in refs]
        if not names:
            return []
        replies = self._round_trip("fetch", lambda p: [p.get(n) for n in names], probe=probe)
        if replies is None:
            self._count_misses("unreachable", len(names))
            return [(None, "unreachable")] * len(names)
        opened = [self._open(name, value) for name, value in zip(names, replies, strict=True)]
        for _, miss in opened:
            if miss:
                self._count_misses(miss, 1)
        corrupt = [name for name, (_, miss) in zip(names, opened, strict=True) if miss == "corrupt"]
        self._count(hits=sum(p is not None for p, _ in opened), bytes_read=sum(
            len(v) for v in replies if isinstance(v, bytes)))
        if corrupt and self.settings.write:  # else a writer that probes first would never replace it
            deleted = self._round_trip("delete", lambda p: [p.delete(n) for n in corrupt])
            self._count(corrupt_deleted=sum(r == 1 for r in deleted or []))
        return opened

    def _open(self, name: bytes, value: object) -> tuple[memoryview | None, str | None]:
        """The payload of a value and None, or None and why it is a miss."""
        if value is None:
            return None, "missing"
        if isinstance(value, Exception):  # an error reply (counted as such): nothing known about the value
            return None, "unreachable"
        if not isinstance(value, bytes) or len(value) < HEADER.size:
            return None, "corrupt"
        magic, length, digest = HEADER.unpack_from(value)
        payload = memoryview(value)[HEADER.size :]
        if magic != MAGIC or length != len(payload) or _digest(name[len(self._prefix) :], payload) != digest:
            return None, "corrupt"
        return payload, None

    # ---- writing ------------------------------------------------------------------------------

    def put(self, kind: str, key: bytes, payload: Buffer | list[Buffer], *, tag: bytes | None = None) -> bool:
        """Store one object; False when it was not stored (read-only, over quota, Redis failed)."""
        return self._write([(kind, key, payload)], tag)

    def publish_row(
        self,
        row_key: bytes,
        parts: Sequence[tuple[str, bytes, Buffer | list[Buffer]]],
        row_payload: Buffer,
        *,
        tag: bytes | None = None,
    ) -> bool:
        """Write a row's parts, then the row, all under one hash tag (the row key unless given).

        The row goes out only after Redis acknowledged every part, so a reader that finds the row finds its
        parts, unless Redis evicted or lost one since: readers must still treat a missing part as a miss.
        """
        tag = row_key if tag is None else tag
        return self._write(parts, tag) and self._write([(ROW_KIND, row_key, row_payload)], tag)

    def put_many(self, items: Sequence[tuple[str, bytes, Buffer | list[Buffer]]]) -> bool:
        """Store objects each under its own hash tag, in one round trip; True only when all were stored."""
        return self._write(items, None)

    def delete(self, kind: str, key: bytes, *, tag: bytes | None = None) -> bool:
        """Remove one object; True when it is gone (or was never there), False when Redis could not be told."""
        return self.delete_refs([Ref(kind, key, tag)]) is not None

    def delete_refs(self, refs: Sequence[Ref]) -> int | None:
        """Remove objects in one round trip: how many were there, or None when Redis could not be told
        (or this store only reads)."""
        names = [self._name(*ref) for ref in refs]
        if not self.settings.write:
            return None
        if not names:
            return 0
        replies = self._round_trip("delete", lambda p: [p.delete(n) for n in names])
        return None if replies is None else sum(r == 1 for r in replies)

    def _write(self, items: Sequence[tuple[str, bytes, Buffer | list[Buffer]]], tag: bytes | None) -> bool:
        """SET every item in one round trip; True only when Redis acknowledged them all."""
        if not items:
            return True
        named = [(self._name(kind, key, tag), payload) for kind, key, payload in items]
        if not self.settings.write:
            return False
        values = [_seal(name[len(self._prefix) :], payload) for name, payload in named]
        size = sum(len(v) for v in values)
        if not self._quota_allows(size):
            self._count(writes_over_quota=len(values))
            return False
        replies = self._round_trip("write", lambda p: [p.set(n, v) for (n, _), v in zip(named, values, strict=True)])
        stored = 0 if replies is None else sum(r is True for r in replies)
        written = sum(len(v) for v, r in zip(values, replies or [], strict=False) if r is True)
        self._count(writes=stored, writes_failed=len(values) - stored, bytes_written=written)
        self._add_usage(written)
        return stored == len(values)

    # ---- listing and quota --------------------------------------------------------------------

    def scan(self, kind: str | None = None) -> list[RemoteObject] | None:
        """Barrel's objects (of one kind, or all) under this prefix; None when Redis could not be read whole.

        SCAN visits the whole keyspace in steps and filters by pattern on the server; each step's idle times
        and sizes come from one pipelined round trip, OBJECT IDLETIME before STRLEN (which resets the idle
        clock, as any read does). Keys under the prefix that Barrel did not name are left out.
        """
        if kind is not None:
            self._check_kind(kind)
        pattern = self._prefix + b"{*}:" + (kind.encode() + b":*" if kind is not None else b"*")
        found: list[RemoteObject] = []
        for names in self._scan_names(pattern):
            if names is None:
                return None
            parsed = [(n, _NAME.fullmatch(n[len(self._prefix) :])) for n in names]
            parsed = [(n, m) for n, m in parsed if m is not None]
            replies = self._round_trip(
                "scan", lambda p, these=parsed: [(p.object("idletime", n), p.strlen(n)) for n, _ in these]
            ) if parsed else []
            if replies is None:
                return None
            for (_, m), idle, size in zip(parsed, replies[::2], replies[1::2], strict=True):
                if isinstance(size, int) and size:  # 0: deleted between the two round trips
                    idle_s = idle if isinstance(idle, int) else None
                    found.append(RemoteObject(m[2].decode(), bytes.fromhex(m[1].decode()),
                                              bytes.fromhex(m[3].decode()), size, idle_s))
        return found

    def _scan_names(self, pattern: bytes) -> Iterator[list[bytes] | None]:
        """The names matching `pattern`, a SCAN step at a time (a cluster's primaries one after another, all at
        once); None once a step fails."""
        if self.settings.cluster:
            reply = self._call("scan", lambda client: [list(client.scan_iter(match=pattern, count=_SCAN_COUNT))])
            yield None if reply is None else reply[0]
            return
        cursor = 0
        while True:
            reply = self._round_trip("scan", lambda p, at=cursor: p.scan(at, match=pattern, count=_SCAN_COUNT))
            if reply is None or isinstance(reply[0], Exception):
                yield None
                return
            cursor, names = reply[0]
            yield names
            if cursor == 0:
                return

    def _quota_allows(self, size: int) -> bool:
        """Whether `size` more bytes fit the quota, measured by SCAN at most every QUOTA_REFRESH_S.

        Other hosts write too: between measurements only this store's own writes are added, so the quota
        is a bound Barrel keeps approximately; Redis's maxmemory is the hard one. With no measurement (Redis
        could not be scanned) the write is tried, and fails or succeeds on its own.
        """
        quota = self.settings.quota
        if quota is None:
            return True
        usage = self._usage
        if (usage is None or self._clock() - usage[0] > QUOTA_REFRESH_S) and self._measuring.acquire(False):
            try:
                objects = self.scan()
                if objects is not None:
                    with self._lock:
                        usage = self._usage = (self._clock(), sum(o.size for o in objects))
            finally:
                self._measuring.release()
        return usage is None or usage[1] + size <= quota

    def _add_usage(self, size: int) -> None:
        with self._lock:
            if self._usage is not None and size:
                self._usage = (self._usage[0], self._usage[1] + size)

    # ---- the one way to the server ------------------------------------------------------------

    def _round_trip(self, what: str, build: Callable[[Pipeline], object], *, probe: bool = False) -> list | None:
        """One pipelined round trip (on a cluster, one per node concerned, in parallel): see `_call`."""

        def pipelined(client: redis.Redis | redis.RedisCluster) -> list:
            pipe = client.pipeline(transaction=False)
            build(pipe)
            return pipe.execute(raise_on_error=False)

        return self._call(what, pipelined, probe=probe)

    def _call(self, what: str, run: Callable[[Any], list], *, probe: bool = False) -> list | None:
        """run(client)'s replies, or None when Redis could not be asked (down, refused, timed out, reset,
        credentials refused, a cluster without a primary for a slot or in the middle of a change it could not
        follow), which is counted and logged here. Error replies (OOM, a read-only replica) stay in the list as
        exceptions, counted and logged here too."""
        if not self._backoff.allow():
            self._count(skipped_down=1)
            return None
        start = time.perf_counter_ns()
        try:
            replies = run(self._connected())
        except redis.DataError:
            raise  # an argument the client cannot send: a bug here, not a fault of Redis
        except (redis.RedisError, RedisClusterException, OSError) as e:
            self._unreachable(what, e)
            return None
        elapsed_ms = (time.perf_counter_ns() - start) / 1e6
        refused = next((r for r in replies if isinstance(r, redis.AuthenticationError)), None)
        if refused is not None:
            self._unreachable(what, refused)
            return None
        if self._backoff.succeeded():
            log.info("redis %s: reachable again", self.settings.redacted_url)
        with self._lock:
            self._reachable = True
            self._stats["round_trips"] += 1
            if probe:
                self._rtt_ms = elapsed_ms
        for error in {error_kind(r): r for r in replies if isinstance(r, Exception)}.items():
            self._error(what, *error)
        return replies

    def _connected(self) -> redis.Redis | redis.RedisCluster:
        """The client; a cluster's is made at the first call (making it asks a node for the slots, which
        fails while the cluster is away: a miss then, never a daemon that cannot start)."""
        with self._connecting:
            if self._client is None:
                self._client = _open_client(self.settings)
            return self._client

    def _unreachable(self, what: str, exc: BaseException) -> None:
        self._backoff.failed()
        with self._lock:
            self._reachable = False
        self._error(what, error_kind(exc), exc)

    def _error(self, what: str, kind: str, exc: BaseException) -> None:
        node = self._node_of(exc)
        with self._lock:
            self._stats["errors"][kind] += 1
            by_kind = self._node_errors.setdefault(node, dict.fromkeys(ERROR_KINDS, 0))
            by_kind[kind] += 1
        text = str(exc)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        self._warn.warn(kind, f"redis {self.settings.redacted_url}: {what} failed ({kind}): {text}")

    # ---- names and counters -------------------------------------------------------------------

    def _node_of(self, exc: BaseException) -> str:
        """The server an error came from, as host:port (a socket's path): the one server, or for a cluster
        the node its message names ("cluster" when it names none: a refusal of the cluster as a whole)."""
        if not self.settings.cluster:
            return self.settings.address
        found = _ADDRESS.search(str(exc))
        return found[0] if found else "cluster"

    def name(self, ref: Ref) -> bytes:
        """The Redis key an object lives under (for operators: `cache dump` shows it)."""
        return self._name(*ref)

    def _name(self, kind: str, key: bytes, tag: bytes | None) -> bytes:
        self._check_kind(kind)
        for value in (key, tag):
            if value is not None and (not isinstance(value, bytes) or not value):
                raise TypeError(f"keys and tags are non-empty bytes, got {value!r}")
        return b"%s{%s}:%s:%s" % (self._prefix, (key if tag is None else tag).hex().encode(), kind.encode(),
                                  key.hex().encode())

    @staticmethod
    def _check_kind(kind: str) -> None:
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise ValueError(f"an object kind is 1 to 16 of a-z, 0-9 and _, starting with a letter: {kind!r}")

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self._stats[name] += n

    def _count_misses(self, kind: str, n: int) -> None:
        with self._lock:
            self._stats["misses"][kind] += n

    def stats(self) -> dict[str, Any]:
        """Counters since start, plus whether the server answered last time and the last probe's RTT."""
        with self._lock:
            out = {**self._stats, "misses": dict(self._stats["misses"]), "errors": dict(self._stats["errors"]),
                   "node_errors": {node: dict(kinds) for node, kinds in self._node_errors.items()}}
            out.update(reachable=self._reachable, rtt_ms=self._rtt_ms, down=self._backoff.down,
                       used_bytes=self._usage[1] if self._usage else None, quota=self.settings.quota)
        return out


def _open_client(settings: RedisSettings) -> redis.Redis | redis.RedisCluster:
    """A client with the settings' timeouts. A server's client never retries (a retry would multiply the wait;
    the store retries through its backoff). A cluster's retries once: a failed node makes it ask the others
    for the slots again, and that retry reaches a replica promoted meanwhile. MOVED and ASK it follows itself."""
    timeout = settings.timeout_ms / 1000
    common = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if settings.cluster:
        return redis.RedisCluster.from_url(settings.client_url, retry=Retry(NoBackoff(), 1),
                                           require_full_coverage=False, **common)
    return redis.Redis.from_url(settings.url, retry=Retry(NoBackoff(), 0), **common)


def _digest(name: bytes, payload: Buffer) -> bytes:
    h = xxhash.xxh3_128(name)
    h.update(payload)
    return h.digest()


def _seal(name: bytes, payload: Buffer | list[Buffer]) -> bytes:
    """The stored value: header, then payload (one copy, the least a single SET can take). A list of
    buffers is one payload in pieces (a checkpoint as its encoder lays it out), joined here and only here."""
    views = [memoryview(p).cast("B") for p in (payload if isinstance(payload, list) else [payload])]
    h = xxhash.xxh3_128(name)
    for view in views:
        h.update(view)
    return b"".join((HEADER.pack(MAGIC, sum(v.nbytes for v in views), h.digest()), *views))


def _secrets(url: str) -> list[str]:
    """The URL's user name and password, raw and percent-decoded: scrubbed from every message."""
    parts = urlsplit(url)
    found = {s for raw in (parts.password, parts.username) if raw for s in (raw, unquote(raw))}
    return sorted(found, key=len, reverse=True)

"""The LMDB index: rows, their LRU order, ranked prefix aliases, reservations, refcounts, deletions.

Subdatabases of `<data_dir>/index.lmdb` (format INDEX_FORMAT, recorded in `meta`):
  meta      b"format" -> u32 format; b"tiers" -> the tier names, in the rank order the keys below use
  rows      key(32) -> row (see `Row.encode`)
  lru       u8 tier rank || u64 BE last_used_ns || key(32) -> b"": one entry per available row, so the
            least recently used rows of a tier are the first entries of its range, ties broken by key
  prefixes  prefix key(32) -> u8 tier rank || u32 BE tokens || row key(32) || u32 BE n_tokens
            (dupsort: values sort bytewise, so the best row for a prefix, fastest tier then fewest
            tokens, is the first duplicate)
  gone      key(32) -> tier NUL location: payloads of removed rows whose deletion is not yet recorded;
            u8 tier rank || block key(32) -> tier NUL location: the same for blocks
  blocks    u8 tier rank || block key(32) -> u32 refs || u64 size || u8 written: one entry per block a row
            of that tier names, reserved or available; refs counts those rows, so a block goes with its
            last row (its bytes count in the tier's total once, however many rows share it)

A row's lru and prefixes entries change in the transaction that changes the row, so choosing k victims
or the best of any number of rows sharing a prefix costs O(k log N) or O(log N), never a scan.

Readers use LMDB read transactions under a shared hold on the memory map (growing the map replaces it).
Writers are serialised by one first-come first-served lock held for one transaction. The payloads of
removed rows are deleted after it is released (an eviction's, after its last transaction), so a gc of
many rows, done in batches, never holds up a save for more than one short transaction and a lookup not
at all. Their `gone` marks, committed with the removal, make the next open delete them after a crash
instead of adopting them back.

Refcounts, and the LRU touches of restores, are process-local and live in memory: a restore never writes
to LMDB (no fsync on the read path). Touches are folded into the rows (and their lru entries) by the next
writes, FOLD_BATCH at a time, and all that are left, under the lock touches take, just before victims are
chosen, so eviction order is the exact order of use. A crash loses only the recency of the latest restores.

Commits sync their data pages under the write lock; the sync that makes a commit durable (LMDB's meta
page) runs after the lock is released, for the commits that must last: a publish, and a removal before
its payloads are deleted.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import lmdb

from barreld.names import TIER_NAMES, TIER_RANK

from .errors import IndexWriteError

log = logging.getLogger("barreld.cache")

INDEX_FORMAT = 3
INITIAL_MAP_SIZE = 1 << 30
"""The map a new index starts with; it doubles whenever it is three quarters used."""
EVICT_BATCH = 16
"""Rows removed per transaction by an eviction or gc: each transaction stays a few milliseconds long."""
FOLD_BATCH = 128
"""Restores' touches folded per write: a burst of restores with no save between is written back in
several short transactions, not one long one."""
_GROW_AT = 0.75  # of the map in use: the next write doubles it first

RESERVED = "reserved"
AVAILABLE = "available"
_STATUS_CODES = {RESERVED: 0, AVAILABLE: 1}
_STATUSES = {code: name for name, code in _STATUS_CODES.items()}

_ROW_HEAD_2 = struct.Struct("<BBqIqqQdqIII")
_ROW_HEAD = struct.Struct("<BBqIqqQdqIIIIQ")
_BLOCK = struct.Struct("<IQB")
_ROW_ALIAS = struct.Struct("<32sI")
_LRU = struct.Struct(">BQ32s")
_RANKED = struct.Struct(">BI32sI")
_U32 = struct.Struct("<I")
_TIERS = ",".join(TIER_NAMES).encode()
_NO_RANK = 255  # a tier this version does not know sorts after every known one

T = TypeVar("T")


class RowFormatError(ValueError):
    """A stored row that this code cannot read: it is dropped, never guessed at."""


@dataclass(slots=True)
class Row:
    """One checkpoint's index entry. `owner`/`token` identify the writer holding a reservation."""

    key: bytes
    model: str
    tier: str
    size: int
    tokens: int
    text_bytes: int
    save_reason: str
    status: str
    hits: int = 0
    last_used_ns: int = 0
    created: float = 0.0
    location: str | None = None
    owner: int = 0
    token: str = ""
    aliases: tuple[tuple[bytes, int], ...] = ()
    memory: str = "full"  # the model's memory kind
    frontier: int = 0  # leading tokens the state holds reusably (the key covers all `tokens`)
    blocks: tuple[bytes, ...] = ()  # keys of the blocks its payload names, in order (none: a whole state)
    block_size: int = 0  # bytes each of them holds in the tier

    @property
    def stored_bytes(self) -> int:
        """Bytes the row's payload and blocks take, as if none of its blocks were shared."""
        return self.size + len(self.blocks) * self.block_size

    def encode(self) -> bytes:
        """Format 3: `_ROW_HEAD` (format, status, numbers, string, alias and block counts, frontier, block
        size), then model, tier, save_reason, location ('' for none), token and memory kind joined by NUL,
        which none of them can hold, then the (alias key, n_tokens) pairs, then the block keys. Binary, so
        open decodes 100,000 rows in a fraction of a second."""
        strings = "\0".join(
            (self.model, self.tier, self.save_reason, self.location or "", self.token, self.memory)
        ).encode()
        head = _ROW_HEAD.pack(
            INDEX_FORMAT,
            _STATUS_CODES[self.status],
            self.size,
            self.tokens,
            self.text_bytes,
            self.hits,
            self.last_used_ns,
            self.created,
            self.owner,
            len(strings),
            len(self.aliases),
            self.frontier,
            len(self.blocks),
            self.block_size,
        )
        return b"".join((head, strings, *(_ROW_ALIAS.pack(a, n) for a, n in self.aliases), *self.blocks))

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> Row:
        """The row stored under `key`; RowFormatError for anything but a well-formed format 2 or 3 row."""
        head, (model, tier, save_reason, location, token, memory), end = _unpack(key, raw)
        blocks_at = end + head[10] * _ROW_ALIAS.size
        return cls(
            key=bytes(key),
            model=model,
            tier=tier,
            size=head[2],
            tokens=head[3],
            text_bytes=head[4],
            save_reason=save_reason,
            status=_STATUSES[head[1]],
            hits=head[5],
            last_used_ns=head[6],
            created=head[7],
            location=location or None,
            owner=head[8],
            token=token,
            aliases=tuple(_ROW_ALIAS.iter_unpack(raw[end:blocks_at])),
            memory=memory,
            frontier=head[11],
            blocks=tuple(bytes(raw[i : i + 32]) for i in range(blocks_at, len(raw), 32)),
            block_size=head[13],
        )


class Listing(NamedTuple):
    """A file tier's payloads as its scan found them (location -> size), and where it keeps a key's:
    `prefix` + key hex + `suffix`."""

    prefix: str
    suffix: str
    sizes: Mapping[str, int]


class RowHead(NamedTuple):
    """What open needs of a row, decoded without the rest: 100,000 of them must take well under a second."""

    key: bytes
    tier: str
    status: str
    size: int
    location: str | None
    last_used_ns: int


def _unpack(key: bytes, raw: bytes) -> tuple[tuple, list[str], int]:
    """A format 3 row's `_ROW_HEAD` fields (a format 2 row's, with no blocks), its six strings and where its
    aliases start; RowFormatError for anything else."""
    try:
        fmt = _ROW_HEAD if raw[:1] == bytes((INDEX_FORMAT,)) else _ROW_HEAD_2
        head = fmt.unpack_from(raw)
        if fmt is _ROW_HEAD_2:
            head += (0, 0)
        end = fmt.size + head[9]
        fields = raw[fmt.size : end].decode().split("\0")
    except (struct.error, UnicodeDecodeError) as e:
        raise RowFormatError(f"unreadable index row {bytes(key).hex()}: {e}") from None
    if head[0] not in (2, INDEX_FORMAT) or head[1] not in _STATUSES or len(fields) != 6:
        raise RowFormatError(f"index row {bytes(key).hex()} is not a format 2 or {INDEX_FORMAT} row")
    if len(raw) != end + head[10] * _ROW_ALIAS.size + head[12] * 32:
        raise RowFormatError(f"index row {bytes(key).hex()} has a torn alias or block list")
    return head, fields, end


def _decode_v1(key: bytes, raw: bytes) -> Row:
    """A row as format 1 stored it (JSON, aliases as [hex, n] pairs), checked by a format 2 round trip."""
    try:
        d = json.loads(raw)
        d["aliases"] = tuple((bytes.fromhex(k), int(n)) for k, n in d["aliases"])
        return Row.decode(key, Row(key=bytes(key), **d).encode())
    except (ValueError, TypeError, KeyError, AttributeError, struct.error) as e:
        raise RowFormatError(f"unreadable format 1 index row {bytes(key).hex()}: {e}") from None


def _decode_any(key: bytes, raw: bytes) -> Row:
    """A row of any known format: format 1 rows are JSON objects, format 2 and 3 rows start with that byte."""
    return _decode_v1(key, raw) if raw[:1] == b"{" else Row.decode(key, raw)


def _rank(tier: str) -> int:
    return TIER_RANK.get(tier, _NO_RANK)


def _lru_key(row: Row | None) -> bytes | None:
    """A row's lru entry; reserved rows have none (they are never victims)."""
    if row is None or row.status != AVAILABLE:
        return None
    return _LRU.pack(_rank(row.tier), row.last_used_ns, row.key)


def _prefix_entries(row: Row | None) -> set[tuple[bytes, bytes]]:
    """A row's (prefix key, ranked value) entries; reserved rows have none (they cannot be served)."""
    if row is None or row.status != AVAILABLE:
        return set()
    rank = _rank(row.tier)
    return {(alias, _RANKED.pack(rank, row.tokens, row.key, n)) for alias, n in row.aliases}


def _block_id(tier: str, key: bytes) -> bytes:
    """A block's entry key in the blocks sub-database and its gone mark: tier rank, then its key."""
    return bytes((_rank(tier),)) + key


def _merge_touches(into: dict[bytes, tuple[int, int]], more: dict[bytes, tuple[int, int]]) -> None:
    for key, (ns, hits) in more.items():
        old_ns, old_hits = into.get(key, (0, 0))
        into[key] = (max(ns, old_ns), hits + old_hits)


class Payload(NamedTuple):
    """The bytes of a removed row, to delete once the index has let go of them."""

    key: bytes
    tier: str
    location: str


@dataclass(frozen=True)
class Hit:
    """What a lookup found: restore `row_key` and keep its first `n_tokens` of `total_tokens`."""

    row_key: bytes
    n_tokens: int
    tier: str
    total_tokens: int
    text_bytes: int = 0  # rendered bytes of the whole checkpoint (all total_tokens)
    frontier: int = 0  # leading tokens its state holds reusably


@dataclass(frozen=True)
class Reservation:
    """The outcome of `Index.reserve`: status is reserved, duplicate, too_big or no_room."""

    status: str
    token: str = ""
    evicted: int = 0
    unwritten: tuple[bytes, ...] = ()


class _Refused(Exception):
    """Rolls a reservation's transaction back: nothing it referenced or created stays."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


def valid_aliases(key: bytes, tokens: int, aliases: Iterable[tuple[bytes, int]]) -> tuple[tuple[bytes, int], ...]:
    """The aliases worth indexing for a row of `tokens` tokens: proper prefixes, no self-alias, sorted."""
    return tuple(sorted({(bytes(a), int(n)) for a, n in aliases if bytes(a) != key and 0 < int(n) <= tokens}))


@dataclass
class _Walk:
    """An eviction's place in LRU order across `tiers`: rows used after `until` are left alone, and a
    batch resumes after `after` (last_used_ns BE || key of the last entry looked at)."""

    tiers: tuple[str, ...]
    until: int = (1 << 64) - 1
    after: bytes = b""

    def entries(self, txn: lmdb.Transaction, db: lmdb._Database) -> Iterator[bytes]:
        """(last_used_ns BE || key) of the lru entries past `after`, least recently used first."""
        return heapq.merge(*(self._range(txn, db, rank) for rank in sorted({_rank(t) for t in self.tiers})))

    def _range(self, txn: lmdb.Transaction, db: lmdb._Database, rank: int) -> Iterator[bytes]:
        prefix = bytes((rank,))
        cur = txn.cursor(db=db)
        if not cur.set_range(prefix + self.after):
            return
        for entry in cur.iternext(values=False):
            if entry[:1] != prefix:
                return
            if entry[1:] != self.after:
                yield entry[1:]


class _FairLock:
    """A first-come first-served lock: a writer waiting for it gets it before its holder can take it back,
    so the back-to-back transactions of a gc cannot starve a save (a plain lock lets the releasing thread
    take it again before the woken waiter runs)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket that may hold the lock

    def acquire(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _MapGuard:
    """Read transactions share the memory map; growing it replaces the map, so it waits for them to end."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._growing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._growing:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._growing = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._growing = False
                self._cond.notify_all()


class Batch:
    """One write transaction. Changes to byte totals and removed payloads apply only after commit."""

    def __init__(self, index: Index, txn: lmdb.Transaction) -> None:
        self._index = index
        self.txn = txn
        self.removed: list[Payload] = []
        self.defer = False  # leave the removed payloads to the caller (an eviction deletes them at its end)
        self.doomed: list[bytes] = []
        self.durable = False  # made durable before `write` returns
        self.deltas: dict[str, list[int]] = {}  # per tier: stored bytes, rows, logical bytes
        self.folded: dict[bytes, tuple[int, int]] = {}
        self.cleared: list[bytes] = []

    def get(self, key: bytes) -> Row | None:
        raw = self.txn.get(key, db=self._index._rows)
        return Row.decode(key, raw) if raw is not None else None

    def _delta(self, tier: str, size: int, rows: int, logical: int = 0) -> None:
        d = self.deltas.setdefault(tier, [0, 0, 0])
        d[0] += size
        d[1] += rows
        d[2] += logical

    def put(self, row: Row, *, written: bool = False) -> None:
        """Insert or replace a row; its lru and prefix entries follow it, and a new row takes a reference on
        each of its blocks (`written`: their files are known to be in place)."""
        self.store(self.get(row.key), row, written=written)

    def store(self, old: Row | None, row: Row, *, written: bool = False) -> None:
        """`put`, given the row it replaces as read in this transaction (None for a new row)."""
        if old is None:
            self._delta(row.tier, row.size, 1, row.stored_bytes)
            self._ref_blocks(row, written)
        elif old.tier != row.tier or old.size != row.size or old.blocks != row.blocks:
            raise ValueError("a row's tier, size and blocks never change in place")
        self.txn.put(row.key, row.encode(), db=self._index._rows)
        self.relink(old, row)
        if row.status == AVAILABLE and (old is None or old.status != AVAILABLE):
            self.txn.delete(row.key, db=self._index._gone)  # the location is a live row's again

    def remove(self, row: Row, *, delete_bytes: bool = True, blocks: bool = True) -> None:
        """Drop a row, as read in this transaction, and its entries; unless told otherwise its payload is
        marked gone and deleted after commit, and so is each of its blocks no other row refers to."""
        self.txn.delete(row.key, db=self._index._rows)
        self.relink(row, None)
        self._delta(row.tier, -row.size, -1, -row.stored_bytes)
        if delete_bytes and row.location is not None:
            self._gone(row.key, row.tier, row.location)
        if blocks:
            self._unref_blocks(row)

    def _gone(self, key: bytes, tier: str, location: str) -> None:
        self.txn.put(key, f"{tier}\0{location}".encode(), db=self._index._gone)
        self.removed.append(Payload(key, tier, location))

    def block(self, tier: str, key: bytes) -> tuple[int, int, int] | None:
        """A block's (refs, size, written), or None when no row of the tier names it."""
        raw = self.txn.get(_block_id(tier, key), db=self._index._blocks)
        return None if raw is None else _BLOCK.unpack(raw)

    def _ref_blocks(self, row: Row, written: bool) -> None:
        for key in row.blocks:
            entry = self.block(row.tier, key)
            if entry is None:
                self._delta(row.tier, row.block_size, 0)
                entry = (0, row.block_size, int(written))
                self.txn.delete(_block_id(row.tier, key), db=self._index._gone)  # its location lives again
            refs, size, was = entry
            self.txn.put(_block_id(row.tier, key), _BLOCK.pack(refs + 1, size, was or written), db=self._index._blocks)

    def _unref_blocks(self, row: Row) -> None:
        for key in row.blocks:
            entry = self.block(row.tier, key)
            if entry is None:
                continue
            refs, size, written = entry
            bid = _block_id(row.tier, key)
            if refs > 1:
                self.txn.put(bid, _BLOCK.pack(refs - 1, size, written), db=self._index._blocks)
                continue
            self.txn.delete(bid, db=self._index._blocks)
            self._delta(row.tier, -size, 0)
            self._gone(bid, row.tier, self._index.block_location(row.tier, key))

    def mark_blocks(self, row: Row, written: bool) -> None:
        """Record whether the row's blocks are in place (written by a publisher, or found corrupt)."""
        for key in row.blocks:
            entry = self.block(row.tier, key)
            if entry is not None and entry[2] != written:
                self.txn.put(_block_id(row.tier, key), _BLOCK.pack(entry[0], entry[1], written),
                             db=self._index._blocks)

    def relink(self, old: Row | None, new: Row | None) -> None:
        """Replace `old`'s lru and prefix entries with `new`'s, touching only those that differ."""
        index = self._index
        before, after = _lru_key(old), _lru_key(new)
        if before != after:
            if before is not None:
                self.txn.delete(before, db=index._lru)
            if after is not None:
                self.txn.put(after, b"", db=index._lru)
        old_entries, new_entries = _prefix_entries(old), _prefix_entries(new)
        for alias, value in old_entries - new_entries:
            self.txn.delete(alias, value, db=index._prefixes)
        for alias, value in new_entries - old_entries:
            self.txn.put(alias, value, dupdata=True, db=index._prefixes)

    def fold(self, touched: dict[bytes, tuple[int, int]]) -> None:
        """Write restores' recency and hits into their rows (rows removed since are skipped)."""
        for key, (ns, hits) in touched.items():
            row = self.get(key)
            if row is not None:
                self.store(row, replace(row, last_used_ns=max(row.last_used_ns, ns), hits=row.hits + hits))
        _merge_touches(self.folded, touched)


class Index:
    """Rows, LRU order and aliases in LMDB; reservations, eviction and (in memory) refcounts and touches.

    `forget(payload)` runs as a removal commits (the tier stops counting its bytes); `delete(payloads)` runs
    after the write lock is released, removes the bytes durably and returns the keys it could.
    """

    def __init__(
        self,
        path: Path,
        quotas: dict[str, int],
        *,
        forget: Callable[[Payload], None],
        delete: Callable[[list[Payload]], set[bytes]],
        block_location: Callable[[str, bytes], str] = lambda tier, key: f"{key.hex()}.kvb",
    ) -> None:
        path = Path(path)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # metasync off: a commit fsyncs its data pages under the write lock, and `_sync` makes the commits
        # that must last (a publish, a removal before its files go) durable after the lock is released.
        self._env = lmdb.open(str(path), max_dbs=8, map_size=INITIAL_MAP_SIZE, mode=0o600, metasync=False)
        self._env.reader_check()
        self._meta = self._env.open_db(b"meta")
        self._rows = self._env.open_db(b"rows")
        self._lru = self._env.open_db(b"lru")
        self._prefixes = self._env.open_db(b"prefixes", dupsort=True)
        self._gone = self._env.open_db(b"gone")
        self._blocks = self._env.open_db(b"blocks")
        self._block_location = block_location
        self._page = self._env.stat()["psize"]
        self.quotas = dict(quotas)
        self._forget, self._delete = forget, delete
        self._write_lock = _FairLock()
        self._map = _MapGuard()
        self._mem_lock = threading.Lock()  # refs, doomed, touches, deletions, clock
        self._deleted = threading.Condition(self._mem_lock)
        self._refs: dict[bytes, int] = {}
        self._doomed: set[bytes] = set()
        self._touched: dict[bytes, tuple[int, int]] = {}
        self._deleting: dict[bytes, Payload] = {}  # removed, their bytes not deleted yet
        self._unlinking: set[bytes] = set()  # keys whose payload a thread is deleting now
        self._cleared: list[bytes] = []  # keys whose gone mark the next write drops
        self._clock = 0
        self._used: dict[str, int] = dict.fromkeys(quotas, 0)
        self._count: dict[str, int] = dict.fromkeys(quotas, 0)
        self._logical: dict[str, int] = dict.fromkeys(quotas, 0)  # what rows would take with no block shared
        self._upgrade()

    def close(self) -> None:
        """Fold pending LRU touches into the rows, make them durable and close LMDB."""
        self._drain_touches()
        with self.write() as b:
            b.durable = True
        self._env.close()

    def block_location(self, tier: str, key: bytes) -> str:
        """Where a tier keeps a block."""
        return self._block_location(tier, key)

    def now_ns(self) -> int:
        """Wall-clock nanoseconds, strictly increasing, so LRU order never ties."""
        with self._mem_lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            return self._clock

    # ---- format and open ----------------------------------------------------------------------

    def _upgrade(self) -> None:
        """Bring an index of another layout to this one, with one log line; no row is ever misread."""
        with self._reading() as txn:
            raw = txn.get(b"format", db=self._meta)
            tiers = txn.get(b"tiers", db=self._meta)
            has_rows = txn.stat(self._rows)["entries"] > 0
        found = None if raw is None else _U32.unpack(raw)[0]
        if found == INDEX_FORMAT and tiers == _TIERS:
            return
        decode: Callable[[bytes, bytes], Row] | None = _decode_any
        if found == INDEX_FORMAT:
            what = f"was ranked by the tier order {tiers!r}"
        elif found in (None, 2) and has_rows:
            what = f"is in format {found or 1}"
        elif found is None:
            what = ""  # a new index
        else:
            what, decode = f"is in format {found}, which this version cannot read", None
        kept, dropped = self._rewrite(decode)
        if what:
            log.warning(
                "the cache index %s: %d rows rewritten in format %d, %d dropped (a file whose row is gone is "
                "verified and adopted at open)",
                what,
                kept,
                INDEX_FORMAT,
                dropped,
            )

    def _rewrite(self, decode: Callable[[bytes, bytes], Row] | None) -> tuple[int, int]:
        """Re-encode every row `decode` can read, drop the others, and rebuild the lru and prefix entries
        from the rows, in short transactions. Safe to repeat after a crash: the format is set last."""
        with self.write() as b:
            b.txn.drop(self._lru, delete=False)
            b.txn.drop(self._prefixes, delete=False)
            with contextlib.suppress(lmdb.NotFoundError):  # format 1's alias table, if there is one
                b.txn.drop(self._env.open_db(b"aliases", txn=b.txn, create=False, dupsort=True))
        kept = dropped = 0
        after = b""
        while True:
            with self.write() as b:
                chunk = _items_after(b.txn.cursor(db=self._rows), after, EVICT_BATCH)
                for key, raw in chunk:
                    try:
                        if decode is None:
                            raise RowFormatError("unknown format")
                        row = decode(key, raw)
                    except RowFormatError:
                        b.txn.delete(key, db=self._rows)
                        dropped += 1
                        continue
                    b.txn.put(key, row.encode(), db=self._rows)
                    b.relink(None, row)
                    kept += 1
            if len(chunk) < EVICT_BATCH:
                break
            after = chunk[-1][0]
        with self.write() as b:
            b.txn.put(b"format", _U32.pack(INDEX_FORMAT), db=self._meta)
            b.txn.put(b"tiers", _TIERS, db=self._meta)
        return kept, dropped

    def survey(self, listings: Mapping[str, Listing], dropped: Callable[[RowHead, int | None], None]) -> set[str]:
        """One pass over every row at open, each decoded once (its head only), against what the file tiers
        hold (`listings`, from their one directory scan each). A row is kept when it is available and its
        file is where its tier keeps its key, of the size the row says: the locations kept are returned.
        Every other row goes to `dropped` (with the size of the file at its location, if any) and is then
        removed, its payload untouched. Per-tier totals are recounted and the LRU clock restarts after the
        newest row. Rows this version cannot read are dropped, with one log line, and the lru and prefix
        entries rebuilt without them. A row is kept only if every block it names is in place too; the blocks
        are then counted again from the rows kept (their locations are among those returned)."""
        used, count, logical = (dict.fromkeys(self.quotas, 0) for _ in range(3))  # bytes, rows, logical bytes
        kept: set[str] = set()
        lost: list[bytes] = []
        blocks: dict[bytes, list] = {}  # block id -> [refs, size, location, tier]
        clock = bad = 0
        with self._reading() as txn:
            for key, raw in txn.cursor(db=self._rows):  # the hot loop of open: 100,000 rows, kept lean
                try:
                    head, fields, _ = _unpack(key, raw)
                except RowFormatError:
                    bad += 1
                    continue
                tier, size, ns, location = fields[1], head[2], head[6], fields[3]
                used[tier] = used.get(tier, 0) + size
                count[tier] = count.get(tier, 0) + 1
                logical[tier] = logical.get(tier, 0) + size + head[12] * head[13]
                if ns > clock:
                    clock = ns
                listing = listings.get(tier)
                found = listing.sizes.get(location) if listing is not None else None
                home = f"{listing.prefix}{key.hex()}{listing.suffix}" if found == size else None
                chain = _chain(key, raw, head, tier, listing, self._block_location)
                if head[1] == _STATUS_CODES[AVAILABLE] and location == home and chain is not None:
                    kept.add(location)
                    for bid, where in chain:
                        blocks.setdefault(bid, [0, head[13], where, tier])[0] += 1
                    continue
                dropped(RowHead(key, tier, _STATUSES[head[1]], size, location or None, ns), found)
                lost.append(key)
        for _, size, where, tier in blocks.values():
            used[tier] = used.get(tier, 0) + size
            kept.add(where)
        self._used, self._count, self._logical = used, count, logical
        with self._mem_lock:
            self._clock = max(self._clock, clock)
        self._in_batches(lost, self._drop)
        self._recount_blocks(blocks)
        if bad:
            rewritten, gone = self._rewrite(_decode_any)
            log.warning("the cache index held %d unreadable rows: %d dropped, %d kept", bad, gone, rewritten)
        return kept

    def _recount_blocks(self, blocks: dict[bytes, list]) -> None:
        """Block entries as the rows kept at open name them: every block in place, written."""
        with self.write() as b:
            b.txn.drop(self._blocks, delete=False)
            for bid, (refs, size, _, _) in sorted(blocks.items()):
                b.txn.put(bid, _BLOCK.pack(refs, size, 1), db=self._blocks)

    @staticmethod
    def _drop(b: Batch, key: bytes) -> None:
        """Remove a row found at open, leaving its payload to the adoption pass."""
        row = b.get(key)
        if row is not None:
            b.remove(row, delete_bytes=False, blocks=False)  # the blocks are counted again from the rows kept

    def gone(self) -> list[tuple[bytes, str, str]]:
        """(key, tier, location) of removed rows whose payload deletion was never recorded as done."""
        with self._reading() as txn:
            marks = [(bytes(k), v.decode().split("\0", 1)) for k, v in txn.cursor(db=self._gone)]
        return [(key, tier, location) for key, (tier, location) in marks]

    def clear_gone(self, keys: list[bytes]) -> None:
        """Forget gone marks whose payloads are deleted."""
        self._in_batches(keys, lambda b, key: b.txn.delete(key, db=self._gone))

    def _in_batches(self, items: list[T], apply: Callable[[Batch, T], None]) -> None:
        for start in range(0, len(items), EVICT_BATCH):
            with self.write() as b:
                for item in items[start : start + EVICT_BATCH]:
                    apply(b, item)

    # ---- writes -------------------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[Batch]:
        """The one way to change the index: one transaction under one lock. The payloads of removed rows
        are deleted after the lock is released (their gone marks, committed with the removal, cover a
        crash in between)."""
        with self._write_lock:
            try:
                self._grow_if_full()
                batch = Batch(self, self._env.begin(write=True))
            except lmdb.Error as e:
                raise IndexWriteError(f"the index could not start a write: {e}") from e
            try:
                self._begin(batch)
                yield batch
                batch.txn.commit()
            except BaseException as e:
                batch.txn.abort()
                self._rolled_back(batch, e)
                if isinstance(e, lmdb.Error):
                    raise IndexWriteError(f"the index could not commit: {e}") from e
                raise
            self._committed(batch)
        if batch.defer:
            return
        if batch.durable or batch.removed:  # a removal must last before its payloads are deleted
            self._sync()
        self._delete_payloads(batch.removed)

    def _sync(self) -> None:
        """Make every commit so far durable; outside the write lock, so writers do not wait on it."""
        try:
            self._env.sync(True)
        except lmdb.Error as e:  # the commit stands in this process; only a system crash could undo it
            log.warning("syncing the cache index failed: %s", e)

    def _begin(self, batch: Batch) -> None:
        """Start-of-write housekeeping: drop the gone marks of finished deletions, fold pending touches."""
        with self._mem_lock:
            if len(self._touched) <= FOLD_BATCH:
                touched, self._touched = self._touched, {}
            else:  # the oldest first; the rest go with the next writes
                touched = {key: self._touched.pop(key) for key in list(islice(self._touched, FOLD_BATCH))}
            batch.cleared, self._cleared = self._cleared, []
        for key in batch.cleared:
            batch.txn.delete(key, db=self._gone)
        batch.fold(touched)

    def _rolled_back(self, batch: Batch, error: BaseException) -> None:
        with self._mem_lock:
            _merge_touches(self._touched, batch.folded)
            self._cleared.extend(batch.cleared)
            self._doomed.difference_update(batch.doomed)
        if isinstance(error, lmdb.MapFullError):
            self._grow(self._env.info()["map_size"] * 2)

    def _committed(self, batch: Batch) -> None:
        """After commit, still under the write lock: totals, and the tiers stop counting removed bytes."""
        for tier, (size, rows, logical) in batch.deltas.items():
            self._used[tier] = self._used.get(tier, 0) + size
            self._count[tier] = self._count.get(tier, 0) + rows
            self._logical[tier] = self._logical.get(tier, 0) + logical
        for payload in batch.removed:
            try:
                self._forget(payload)
            except Exception:  # committed already; the tier's own accounting is off until it deletes it
                log.exception("forgetting the payload of %s failed", payload.key.hex())
        with self._mem_lock:
            self._doomed.difference_update(batch.doomed)
            self._deleting.update((payload.key, payload) for payload in batch.removed)

    def _delete_payloads(self, payloads: list[Payload]) -> None:
        """Delete removed payloads, outside the write lock, EVICT_BATCH at a time (each batch made durable
        by the tiers before its gone marks go with the next write; a failure leaves its mark for the next
        open). One a publisher of the same key has taken over is skipped."""
        for start in range(0, len(payloads), EVICT_BATCH):
            with self._mem_lock:
                mine = self._claim(p.key for p in payloads[start : start + EVICT_BATCH])
            self._unlink(mine)

    def _claim(self, keys: Iterable[bytes]) -> list[Payload]:
        """Take pending deletions for this thread to do (the memory lock is held)."""
        mine = [self._deleting.pop(key) for key in keys if key in self._deleting]
        self._unlinking.update(p.key for p in mine)
        return mine

    def _unlink(self, payloads: list[Payload]) -> None:
        if not payloads:
            return
        done: set[bytes] = set()
        try:
            done = self._delete(payloads)
        finally:
            with self._mem_lock:
                self._unlinking.difference_update(p.key for p in payloads)
                self._cleared.extend(done)
                self._deleted.notify_all()

    def settle(self, key: bytes) -> None:
        """Make sure no earlier payload of `key` is left to delete, so a new payload under its name is not
        deleted in its place: wait for a deletion under way, or do a pending one now (a gc may not reach
        it for minutes)."""
        with self._deleted:
            while key in self._unlinking:
                self._deleted.wait()
            mine = self._claim((key,))
        self._unlink(mine)

    def _drain_touches(self) -> None:
        """Fold a backlog of touches in short transactions of their own, so that the one that then chooses
        victims (and must fold every touch left, to be exact) stays short too."""
        while len(self._touched) > FOLD_BATCH:
            with self.write():
                pass

    def _grow_if_full(self) -> None:
        """Double the map once it is three quarters used (the write lock is held, no write is open)."""
        info = self._env.info()
        if (info["last_pgno"] + 1) * self._page >= info["map_size"] * _GROW_AT:
            self._grow(info["map_size"] * 2)

    def _grow(self, size: int) -> None:
        with self._map.exclusive():
            self._env.set_mapsize(size)
        log.info("the cache index map grew to %d MiB", size >> 20)

    def _victims(
        self, batch: Batch, walk: _Walk, need: float, *, partial: bool, limit: int | None = None
    ) -> list[Row] | None:
        """Least recently used unreferenced rows along `walk` freeing at least `need` bytes (at most
        `limit` rows), marked doomed so no reader can take a reference before they are gone. None if
        `need` cannot be met and `partial` is false (then nothing is doomed). Touches still pending are
        folded first, under the lock touches take, so the order is exactly the order of use."""
        chosen: list[Row] = []
        freed = 0
        refs: dict[bytes, int] = {}  # references left on the chosen rows' blocks
        with self._mem_lock:
            touched, self._touched = self._touched, {}
            batch.fold(touched)
            for entry in walk.entries(batch.txn, self._lru):
                if freed >= need or len(chosen) == limit or int.from_bytes(entry[:8], "big") > walk.until:
                    break
                walk.after = entry
                key = entry[8:]
                row = None if self._refs.get(key) else batch.get(key)
                if row is not None:
                    chosen.append(row)
                    freed += row.size + self._blocks_freed(batch, row, refs)
            if freed < need and not partial:
                return None
            self._doomed.update(r.key for r in chosen)
        batch.doomed.extend(r.key for r in chosen)
        return chosen

    @staticmethod
    def _blocks_freed(batch: Batch, row: Row, refs: dict[bytes, int]) -> int:
        """Bytes of the row's blocks that removing it (after the rows counted in `refs`) frees."""
        freed = 0
        for key in row.blocks:
            entry = batch.block(row.tier, key)
            if entry is None:
                continue
            left = refs.get(key, entry[0]) - 1
            refs[key] = left
            freed += entry[1] if left == 0 else 0
        return freed

    def reserve(
        self,
        key: bytes,
        tier: str,
        size: int,
        *,
        model: str,
        tokens: int,
        text_bytes: int,
        save_reason: str,
        memory: str = "full",
        frontier: int | None = None,
        blocks: tuple[bytes, ...] = (),
        block_size: int = 0,
    ) -> Reservation:
        """Claim `key` for one writer and `size` bytes of `tier` plus those of its blocks not stored there yet
        (a reference on each), evicting that tier's LRU rows to fit. `unwritten` lists the blocks the writer
        must store before it publishes: those no published row has in place."""
        self._drain_touches()
        try:
            with self.write() as b:
                return self._reserve(b, key, tier, size, model=model, tokens=tokens, text_bytes=text_bytes,
                                     save_reason=save_reason, memory=memory, frontier=frontier, blocks=blocks,
                                     block_size=block_size)
        except _Refused as refused:
            return Reservation(refused.status)

    def _reserve(self, b: Batch, key: bytes, tier: str, size: int, *, frontier: int | None, **fields: Any
                 ) -> Reservation:
        if b.get(key) is not None:
            return Reservation("duplicate")
        token = secrets.token_hex(8)
        row = Row(
            key=key,
            tier=tier,
            size=size,
            frontier=fields["tokens"] if frontier is None else frontier,
            status=RESERVED,
            last_used_ns=self.now_ns(),
            created=time.time(),
            owner=os.getpid(),
            token=token,
            **fields,
        )
        b.put(row)
        quota = self.quotas[tier]
        added = b.deltas[tier][0]
        if added > quota:
            raise _Refused("too_big")
        need = self._used[tier] + added - quota
        victims = self._victims(b, _Walk((tier,)), need, partial=False) if need > 0 else []
        if victims is None:
            raise _Refused("no_room")
        for victim in victims:
            b.remove(victim)
        unwritten = tuple(k for k in row.blocks if not b.block(tier, k)[2])
        return Reservation("reserved", token, len(victims), unwritten)

    def holds(self, key: bytes, token: str) -> bool:
        """Whether the reservation of `key` is still the writer's with this token."""
        row = self.get(key)
        return row is not None and row.status == RESERVED and row.token == token

    def mark_available(self, key: bytes, token: str, location: str, aliases: Iterable[tuple[bytes, int]]) -> bool:
        """Publish a reserved row; False (nothing changed) if the reservation is no longer ours."""
        with self.write() as b:
            row = b.get(key)
            if row is None or row.status != RESERVED or row.token != token:
                return False
            published = replace(
                row,
                status=AVAILABLE,
                location=location,
                last_used_ns=self.now_ns(),
                aliases=valid_aliases(key, row.tokens, aliases),
            )
            b.store(row, published)
            b.mark_blocks(row, True)
            b.durable = True  # acknowledged to the saver: it must survive a system crash
        return True

    def abandon(self, key: bytes, token: str) -> None:
        """Drop our reservation (the write failed); nothing was published."""
        with self.write() as b:
            row = b.get(key)
            if row is not None and row.status == RESERVED and row.token == token:
                b.remove(row, delete_bytes=False)

    def remove(self, key: bytes, token: str | None = None) -> Row | None:
        """Drop a row (e.g. corrupt), even if referenced; with a token, only that very row."""
        with self.write() as b:
            row = b.get(key)
            if row is None or (token is not None and row.token != token):
                return None
            b.remove(row)
        return row

    def supersede(self, key: bytes, by: bytes) -> bool:
        """Drop row `key`, which the store found redundant beside row `by`, unless a reader holds it or the two
        are not both published in one tier; its key and aliases become aliases of `by` (for as many tokens),
        so a lookup or a resume by them finds the newer row. Whether it was dropped."""
        with self.write() as b:
            with self._mem_lock:
                row = None if self._refs.get(key) else b.get(key)
                newer = b.get(by)
                if row is None or newer is None or row.tier != newer.tier or {row.status, newer.status} != {AVAILABLE}:
                    return False
                self._doomed.add(key)
            b.doomed.append(key)
            b.remove(row)
            aliases = valid_aliases(by, newer.tokens, [*newer.aliases, (key, row.tokens), *row.aliases])
            b.store(newer, replace(newer, aliases=aliases))
        return True

    def evict(self, tiers: Iterable[str], need: float) -> tuple[int, int]:
        """Evict unreferenced rows, least recently used first, until `need` bytes are freed or none used
        before the call remain; (rows, bytes) evicted. In transactions of EVICT_BATCH rows, so saves and
        lookups go on between them however long a gc is; the payloads are deleted after the last one."""
        walk = _Walk(tuple(tiers), until=self.now_ns())
        evicted = freed = 0
        removed: list[Payload] = []
        try:
            while freed < need:
                self._drain_touches()
                with self.write() as b:
                    b.defer = True
                    victims = self._victims(b, walk, need - freed, partial=True, limit=EVICT_BATCH) or []
                    for row in victims:
                        b.remove(row)
                removed += b.removed
                evicted += len(victims)
                freed -= sum(d[0] for d in b.deltas.values())  # rows and the blocks they took with them
                if len(victims) < EVICT_BATCH:
                    break
        finally:
            if removed:  # once every removal is in and durable: no deletion competes with those commits
                self._sync()
                self._delete_payloads(removed)
        return evicted, freed

    # ---- references and LRU -------------------------------------------------------------------

    def acquire(self, key: bytes) -> bool:
        """Take a reference so the row is not evicted under its reader; False if it is being evicted."""
        with self._mem_lock:
            if key in self._doomed:
                return False
            self._refs[key] = self._refs.get(key, 0) + 1
            return True

    def release(self, key: bytes) -> None:
        """Drop a reference taken with `acquire`."""
        with self._mem_lock:
            n = self._refs[key] - 1
            if n:
                self._refs[key] = n
            else:
                del self._refs[key]

    def refcount(self, key: bytes) -> int:
        with self._mem_lock:
            return self._refs.get(key, 0)

    def touch(self, key: bytes) -> None:
        """Record a use: most recently used now, one more hit (folded into LMDB by the next write)."""
        ns = self.now_ns()
        with self._mem_lock:
            _, hits = self._touched.get(key, (0, 0))
            self._touched[key] = (ns, hits + 1)

    # ---- reads --------------------------------------------------------------------------------

    @contextmanager
    def _reading(self) -> Iterator[lmdb.Transaction]:
        """A read transaction; it must not write, nor wait for a writer."""
        with self._map.shared(), self._env.begin() as txn:
            yield txn

    def get(self, key: bytes) -> Row | None:
        with self._reading() as txn:
            raw = txn.get(key, db=self._rows)
        return Row.decode(key, raw) if raw is not None else None

    def lookup(self, key: bytes) -> Hit | None:
        """The exact available row, else the best alias: fastest tier, then the fewest tokens, then the
        lowest key. The best alias is the first duplicate of the prefix, however many rows share it."""
        with self._reading() as txn:
            raw = txn.get(key, db=self._rows)
            if raw is not None:
                row = Row.decode(key, raw)
                if row.status == AVAILABLE:
                    return Hit(key, row.tokens, row.tier, row.tokens, row.text_bytes, row.frontier)
            cur = txn.cursor(db=self._prefixes)
            if not cur.set_key(key):
                return None
            for value in cur.iternext_dup():
                _, _, row_key, n = _RANKED.unpack(value)
                raw = txn.get(row_key, db=self._rows)
                row = Row.decode(row_key, raw) if raw is not None else None
                if row is not None and row.status == AVAILABLE:  # else inconsistent: `check` says so
                    return Hit(row_key, n, row.tier, row.tokens, row.text_bytes, row.frontier)
        return None

    def rows(self) -> list[Row]:
        """Every row, with the in-memory hits and recency folded in."""
        with self._reading() as txn:
            rows = [Row.decode(k, v) for k, v in txn.cursor(db=self._rows)]
        with self._mem_lock:
            for row in rows:
                ns, hits = self._touched.get(row.key, (0, 0))
                row.last_used_ns = max(row.last_used_ns, ns)
                row.hits += hits
        return rows

    def blocks(self) -> dict[bytes, tuple[int, int, int]]:
        """Every block entry: (tier rank || key) -> (refs, size, written)."""
        with self._reading() as txn:
            return {bytes(k): _BLOCK.unpack(v) for k, v in txn.cursor(db=self._blocks)}

    def block_refs(self, tier: str, keys: Iterable[bytes]) -> list[int]:
        """How many rows refer to each of these blocks of a tier (0: none)."""
        with self._reading() as txn:
            raws = [txn.get(_block_id(tier, k), db=self._blocks) for k in keys]
        return [0 if raw is None else _BLOCK.unpack(raw)[0] for raw in raws]

    def block_corrupt(self, tier: str, key: bytes) -> None:
        """A block failed verification: the next save that names it writes it again (the same bytes, by its
        key), which repairs every row that shares it."""
        with self.write() as b:
            entry = b.block(tier, key)
            if entry is not None:
                b.txn.put(_block_id(tier, key), _BLOCK.pack(entry[0], entry[1], 0), db=self._blocks)

    def usage(self, tier: str) -> tuple[int, int]:
        """(bytes, rows) of reserved and available rows in a tier."""
        return self._used.get(tier, 0), self._count.get(tier, 0)

    def logical(self, tier: str) -> int:
        """Bytes the tier's rows would take with none of their blocks shared (kept with the totals, so that
        `cache stats` reads no row)."""
        return self._logical.get(tier, 0)

    def check(self) -> list[str]:
        """The index's own consistency: rows readable, lru and prefix entries exactly those the rows
        imply, no gone mark on an available row, per-tier totals equal to the rows."""
        with self._reading() as txn:
            stored = [(bytes(k), v) for k, v in txn.cursor(db=self._rows)]
            lru = set(txn.cursor(db=self._lru).iternext(values=False))
            prefixes = set(txn.cursor(db=self._prefixes).iternext())
            gone = set(txn.cursor(db=self._gone).iternext(values=False))
            blocks = {bytes(k): _BLOCK.unpack(v)[:2] for k, v in txn.cursor(db=self._blocks)}
        problems: list[str] = []
        rows: list[Row] = []
        for key, raw in stored:
            try:
                rows.append(Row.decode(key, raw))
            except RowFormatError as e:
                problems.append(str(e))
        want_lru = {k for k in map(_lru_key, rows) if k is not None}
        want_prefixes = set().union(*map(_prefix_entries, rows))
        problems += [f"lru entry {e[-32:].hex()} belongs to no available row" for e in sorted(lru - want_lru)]
        problems += [f"{e[-32:].hex()}: missing from the lru order" for e in sorted(want_lru - lru)]
        for alias, value in sorted(prefixes - want_prefixes):
            problems.append(f"alias {alias.hex()} -> {value[5:37].hex()} belongs to no row")
        for alias, value in sorted(want_prefixes - prefixes):
            problems.append(f"{value[5:37].hex()}: alias {alias.hex()} missing from the alias table")
        problems += [f"{r.key.hex()}: available but marked gone" for r in rows if _lru_key(r) and r.key in gone]
        return problems + _check_blocks(rows, blocks) + self._check_totals(rows, blocks)

    def _check_totals(self, rows: list[Row], blocks: dict[bytes, tuple[int, int]]) -> list[str]:
        problems = []
        for tier in sorted(set(self.quotas) | {r.tier for r in rows}):
            mine = [r for r in rows if r.tier == tier]
            used, count = self.usage(tier)
            block_bytes = sum(size for bid, (_, size) in blocks.items() if bid[0] == _rank(tier))
            if (used, count) != (sum(r.size for r in mine) + block_bytes, len(mine)):
                problems.append(f"{tier}: totals {used} B / {count} rows disagree with the rows")
            if self.logical(tier) != sum(r.stored_bytes for r in mine):
                problems.append(f"{tier}: logical bytes {self.logical(tier)} disagree with the rows")
        return problems


def _check_blocks(rows: list[Row], blocks: dict[bytes, tuple[int, int]]) -> list[str]:
    """Block entries exactly those the rows name, each with as many references as rows naming it."""
    want: dict[bytes, list[int]] = {}
    for row in rows:
        for key in row.blocks:
            want.setdefault(_block_id(row.tier, key), [0, row.block_size])[0] += 1
    problems = [f"block {bid[1:].hex()}: {blocks.get(bid)} (refs, size) where the rows say {tuple(w)}"
                for bid, w in sorted(want.items()) if blocks.get(bid) != tuple(w)]
    return problems + [f"block {bid[1:].hex()} is named by no row" for bid in sorted(blocks.keys() - want.keys())]


def _chain(key: bytes, raw: bytes, head: tuple, tier: str, listing: Listing | None,
           location: Callable[[str, bytes], str]) -> list[tuple[bytes, str]] | None:
    """(block id, location) of each block a row names, or None when one of them is not in place."""
    if not head[12]:
        return []
    if listing is None:
        return None
    start = len(raw) - head[12] * 32
    chain = []
    for i in range(start, len(raw), 32):
        block = bytes(raw[i : i + 32])
        where = location(tier, block)
        if listing.sizes.get(where) != head[13]:
            return None
        chain.append((_block_id(tier, block), where))
    return chain


def _items_after(cur: lmdb.Cursor, after: bytes, n: int) -> list[tuple[bytes, bytes]]:
    """Up to n (key, value) pairs with keys past `after` (b"": from the first)."""
    if not (cur.set_range(after) if after else cur.first()):
        return []
    out: list[tuple[bytes, bytes]] = []
    for key, value in cur.iternext():
        if key == after:
            continue
        if len(out) == n:
            break
        out.append((bytes(key), bytes(value)))
    return out

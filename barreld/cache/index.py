"""The LMDB index: rows, aliases, reservations, refcounts and eviction order.

Subdatabases of `<data_dir>/index.lmdb`:
  rows     key(32) -> JSON row (see `Row`)
  aliases  prefix key(32) -> row key(32) || u32 n_tokens  (dupsort: one prefix may live in many rows)

Readers use LMDB read transactions and take no lock. Writers are serialised by one lock held across
`write()`: the LMDB commit, then the "after commit" work (deleting the bytes of removed rows), so a
payload never disappears before the index agrees, and the tiers never hold bytes the index has freed
once the lock is released.

Refcounts, and the LRU touches of restores, are process-local and live in memory: a restore never writes
to LMDB (no fsync on the read path). Touches are folded into the rows by the next write and on close; a
crash loses only the recency of the latest restores.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import lmdb

from barreld.names import TIER_RANK

from .errors import IndexWriteError

log = logging.getLogger("barreld.cache")

RESERVED = "reserved"
AVAILABLE = "available"

_ALIAS_N = struct.Struct("<I")


@dataclass
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

    def encode(self) -> bytes:
        d = self.__dict__.copy()
        del d["key"]
        d["aliases"] = [[k.hex(), n] for k, n in self.aliases]
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> Row:
        d = json.loads(raw)
        d["aliases"] = tuple((bytes.fromhex(k), n) for k, n in d["aliases"])
        return cls(key=bytes(key), **d)


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


def valid_aliases(
    key: bytes, tokens: int, aliases: Iterable[tuple[bytes, int]]
) -> tuple[tuple[bytes, int], ...]:
    """The aliases worth indexing for a row of `tokens` tokens: proper prefixes, no self-alias, sorted."""
    return tuple(sorted({(bytes(a), int(n)) for a, n in aliases if bytes(a) != key and 0 < int(n) <= tokens}))


class Batch:
    """One write transaction. Changes to byte totals and removed payloads apply only after commit."""

    def __init__(self, index: Index, txn: lmdb.Transaction) -> None:
        self._index = index
        self.txn = txn
        self.removed: list[Row] = []
        self.doomed: list[bytes] = []
        self.deltas: dict[str, list[int]] = {}

    def get(self, key: bytes) -> Row | None:
        raw = self.txn.get(key, db=self._index._rows)
        return Row.decode(key, raw) if raw is not None else None

    def rows(self) -> list[Row]:
        return [Row.decode(k, v) for k, v in self.txn.cursor(db=self._index._rows)]

    def _delta(self, tier: str, size: int, rows: int) -> None:
        d = self.deltas.setdefault(tier, [0, 0])
        d[0] += size
        d[1] += rows

    def put(self, row: Row) -> None:
        """Insert or replace a row (and register its aliases)."""
        old = self.get(row.key)
        if old is None:
            self._delta(row.tier, row.size, 1)
        elif old.tier != row.tier or old.size != row.size:
            raise ValueError("a row's tier and size never change in place")
        self.txn.put(row.key, row.encode(), db=self._index._rows)
        for alias, n in row.aliases:
            self.txn.put(alias, row.key + _ALIAS_N.pack(n), db=self._index._aliases, dupdata=True)

    def remove(self, row: Row, *, delete_bytes: bool = True) -> None:
        """Drop a row and its aliases; its payload is deleted after commit unless told otherwise."""
        self.txn.delete(row.key, db=self._index._rows)
        for alias, n in row.aliases:
            self.txn.delete(alias, row.key + _ALIAS_N.pack(n), db=self._index._aliases)
        self._delta(row.tier, -row.size, -1)
        if delete_bytes and row.location is not None:
            self.removed.append(row)


class Index:
    """Rows and aliases in LMDB; reservations, eviction and (in memory) refcounts and LRU touches."""

    def __init__(
        self,
        path: Path,
        quotas: dict[str, int],
        on_removed: Callable[[Row], None],
        map_size: int = 1 << 30,
    ) -> None:
        path = Path(path)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), max_dbs=4, map_size=map_size, mode=0o600)
        self._env.reader_check()
        self._rows = self._env.open_db(b"rows")
        self._aliases = self._env.open_db(b"aliases", dupsort=True)
        self.quotas = dict(quotas)
        self._on_removed = on_removed
        self._write_lock = threading.Lock()
        self._mem_lock = threading.Lock()  # refs, doomed, touches, clock
        self._refs: dict[bytes, int] = {}
        self._doomed: set[bytes] = set()
        self._touched: dict[bytes, tuple[int, int]] = {}
        self._clock = 0
        self._used: dict[str, int] = dict.fromkeys(quotas, 0)
        self._count: dict[str, int] = dict.fromkeys(quotas, 0)
        self._recount()

    def close(self) -> None:
        """Fold pending LRU touches into the rows and close LMDB."""
        with self.write():
            pass
        self._env.close()

    def _recount(self) -> None:
        """Recompute per-tier totals from the rows (at open) and start the LRU clock after the newest."""
        with self._write_lock, self._env.begin(db=self._rows) as txn:
            used = dict.fromkeys(self.quotas, 0)
            count = dict.fromkeys(self.quotas, 0)
            for k, v in txn.cursor():
                row = Row.decode(k, v)
                used[row.tier] = used.get(row.tier, 0) + row.size
                count[row.tier] = count.get(row.tier, 0) + 1
                self._clock = max(self._clock, row.last_used_ns)
            self._used, self._count = used, count

    def now_ns(self) -> int:
        """Wall-clock nanoseconds, strictly increasing, so LRU order never ties."""
        with self._mem_lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            return self._clock

    # ---- writes -------------------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[Batch]:
        """The one way to change the index: commit, then run the after-commit deletes, under one lock."""
        with self._write_lock:
            with self._mem_lock:
                touched, self._touched = self._touched, {}
            txn = self._env.begin(write=True, db=self._rows)
            batch = Batch(self, txn)
            try:
                for key, (ns, hits) in touched.items():
                    row = batch.get(key)
                    if row is not None:
                        row.last_used_ns = max(row.last_used_ns, ns)
                        row.hits += hits
                        txn.put(key, row.encode(), db=self._rows)
                yield batch
                txn.commit()
            except BaseException as e:
                txn.abort()
                with self._mem_lock:
                    for key, (ns, hits) in touched.items():
                        old_ns, old_hits = self._touched.get(key, (0, 0))
                        self._touched[key] = (max(ns, old_ns), hits + old_hits)
                    self._doomed.difference_update(batch.doomed)
                if isinstance(e, lmdb.Error):
                    raise IndexWriteError(f"the index could not commit: {e}") from e
                raise
            for tier, (size, rows) in batch.deltas.items():
                self._used[tier] = self._used.get(tier, 0) + size
                self._count[tier] = self._count.get(tier, 0) + rows
            for row in batch.removed:
                try:
                    self._on_removed(row)
                except Exception:  # committed already: the payload is an orphan that open() will adopt
                    log.exception("deleting the payload of %s failed", row.key.hex())
            with self._mem_lock:
                self._doomed.difference_update(batch.doomed)

    def _victims(self, batch: Batch, tiers: Iterable[str], need: float, *, partial: bool) -> list[Row] | None:
        """Least recently used unreferenced rows of `tiers` freeing at least `need` bytes, marked doomed
        so no reader can take a reference before they are gone. None if `need` cannot be met and
        `partial` is false (then nothing is doomed)."""
        tiers = set(tiers)
        candidates = [r for r in batch.rows() if r.tier in tiers and r.status == AVAILABLE]
        with self._mem_lock:
            candidates.sort(key=lambda r: (max(r.last_used_ns, self._touched.get(r.key, (0, 0))[0]), r.key))
            chosen: list[Row] = []
            freed = 0
            for row in candidates:
                if freed >= need:
                    break
                if self._refs.get(row.key):
                    continue
                chosen.append(row)
                freed += row.size
            if freed < need and not partial:
                return None
            self._doomed.update(r.key for r in chosen)
        batch.doomed.extend(r.key for r in chosen)
        return chosen

    def reserve(
        self, key: bytes, tier: str, size: int, *, model: str, tokens: int, text_bytes: int, save_reason: str,
        memory: str = "full", frontier: int | None = None,
    ) -> Reservation:
        """Claim `key` for one writer and `size` bytes of `tier`, evicting that tier's LRU rows to fit."""
        with self.write() as b:
            if b.get(key) is not None:
                return Reservation("duplicate")
            quota = self.quotas[tier]
            if size > quota:
                return Reservation("too_big")
            need = self._used[tier] + size - quota
            victims = self._victims(b, (tier,), need, partial=False) if need > 0 else []
            if victims is None:
                return Reservation("no_room")
            for row in victims:
                b.remove(row)
            token = secrets.token_hex(8)
            b.put(
                Row(
                    key=key,
                    model=model,
                    tier=tier,
                    size=size,
                    tokens=tokens,
                    text_bytes=text_bytes,
                    save_reason=save_reason,
                    memory=memory,
                    frontier=tokens if frontier is None else frontier,
                    status=RESERVED,
                    last_used_ns=self.now_ns(),
                    created=time.time(),
                    owner=os.getpid(),
                    token=token,
                )
            )
        return Reservation("reserved", token, len(victims))

    def holds(self, key: bytes, token: str) -> bool:
        """Whether the reservation of `key` is still the writer's with this token."""
        row = self.get(key)
        return row is not None and row.status == RESERVED and row.token == token

    def mark_available(
        self, key: bytes, token: str, location: str, aliases: Iterable[tuple[bytes, int]]
    ) -> bool:
        """Publish a reserved row; False (nothing changed) if the reservation is no longer ours."""
        with self.write() as b:
            row = b.get(key)
            if row is None or row.status != RESERVED or row.token != token:
                return False
            valid = {(bytes(a), int(n)) for a, n in aliases if bytes(a) != key and 0 < int(n) <= row.tokens}
            b.put(
                replace(
                    row,
                    status=AVAILABLE,
                    location=location,
                    last_used_ns=self.now_ns(),
                    aliases=tuple(sorted(valid)),
                )
            )
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

    def evict(self, tiers: Iterable[str], need: float) -> list[Row]:
        """Evict unreferenced rows, least recently used first, until `need` bytes are freed or none remain."""
        with self.write() as b:
            victims = self._victims(b, tiers, need, partial=True) or []
            for row in victims:
                b.remove(row)
        return victims

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

    def get(self, key: bytes) -> Row | None:
        with self._env.begin(db=self._rows) as txn:
            raw = txn.get(key)
        return Row.decode(key, raw) if raw is not None else None

    def lookup(self, key: bytes) -> Hit | None:
        """The exact available row, else the best alias: fastest tier, then the shortest checkpoint."""
        with self._env.begin(db=self._rows) as txn:
            raw = txn.get(key)
            if raw is not None:
                row = Row.decode(key, raw)
                if row.status == AVAILABLE:
                    return Hit(key, row.tokens, row.tier, row.tokens, row.text_bytes, row.frontier)
            cur = txn.cursor(db=self._aliases)
            if not cur.set_key(key):
                return None
            best: tuple[tuple[int, int], Hit] | None = None
            for value in cur.iternext_dup():
                row_key, n = value[:32], _ALIAS_N.unpack(value[32:])[0]
                raw = txn.get(row_key)
                if raw is None:
                    continue
                row = Row.decode(row_key, raw)
                if row.status != AVAILABLE:
                    continue
                rank = (TIER_RANK.get(row.tier, len(TIER_RANK)), row.tokens)
                if best is None or rank < best[0]:
                    best = (rank, Hit(row_key, n, row.tier, row.tokens, row.text_bytes, row.frontier))
        return best[1] if best else None

    def rows(self) -> list[Row]:
        """Every row, with the in-memory hits and recency folded in."""
        with self._env.begin(db=self._rows) as txn:
            rows = [Row.decode(k, v) for k, v in txn.cursor()]
        with self._mem_lock:
            for row in rows:
                ns, hits = self._touched.get(row.key, (0, 0))
                row.last_used_ns = max(row.last_used_ns, ns)
                row.hits += hits
        return rows

    def alias_entries(self) -> list[tuple[bytes, bytes, int]]:
        """Every (prefix key, row key, n_tokens) alias entry (for consistency checks)."""
        with self._env.begin(db=self._aliases) as txn:
            return [(bytes(k), v[:32], _ALIAS_N.unpack(v[32:])[0]) for k, v in txn.cursor().iternext()]

    def usage(self, tier: str) -> tuple[int, int]:
        """(bytes, rows) of reserved and available rows in a tier."""
        return self._used.get(tier, 0), self._count.get(tier, 0)

"""The index: rows, their LRU order, ranked prefix aliases, reservations, refcounts, deletions (its LMDB tables:
`tables`; their entries: `rows`).

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

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from . import audit, migrate, survey
from .batch import Batch, Payload, merge_touches
from .errors import IndexWriteError
from .locks import FairLock
from .rows import (
    AVAILABLE,
    BLOCK_ENTRY,
    INDEX_FORMAT,
    RANKED,
    RESERVED,
    LruWalk,
    Row,
    RowFormatError,
    block_id,
    decode_any,
    valid_aliases,
)
from .survey import Listing, RowHead
from .tables import Tables

__all__ = [
    "AVAILABLE", "INDEX_FORMAT", "RESERVED", "Batch", "Hit", "Index", "Listing", "Payload", "Reservation", "Row",
    "RowFormatError", "RowHead", "block_id", "valid_aliases",
]

log = logging.getLogger("barreld.cache")

EVICT_BATCH = 16
"""Rows removed per transaction by an eviction or gc, so that each transaction stays short."""
FOLD_BATCH = 128
"""Restores' touches folded per write: a burst of restores with no save between is written back in
several short transactions, not one long one."""

T = TypeVar("T")


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
        self.tables = Tables(path)
        self._block_location = block_location
        self.quotas = dict(quotas)
        self._forget, self._delete = forget, delete
        self._write_lock = FairLock()
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
        migrate.upgrade(self)

    def close(self) -> None:
        """Fold pending LRU touches into the rows, make them durable and close LMDB."""
        self.drain_touches()
        with self.write() as b:
            b.durable = True
        self.tables.close()

    def block_location(self, tier: str, key: bytes) -> str:
        """Where a tier keeps a block."""
        return self._block_location(tier, key)

    def now_ns(self) -> int:
        """Wall-clock nanoseconds, strictly increasing, so LRU order never ties."""
        with self._mem_lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            return self._clock

    # ---- format and open ----------------------------------------------------------------------

    def survey(self, listings: Mapping[str, Listing], dropped: Callable[[RowHead, int | None], None]) -> set[str]:
        """One pass over every row at open against what the file tiers hold (`listings`, from their one
        directory scan each): the locations of the rows kept, and of their blocks, are returned (see
        `survey.survey`). Every other row goes to `dropped` and is then removed, its payload untouched.
        Per-tier totals and block entries are counted again from the rows, and the LRU clock restarts after
        the newest row. Rows this version cannot read are dropped, with one log line, and the lru and prefix
        entries rebuilt without them."""
        with self.tables.reading() as txn:
            found = survey.survey(txn, self.tables.rows, self.quotas, listings, self._block_location, dropped)
        self._used, self._count, self._logical = found.used, found.count, found.logical
        with self._mem_lock:
            self._clock = max(self._clock, found.clock)
        self._in_batches(found.lost, self._drop)
        self._recount_blocks(found.blocks)
        if found.bad:
            rewritten, gone = migrate.rewrite(self, decode_any)
            log.warning("the cache index held %d unreadable rows: %d dropped, %d kept", found.bad, gone, rewritten)
        return found.kept

    def _recount_blocks(self, blocks: dict[bytes, list]) -> None:
        """Block entries as the rows kept at open name them: every block in place, written."""
        with self.write() as b:
            b.txn.drop(self.tables.blocks, delete=False)
            for bid, (refs, size, _, _) in sorted(blocks.items()):
                b.txn.put(bid, BLOCK_ENTRY.pack(refs, size, 1), db=self.tables.blocks)

    @staticmethod
    def _drop(b: Batch, key: bytes) -> None:
        """Remove a row found at open, leaving its payload to the adoption pass."""
        row = b.get(key)
        if row is not None:
            b.remove(row, delete_bytes=False, blocks=False)  # the blocks are counted again from the rows kept

    def gone(self) -> list[tuple[bytes, str, str]]:
        """(key, tier, location) of removed rows whose payload deletion was never recorded as done."""
        with self.tables.reading() as txn:
            marks = [(bytes(k), v.decode().split("\0", 1)) for k, v in txn.cursor(db=self.tables.gone)]
        return [(key, tier, location) for key, (tier, location) in marks]

    def clear_gone(self, keys: list[bytes]) -> None:
        """Forget gone marks whose payloads are deleted."""
        self._in_batches(keys, lambda b, key: b.txn.delete(key, db=self.tables.gone))

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
                self.tables.grow_if_full()
                batch = Batch(self.tables, self.tables.env.begin(write=True), self._block_location)
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
            self.tables.sync()
        self._delete_payloads(batch.removed)

    def _begin(self, batch: Batch) -> None:
        """Start-of-write housekeeping: drop the gone marks of finished deletions, fold pending touches."""
        with self._mem_lock:
            if len(self._touched) <= FOLD_BATCH:
                touched, self._touched = self._touched, {}
            else:  # the oldest first; the rest go with the next writes
                touched = {key: self._touched.pop(key) for key in list(islice(self._touched, FOLD_BATCH))}
            batch.cleared, self._cleared = self._cleared, []
        for key in batch.cleared:
            batch.txn.delete(key, db=self.tables.gone)
        batch.fold(touched)

    def _rolled_back(self, batch: Batch, error: BaseException) -> None:
        with self._mem_lock:
            merge_touches(self._touched, batch.folded)
            self._cleared.extend(batch.cleared)
            self._doomed.difference_update(batch.doomed)
        if isinstance(error, lmdb.MapFullError):
            self.tables.grow()

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

    def drain_touches(self) -> None:
        """Fold a backlog of touches in short transactions of their own, so that the one that then chooses
        victims (and must fold every touch left, to be exact) stays short too."""
        while len(self._touched) > FOLD_BATCH:
            with self.write():
                pass

    def _victims(
        self, batch: Batch, walk: LruWalk, need: float, *, partial: bool, limit: int | None = None
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
            for entry in walk.entries(batch.txn, self.tables.lru):
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
        tenant: str = "",
        namespace: bytes = b"",
    ) -> Reservation:
        """Claim `key` for one writer and `size` bytes of `tier` plus those of its blocks not stored there yet
        (a reference on each), evicting that tier's LRU rows to fit. `unwritten` lists the blocks the writer
        must store before it publishes: those no published row has in place."""
        self.drain_touches()
        try:
            with self.write() as b:
                return self._reserve(b, key, tier, size, model=model, tokens=tokens, text_bytes=text_bytes,
                                     save_reason=save_reason, memory=memory, frontier=frontier, blocks=blocks,
                                     block_size=block_size, tenant=tenant, namespace=namespace)
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
        victims = self._victims(b, LruWalk((tier,)), need, partial=False) if need > 0 else []
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
        walk = LruWalk(tuple(tiers), until=self.now_ns())
        evicted = freed = 0
        removed: list[Payload] = []
        try:
            while freed < need:
                self.drain_touches()
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
                self.tables.sync()
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

    def get(self, key: bytes) -> Row | None:
        with self.tables.reading() as txn:
            raw = txn.get(key, db=self.tables.rows)
        return Row.decode(key, raw) if raw is not None else None

    def lookup(self, key: bytes) -> Hit | None:
        """The exact available row, else the best alias: fastest tier, then the fewest tokens, then the
        lowest key. The best alias is the first duplicate of the prefix, however many rows share it."""
        with self.tables.reading() as txn:
            raw = txn.get(key, db=self.tables.rows)
            if raw is not None:
                row = Row.decode(key, raw)
                if row.status == AVAILABLE:
                    return Hit(key, row.tokens, row.tier, row.tokens, row.text_bytes, row.frontier)
            cur = txn.cursor(db=self.tables.prefixes)
            if not cur.set_key(key):
                return None
            for value in cur.iternext_dup():
                _, _, row_key, n = RANKED.unpack(value)
                raw = txn.get(row_key, db=self.tables.rows)
                row = Row.decode(row_key, raw) if raw is not None else None
                if row is not None and row.status == AVAILABLE:  # else inconsistent: `check` says so
                    return Hit(row_key, n, row.tier, row.tokens, row.text_bytes, row.frontier)
        return None

    def rows(self) -> list[Row]:
        """Every row, with the in-memory hits and recency folded in."""
        with self.tables.reading() as txn:
            rows = [Row.decode(k, v) for k, v in txn.cursor(db=self.tables.rows)]
        with self._mem_lock:
            for row in rows:
                ns, hits = self._touched.get(row.key, (0, 0))
                row.last_used_ns = max(row.last_used_ns, ns)
                row.hits += hits
        return rows

    def blocks(self) -> dict[bytes, tuple[int, int, int]]:
        """Every block entry: (tier rank || key) -> (refs, size, written)."""
        with self.tables.reading() as txn:
            return {bytes(k): BLOCK_ENTRY.unpack(v) for k, v in txn.cursor(db=self.tables.blocks)}

    def block_refs(self, tier: str, keys: Iterable[bytes]) -> list[int]:
        """How many rows refer to each of these blocks of a tier (0: none)."""
        with self.tables.reading() as txn:
            raws = [txn.get(block_id(tier, k), db=self.tables.blocks) for k in keys]
        return [0 if raw is None else BLOCK_ENTRY.unpack(raw)[0] for raw in raws]

    def block_corrupt(self, tier: str, key: bytes) -> None:
        """A block failed verification: the next save that names it writes it again (the same bytes, by its
        key), which repairs every row that shares it."""
        with self.write() as b:
            entry = b.block(tier, key)
            if entry is not None:
                b.txn.put(block_id(tier, key), BLOCK_ENTRY.pack(entry[0], entry[1], 0), db=self.tables.blocks)

    def usage(self, tier: str) -> tuple[int, int]:
        """(bytes, rows) of reserved and available rows in a tier."""
        return self._used.get(tier, 0), self._count.get(tier, 0)

    def logical(self, tier: str) -> int:
        """Bytes the tier's rows would take with none of their blocks shared (kept with the totals, so that
        `cache stats` reads no row)."""
        return self._logical.get(tier, 0)

    def check(self) -> list[str]:
        """The index's own consistency (see `audit.index_problems`); the problems found."""
        return audit.index_problems(self)

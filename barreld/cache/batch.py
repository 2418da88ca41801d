"""One write transaction of the index: a row's lru and prefix entries and its blocks' references change with
it; byte totals and removed payloads apply only once it commits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import lmdb

from .rows import AVAILABLE, BLOCK_ENTRY, Row, block_id, lru_key, prefix_entries
from .tables import Tables


class Payload(NamedTuple):
    """The bytes of a removed row, to delete once the index has let go of them."""

    key: bytes
    tier: str
    location: str



def merge_touches(into: dict[bytes, tuple[int, int]], more: dict[bytes, tuple[int, int]]) -> None:
    """Add the touches `more` to `into`: the later time, the hits summed."""
    for key, (ns, hits) in more.items():
        old_ns, old_hits = into.get(key, (0, 0))
        into[key] = (max(ns, old_ns), hits + old_hits)



class Batch:
    """One write transaction. Changes to byte totals and removed payloads apply only after commit."""

    def __init__(self, tables: Tables, txn: lmdb.Transaction, block_location: Callable[[str, bytes], str]) -> None:
        self._tables = tables
        self._block_location = block_location
        self.txn = txn
        self.removed: list[Payload] = []
        self.defer = False  # leave the removed payloads to the caller (an eviction deletes them at its end)
        self.doomed: list[bytes] = []
        self.durable = False  # made durable before `write` returns
        self.deltas: dict[str, list[int]] = {}  # per tier: stored bytes, rows, logical bytes
        self.folded: dict[bytes, tuple[int, int]] = {}
        self.cleared: list[bytes] = []

    def get(self, key: bytes) -> Row | None:
        raw = self.txn.get(key, db=self._tables.rows)
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
        self.txn.put(row.key, row.encode(), db=self._tables.rows)
        self.relink(old, row)
        if row.status == AVAILABLE and (old is None or old.status != AVAILABLE):
            self.txn.delete(row.key, db=self._tables.gone)  # the location is a live row's again

    def remove(self, row: Row, *, delete_bytes: bool = True, blocks: bool = True) -> None:
        """Drop a row, as read in this transaction, and its entries; unless told otherwise its payload is
        marked gone and deleted after commit, and so is each of its blocks no other row refers to."""
        self.txn.delete(row.key, db=self._tables.rows)
        self.relink(row, None)
        self._delta(row.tier, -row.size, -1, -row.stored_bytes)
        if delete_bytes and row.location is not None:
            self._gone(row.key, row.tier, row.location)
        if blocks:
            self._unref_blocks(row)

    def _gone(self, key: bytes, tier: str, location: str) -> None:
        self.txn.put(key, f"{tier}\0{location}".encode(), db=self._tables.gone)
        self.removed.append(Payload(key, tier, location))

    def block(self, tier: str, key: bytes) -> tuple[int, int, int] | None:
        """A block's (refs, size, written), or None when no row of the tier names it."""
        raw = self.txn.get(block_id(tier, key), db=self._tables.blocks)
        return None if raw is None else BLOCK_ENTRY.unpack(raw)

    def _ref_blocks(self, row: Row, written: bool) -> None:
        for key in row.blocks:
            entry = self.block(row.tier, key)
            if entry is None:
                self._delta(row.tier, row.block_size, 0)
                entry = (0, row.block_size, int(written))
                self.txn.delete(block_id(row.tier, key), db=self._tables.gone)  # its location lives again
            refs, size, was = entry
            self.txn.put(block_id(row.tier, key), BLOCK_ENTRY.pack(refs + 1, size, was or written),
                         db=self._tables.blocks)

    def _unref_blocks(self, row: Row) -> None:
        for key in row.blocks:
            entry = self.block(row.tier, key)
            if entry is None:
                continue
            refs, size, written = entry
            bid = block_id(row.tier, key)
            if refs > 1:
                self.txn.put(bid, BLOCK_ENTRY.pack(refs - 1, size, written), db=self._tables.blocks)
                continue
            self.txn.delete(bid, db=self._tables.blocks)
            self._delta(row.tier, -size, 0)
            self._gone(bid, row.tier, self._block_location(row.tier, key))

    def mark_blocks(self, row: Row, written: bool) -> None:
        """Record whether the row's blocks are in place (written by a publisher, or found corrupt)."""
        for key in row.blocks:
            entry = self.block(row.tier, key)
            if entry is not None and entry[2] != written:
                self.txn.put(block_id(row.tier, key), BLOCK_ENTRY.pack(entry[0], entry[1], written),
                             db=self._tables.blocks)

    def relink(self, old: Row | None, new: Row | None) -> None:
        """Replace `old`'s lru and prefix entries with `new`'s, touching only those that differ."""
        tables = self._tables
        before, after = lru_key(old), lru_key(new)
        if before != after:
            if before is not None:
                self.txn.delete(before, db=tables.lru)
            if after is not None:
                self.txn.put(after, b"", db=tables.lru)
        old_entries, new_entries = prefix_entries(old), prefix_entries(new)
        for alias, value in old_entries - new_entries:
            self.txn.delete(alias, value, db=tables.prefixes)
        for alias, value in new_entries - old_entries:
            self.txn.put(alias, value, dupdata=True, db=tables.prefixes)

    def fold(self, touched: dict[bytes, tuple[int, int]]) -> None:
        """Write restores' recency and hits into their rows (rows removed since are skipped)."""
        for key, (ns, hits) in touched.items():
            row = self.get(key)
            if row is not None:
                self.store(row, replace(row, last_used_ns=max(row.last_used_ns, ns), hits=row.hits + hits))
        merge_touches(self.folded, touched)

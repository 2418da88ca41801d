"""The index's LMDB environment, `<data_dir>/index.lmdb`: its tables, read transactions and map growth.

Tables (format INDEX_FORMAT, recorded in `meta`; entries encoded by `rows`):
  meta      b"format" -> u32 format; b"tiers" -> the tier names, in the rank order the keys below use
  rows      key(32) -> row (see `Row.encode`)
  lru       u8 tier rank || u64 BE last_used_ns || key(32) -> b"": one entry per available row, so the
            least recently used rows of a tier are the first entries of its range, ties broken by key
  prefixes  prefix key(32) -> u8 tier rank || u32 BE tokens || row key(32) || u32 BE n_tokens
            (dupsort: values sort bytewise, so the best row for a prefix, fastest tier then fewest
            tokens, is the first duplicate)
  gone      key(32) -> tier NUL location: payloads of removed rows whose deletion is not yet recorded;
            block id -> tier NUL location: the same for blocks
  blocks    block id (u8 tier rank || block key(32)) -> u32 refs || u64 size || u8 written: one entry per
            block a row of that tier names, reserved or available; refs counts those rows, so a block goes
            with its last row (its bytes count in the tier's total once, however many rows share it)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from .locks import MapGuard

log = logging.getLogger("barreld.cache")

INITIAL_MAP_SIZE = 1 << 30
"""The map a new index starts with; it doubles whenever it is three quarters used."""
_GROW_AT = 0.75  # of the map in use: the next write doubles it first


class Tables:
    """The environment and its tables. Readers take `reading()`; a writer grows the map, if it is nearly
    full, before it begins (`grow_if_full`, under the write lock)."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # metasync off: a commit fsyncs its data pages under the write lock, and `sync` makes the commits
        # that must last (a publish, a removal before its files go) durable after the lock is released.
        self.env = lmdb.open(str(path), max_dbs=8, map_size=INITIAL_MAP_SIZE, mode=0o600, metasync=False)
        self.env.reader_check()
        self.meta = self.env.open_db(b"meta")
        self.rows = self.env.open_db(b"rows")
        self.lru = self.env.open_db(b"lru")
        self.prefixes = self.env.open_db(b"prefixes", dupsort=True)
        self.gone = self.env.open_db(b"gone")
        self.blocks = self.env.open_db(b"blocks")
        self._page = self.env.stat()["psize"]
        self._map = MapGuard()

    def close(self) -> None:
        self.env.close()

    @contextmanager
    def reading(self) -> Iterator[lmdb.Transaction]:
        """A read transaction; it must not write, nor wait for a writer."""
        with self._map.shared(), self.env.begin() as txn:
            yield txn

    def sync(self) -> None:
        """Make every commit so far durable; outside the write lock, so writers do not wait on it."""
        try:
            self.env.sync(True)
        except lmdb.Error as e:  # the commit stands in this process; only a system crash could undo it
            log.warning("syncing the cache index failed: %s", e)

    def grow_if_full(self) -> None:
        """Double the map once it is three quarters used (the write lock is held, no write is open)."""
        info = self.env.info()
        if (info["last_pgno"] + 1) * self._page >= info["map_size"] * _GROW_AT:
            self.grow()

    def grow(self) -> None:
        """Double the map, once every read transaction has ended."""
        size = self.env.info()["map_size"] * 2
        with self._map.exclusive():
            self.env.set_mapsize(size)
        log.info("the cache index map grew to %d MiB", size >> 20)

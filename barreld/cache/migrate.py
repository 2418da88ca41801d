"""Format migrations of the index: an index of another layout is rewritten in this one at open, with one log
line; no row is ever misread."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import lmdb

from .rows import INDEX_FORMAT, TIERS, U32, Row, RowFormatError, decode_any

if TYPE_CHECKING:
    from .index import Index

log = logging.getLogger("barreld.cache")

BATCH = 16
"""Rows rewritten per transaction."""


def upgrade(index: Index) -> None:
    """Bring an index of another layout to this one, with one log line; no row is ever misread."""
    tables = index.tables
    with tables.reading() as txn:
        raw = txn.get(b"format", db=tables.meta)
        tiers = txn.get(b"tiers", db=tables.meta)
        has_rows = txn.stat(tables.rows)["entries"] > 0
    found = None if raw is None else U32.unpack(raw)[0]
    if found == INDEX_FORMAT and tiers == TIERS:
        return
    decode: Callable[[bytes, bytes], Row] | None = decode_any
    if found == INDEX_FORMAT:
        what = f"was ranked by the tier order {tiers!r}"
    elif found in (2, 3) or (found is None and has_rows):
        what = f"is in format {found or 1}"
    elif found is None:
        what = ""  # a new index
    else:
        what, decode = f"is in format {found}, which this version cannot read", None
    kept, dropped = rewrite(index, decode)
    if what:
        log.warning(
            "the cache index %s: %d rows rewritten in format %d, %d dropped (a file whose row is gone is "
            "verified and adopted at open)",
            what,
            kept,
            INDEX_FORMAT,
            dropped,
        )


def rewrite(index: Index, decode: Callable[[bytes, bytes], Row] | None) -> tuple[int, int]:
    """Re-encode every row `decode` can read, drop the others, and rebuild the lru and prefix entries
    from the rows, in short transactions. Safe to repeat after a crash: the format is set last."""
    tables = index.tables
    with index.write() as b:
        b.txn.drop(tables.lru, delete=False)
        b.txn.drop(tables.prefixes, delete=False)
        with contextlib.suppress(lmdb.NotFoundError):  # format 1's alias table, if there is one
            b.txn.drop(tables.env.open_db(b"aliases", txn=b.txn, create=False, dupsort=True))
    kept = dropped = 0
    after = b""
    while True:
        with index.write() as b:
            chunk = _items_after(b.txn.cursor(db=tables.rows), after, BATCH)
            for key, raw in chunk:
                try:
                    if decode is None:
                        raise RowFormatError("unknown format")
                    row = decode(key, raw)
                except RowFormatError:
                    b.txn.delete(key, db=tables.rows)
                    dropped += 1
                    continue
                b.txn.put(key, row.encode(), db=tables.rows)
                b.relink(None, row)
                kept += 1
        if len(chunk) < BATCH:
            break
        after = chunk[-1][0]
    with index.write() as b:
        b.txn.put(b"format", U32.pack(INDEX_FORMAT), db=tables.meta)
        b.txn.put(b"tiers", TIERS, db=tables.meta)
    return kept, dropped


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

"""Audits of the cache: the index's own consistency, and the store's rows, payloads, blocks and quotas
against it (`check`); every published row read back and verified (`verify`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .rows import BLOCK_ENTRY, Row, RowFormatError, block_id, lru_key, prefix_entries, rank

if TYPE_CHECKING:
    from .index import Index


def index_problems(index: Index) -> list[str]:
    """The index's own consistency: rows readable, lru and prefix entries exactly those the rows
    imply, no gone mark on an available row, per-tier totals equal to the rows."""
    tables = index.tables
    with tables.reading() as txn:
        stored = [(bytes(k), v) for k, v in txn.cursor(db=tables.rows)]
        lru = set(txn.cursor(db=tables.lru).iternext(values=False))
        prefixes = set(txn.cursor(db=tables.prefixes).iternext())
        gone = set(txn.cursor(db=tables.gone).iternext(values=False))
        blocks = {bytes(k): BLOCK_ENTRY.unpack(v)[:2] for k, v in txn.cursor(db=tables.blocks)}
    problems: list[str] = []
    rows: list[Row] = []
    for key, raw in stored:
        try:
            rows.append(Row.decode(key, raw))
        except RowFormatError as e:
            problems.append(str(e))
    want_lru = {k for k in map(lru_key, rows) if k is not None}
    want_prefixes = set().union(*map(prefix_entries, rows))
    problems += [f"lru entry {e[-32:].hex()} belongs to no available row" for e in sorted(lru - want_lru)]
    problems += [f"{e[-32:].hex()}: missing from the lru order" for e in sorted(want_lru - lru)]
    for alias, value in sorted(prefixes - want_prefixes):
        problems.append(f"alias {alias.hex()} -> {value[5:37].hex()} belongs to no row")
    for alias, value in sorted(want_prefixes - prefixes):
        problems.append(f"{value[5:37].hex()}: alias {alias.hex()} missing from the alias table")
    problems += [f"{r.key.hex()}: available but marked gone" for r in rows if lru_key(r) and r.key in gone]
    return problems + _check_blocks(rows, blocks) + _check_totals(index, rows, blocks)


def _check_totals(index: Index, rows: list[Row], blocks: dict[bytes, tuple[int, int]]) -> list[str]:
    """Per-tier totals, bytes, rows and logical bytes, as the rows and block entries add up."""
    problems = []
    for tier in sorted(set(index.quotas) | {r.tier for r in rows}):
        mine = [r for r in rows if r.tier == tier]
        used, count = index.usage(tier)
        block_bytes = sum(size for bid, (_, size) in blocks.items() if bid[0] == rank(tier))
        if (used, count) != (sum(r.size for r in mine) + block_bytes, len(mine)):
            problems.append(f"{tier}: totals {used} B / {count} rows disagree with the rows")
        if index.logical(tier) != sum(r.stored_bytes for r in mine):
            problems.append(f"{tier}: logical bytes {index.logical(tier)} disagree with the rows")
    return problems


def _check_blocks(rows: list[Row], blocks: dict[bytes, tuple[int, int]]) -> list[str]:
    """Block entries exactly those the rows name, each with as many references as rows naming it."""
    want: dict[bytes, list[int]] = {}
    for row in rows:
        for key in row.blocks:
            want.setdefault(block_id(row.tier, key), [0, row.block_size])[0] += 1
    problems = [f"block {bid[1:].hex()}: {blocks.get(bid)} (refs, size) where the rows say {tuple(w)}"
                for bid, w in sorted(want.items()) if blocks.get(bid) != tuple(w)]
    return problems + [f"block {bid[1:].hex()} is named by no row" for bid in sorted(blocks.keys() - want.keys())]


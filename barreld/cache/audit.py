"""Audits of the cache: the index's own consistency, and the store's rows, payloads, blocks and quotas
against it (`check`); every published row read back and verified (`verify`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from barreld.names import TIER_NAMES

from .rows import AVAILABLE, BLOCK_ENTRY, RESERVED, Row, RowFormatError, block_id, lru_key, prefix_entries, rank
from .tiers import BLOCK_SUFFIX, FileTier, Tier

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


def verify(index: Index, read_verified: Callable[[Row], object | None],
           progress: Callable[[int, int], None] | None = None) -> tuple[int, list[str]]:
    """Re-read and verify every available row; drop the bad ones. Returns (checked, bad keys as hex)."""
    rows = [r for r in index.rows() if r.status == AVAILABLE]
    checked, bad = 0, []
    for i, row in enumerate(rows, 1):
        if index.acquire(row.key):
            try:
                current = index.get(row.key)
                if current is not None and current.token == row.token:
                    checked += 1
                    if read_verified(current) is None:
                        bad.append(row.key.hex())
            finally:
                index.release(row.key)
        if progress is not None:
            progress(i, len(rows))
    return checked, bad


def store_problems(index: Index, tiers: dict[str, Tier], in_flight: set[str]) -> list[str]:
    """Consistency of index, payloads and quotas; the problems found (none is healthy).

    Meant for quiet moments (tests, `cache verify`): the saves in flight (their keys' hex in `in_flight`) are
    allowed their reserved rows, temp files and not-yet-indexed files.
    """
    rows = index.rows()
    stored = {name: tier.scan() for name, tier in tiers.items()}
    problems = index.check()
    problems += [p for r in rows if (p := _row_problem(tiers, r, stored, in_flight)) is not None]
    block_files = _block_problems(index, tiers, stored, problems, bool(in_flight))
    for name, tier in tiers.items():
        rest = {loc: n for loc, n in stored[name].items() if loc not in block_files}
        problems += _tier_problems(index, tier, [r for r in rows if r.tier == name], rest, in_flight)
        if not in_flight and tier.used != sum(stored[name].values()):
            problems.append(f"{name}: tier counts {tier.used} bytes, holds {sum(stored[name].values())}")
    return problems


def _block_problems(index: Index, tiers: dict[str, Tier], stored: dict[str, dict[str, int]], problems: list[str],
                    busy: bool) -> set[str]:
    """Block files against block entries: each entry in place (once written), of its size; no block file
    without an entry (unless saves are in flight). Returns the locations of every block file."""
    entries = {}
    for bid, (_, size, written) in index.blocks().items():
        tier = tiers[TIER_NAMES[bid[0]]]
        entries[(tier.name, tier.block_location(bid[1:].hex()))] = (size, written)
    files = set()
    for name, found in stored.items():
        for location in found:
            if location.endswith(BLOCK_SUFFIX):
                files.add(location)
                if (name, location) not in entries and not busy:
                    problems.append(f"{name}: block {location} is named by no row")
    for (name, location), (size, written) in sorted(entries.items()):
        n = stored[name].get(location)
        if (written or n is not None) and n != size and not (busy and n is None):
            problems.append(f"{name}: block {location} is {n} bytes, its entry says {size}")
    return files


def _row_problem(tiers: dict[str, Tier], r: Row, stored: dict[str, dict[str, int]], in_flight: set[str]) -> str | None:
    name = r.key.hex()
    tier = tiers.get(r.tier)
    if tier is None:
        return f"{name}: unknown tier {r.tier!r}"
    if r.status == RESERVED:
        return None if name in in_flight else f"{name}: reserved with no save in flight"
    if r.location != _location_for(tier, r.key):
        return f"{name}: location {r.location} is not where {r.tier} keeps it"
    size = stored[r.tier].get(r.location)
    return None if size == r.size else f"{name}: payload is {size} bytes, row says {r.size}"


def _tier_problems(index: Index, tier: Tier, rows: list[Row], stored: dict[str, int], in_flight: set[str]) -> list[str]:
    """Quotas, and payloads against rows, in one tier."""
    name, problems = tier.name, []
    used, _ = index.usage(name)
    if used > tier.quota:
        problems.append(f"{name}: {used} bytes indexed over the quota of {tier.quota}")
    if tier.used > tier.quota:
        problems.append(f"{name}: tier holds {tier.used} bytes over the quota of {tier.quota}")
    indexed = {r.location for r in rows if r.status == AVAILABLE}
    for location in sorted(stored.keys() - indexed):
        if Path(location).stem not in in_flight:
            problems.append(f"{name}: payload {location} has no row")
    if not in_flight and isinstance(tier, FileTier) and tier.temps():
        problems.append(f"{name}: temp files with no save in flight: {tier.temps()}")
    return problems


def _location_for(tier: Tier, key: bytes) -> str:
    """Where a tier keeps a row's payload: its file, or in ram its key."""
    return tier.location_for(key.hex()) if isinstance(tier, FileTier) else key.hex()

"""The index's survey at open: one pass over every row, each decoded once (its head only), against what the file
tiers hold (one directory scan each), deciding which rows stay."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import lmdb

from . import rows
from .rows import AVAILABLE, STATUS_CODES, STATUSES, RowFormatError, block_id


class Listing(NamedTuple):
    """A file tier's payloads as its scan found them (location -> size), and where it keeps a key's:
    `prefix` + key hex + `suffix`."""

    prefix: str
    suffix: str
    sizes: Mapping[str, int]


class RowHead(NamedTuple):
    """What open needs of a row, decoded without the rest, so that open stays quick on a large index."""

    key: bytes
    tier: str
    status: str
    size: int
    location: str | None
    last_used_ns: int



@dataclass
class Survey:
    """What the pass found: per-tier totals of every row (bytes, rows, logical bytes) plus the blocks of the
    rows kept, the locations kept, the keys of the rows to drop, the blocks the kept rows name (block id ->
    [refs, size, location, tier]), the newest row's last use and how many rows were unreadable."""

    used: dict[str, int]
    count: dict[str, int]
    logical: dict[str, int]
    kept: set[str] = field(default_factory=set)
    lost: list[bytes] = field(default_factory=list)
    blocks: dict[bytes, list] = field(default_factory=dict)
    clock: int = 0
    bad: int = 0


def survey(txn: lmdb.Transaction, db: lmdb._Database, tiers: Iterable[str], listings: Mapping[str, Listing],
           location: Callable[[str, bytes], str], dropped: Callable[[RowHead, int | None], None]) -> Survey:
    """A row is kept when it is available, its file is where its tier keeps its key, of the size the row says,
    and every block it names is in place. Every other row goes to `dropped` (with the size of the file at its
    location, if any) and to `lost`. Rows this version cannot read are only counted."""
    s = Survey(*(dict.fromkeys(tiers, 0) for _ in range(3)))
    used, count, logical, kept, blocks = s.used, s.count, s.logical, s.kept, s.blocks
    for key, raw in txn.cursor(db=db):  # the hot loop of open, kept lean
        try:
            head, fields, _ = rows.unpack(key, raw)
        except RowFormatError:
            s.bad += 1
            continue
        tier, size, ns, where = fields[1], head[2], head[6], fields[3]
        used[tier] = used.get(tier, 0) + size
        count[tier] = count.get(tier, 0) + 1
        logical[tier] = logical.get(tier, 0) + size + head[12] * head[13]
        if ns > s.clock:
            s.clock = ns
        listing = listings.get(tier)
        found = listing.sizes.get(where) if listing is not None else None
        home = f"{listing.prefix}{key.hex()}{listing.suffix}" if found == size else None
        chain = _chain(key, raw, head, tier, listing, location)
        if head[1] == STATUS_CODES[AVAILABLE] and where == home and chain is not None:
            kept.add(where)
            for bid, block_where in chain:
                blocks.setdefault(bid, [0, head[13], block_where, tier])[0] += 1
            continue
        dropped(RowHead(key, tier, STATUSES[head[1]], size, where or None, ns), found)
        s.lost.append(key)
    for _, size, where, tier in blocks.values():
        used[tier] = used.get(tier, 0) + size
        kept.add(where)
    return s


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
        chain.append((block_id(tier, block), where))
    return chain

"""Repair at open: bring the index and the tiers into agreement after a restart or a crash (idempotent).

A reserved row is cleared (its writer is dead), a temp file removed, the file of a row removed before the
crash deleted, a row whose file or blocks are not in place dropped, a complete published file without a row
verified and adopted, a block file no row names deleted, and a tier over its (lowered) quota evicted to fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from barreld.names import TIER_NAMES

from .checkpoint import Checkpoint, decode
from .counters import Counters
from .errors import CorruptCheckpoint
from .index import AVAILABLE, RESERVED, Index, Listing, Row, RowHead, valid_aliases
from .tiers import BLOCK_SUFFIX, FileTier, Tier

log = logging.getLogger("barreld.cache")


@dataclass
class ReconcileReport:
    """What `open()` repaired, for logs and tests."""

    temps_removed: int = 0
    ram_rows_dropped: int = 0
    reservations_cleared: int = 0
    missing_dropped: int = 0
    adopted: int = 0
    corrupt_removed: int = 0
    duplicates_removed: int = 0
    over_quota_removed: int = 0
    gone_deleted: int = 0  # files of rows removed before a crash cut their deletion short
    blocks_missing: int = 0  # rows dropped because a block they name is not in place
    orphan_blocks_removed: int = 0  # block files no row names



class Repair:
    """One repair of an open index against its tiers; `run` does it and says what it did."""

    def __init__(self, index: Index, tiers: dict[str, Tier], counters: Counters) -> None:
        self._index, self._tiers, self.counters = index, tiers, counters
        self._files = [t for t in tiers.values() if isinstance(t, FileTier)]

    def run(self) -> ReconcileReport:
        """Bring index and tiers into agreement after a restart or a crash (idempotent): one pass over the
        index, each row decoded once, against the one directory scan each file tier made as it opened."""
        index = self._index
        report = ReconcileReport()
        stored = {tier.name: tier.sizes() for tier in self._files}
        for tier in self._files:
            report.temps_removed += tier.cleanup_temps()
        listings = {tier.name: Listing(*tier.location_parts(), stored[tier.name]) for tier in self._files}
        kept = index.survey(listings, lambda row, size: self._dropped_at_open(row, size, report))
        self._delete_gone(stored, kept, report)
        for tier in self._files:
            orphans = stored[tier.name]
            for location in sorted(orphans.keys() - kept):
                if not location.endswith(BLOCK_SUFFIX):
                    self._adopt(tier, location, orphans[location], report)
        self._remove_orphan_blocks(stored, report)
        for name, tier in self._tiers.items():
            used, _ = index.usage(name)
            if used > tier.quota:  # the quota was lowered since the last run
                evicted, _ = index.evict((name,), used - tier.quota)
                self.counters.count("evictions", evicted)
                report.over_quota_removed += evicted
        return report

    def _dropped_at_open(self, row: RowHead, size: int | None, report: ReconcileReport) -> None:
        """Count (and log) a row dropped at open. Its file, if one is there, is verified by the adoption
        pass, which counts it if bad."""
        if row.tier not in self._tiers or not self._tiers[row.tier].persistent:
            report.ram_rows_dropped += 1
        elif row.status == RESERVED:  # the writer is dead; a file it published before dying is adopted
            report.reservations_cleared += 1
        elif size == row.size:  # its own file is in place: a block it names is not
            log.warning("dropping cache row %s (%s): a block it names is missing", row.key.hex(), row.tier)
            report.blocks_missing += 1
        else:
            log.warning(
                "dropping cache row %s (%s): its file %s",
                row.key.hex(),
                row.tier,
                "is gone" if size is None else f"is {size} bytes, the row says {row.size}",
            )
            report.missing_dropped += 1
            if size is None:
                self.counters.count("corrupt_files")

    def _delete_gone(self, stored: dict[str, dict[str, int]], kept: set[str], report: ReconcileReport) -> None:
        """Delete the files of rows removed before a crash cut their deletion short: gone, not orphans."""
        index = self._index
        marks = index.gone()
        for _, tier_name, location in marks:
            files = stored.get(tier_name, {})
            if location in files and location not in kept:
                self._tiers[tier_name].delete(location)
                del files[location]
                report.gone_deleted += 1
        for tier in self._files:
            if any(name == tier.name for _, name, _ in marks):
                tier.sync()  # the deletions last before their marks go
        index.clear_gone([key for key, _, _ in marks])

    def _remove_orphan_blocks(self, stored: dict[str, dict[str, int]], report: ReconcileReport) -> None:
        """Delete the block files no row names (their rows were dropped, or their writer died first)."""
        named = {self._tiers[TIER_NAMES[bid[0]]].block_location(bid[1:].hex()) for bid in self._index.blocks()}
        for tier in self._files:
            orphans = [loc for loc in stored[tier.name] if loc.endswith(BLOCK_SUFFIX) and loc not in named]
            for location in orphans:
                tier.delete(location)
            if orphans:
                tier.sync()
            report.orphan_blocks_removed += len(orphans)

    def _adopt(self, tier: FileTier, location: str, size: int, report: ReconcileReport) -> None:
        """Index a complete file that has no row, after verifying every byte of it; else delete it."""
        index = self._index
        try:
            ckpt = decode(tier.read(location))
            ckpt.check_key()
            if Path(location).name != f"{ckpt.key.hex()}.kvc":
                raise CorruptCheckpoint("file name does not match the key of its contents")
            chain = ckpt.chain
            if chain is not None and any(tier.size(tier.block_location(k.hex())) != chain.block_size
                                         for k in chain.keys):
                raise CorruptCheckpoint("a block it names is missing")
        except (CorruptCheckpoint, OSError) as e:
            log.warning("removing unreadable cache file %s: %s", location, e)
            tier.delete(location)
            report.corrupt_removed += 1
            self.counters.count("corrupt_files")
            return
        row = _adopted_row(ckpt, tier.name, location, size)
        with index.write() as b:
            duplicate = b.get(ckpt.key) is not None  # the key already lives in the other file tier
            new_blocks = [k for k in row.blocks if b.block(tier.name, k) is None]
            fits = not duplicate and index.usage(tier.name)[0] + size + len(new_blocks) * row.block_size <= tier.quota
            if fits:
                b.put(row, written=True)
        if fits:
            report.adopted += 1
            return
        tier.delete(location)
        if duplicate:
            report.duplicates_removed += 1
        else:
            report.over_quota_removed += 1


def _adopted_row(ckpt: Checkpoint, tier: str, location: str, size: int) -> Row:
    """The row of a verified file found without one: used when it was written."""
    chain = ckpt.chain
    return Row(
        key=ckpt.key,
        model=ckpt.model,
        tier=tier,
        size=size,
        tokens=len(ckpt.tokens),
        text_bytes=len(ckpt.rendered),
        save_reason=ckpt.save_reason,
        status=AVAILABLE,
        last_used_ns=int(ckpt.created * 1e9),
        created=ckpt.created,
        location=location,
        aliases=valid_aliases(ckpt.key, len(ckpt.tokens), ckpt.prefixes),
        memory=ckpt.memory,
        frontier=ckpt.frontier_tokens,
        blocks=chain.keys if chain is not None else (),
        block_size=chain.block_size if chain is not None else 0,
        tenant=ckpt.tenant,
        namespace=ckpt.namespace,
    )


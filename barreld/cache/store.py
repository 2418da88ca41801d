"""CacheStore: what the engine calls to save, find and restore KV checkpoints.

Publish protocol (one save): reserve the key and its bytes in the index (evicting that tier's least
recently used unreferenced rows to fit; their files are deleted once the index has let go of them) ->
make sure no earlier file of this key is left to delete -> write a temp file in the tier's
directory -> fdatasync -> confirm the reservation is still ours -> rename into place -> fsync the
directory -> mark the row available, durably. A crash anywhere leaves a state `open()` reconciles: a
reserved row is cleared, a temp file removed, the file of a row removed before the crash deleted, a
complete published file without a row verified and adopted.

With `block_tokens` set, a checkpoint that carries its model's state shape is stored as a chain of blocks
(`barreld.cache.blocks`): the reservation takes a reference on each block, the blocks no published row has in
place are written first, and the row's own file last, so no row is ever published before the blocks it
names. A block is deleted with its last row; `open()` drops rows whose blocks are missing and deletes blocks
no row names. A save may name the row it `replaces` (the engine passes the row its sequence was last saved as
or restored from): a full-attention row of blocks that extends it supersedes it once both are published.

A shared remote tier (optional, beneath the local ones) hooks in at three places: a published checkpoint
is mirrored to it by a writer thread; a lookup that misses locally may probe it (`lookup_remote`); a
remote hit is fetched, verified and restored from memory, and promoted into a local tier by an ordinary
async save for next time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from barreld.names import REDIS_TIER, TIER_NAMES, MemoryKind

from . import blocks
from .checkpoint import HEADER_BYTES, Checkpoint, decode, encode_parts, encoded_size, rendered_span
from .counters import Counters
from .errors import CorruptCheckpoint, IndexWriteError, TierWriteError, WriterQueueFull
from .index import (
    AVAILABLE,
    RESERVED,
    Hit,
    Index,
    Listing,
    Payload,
    Reservation,
    Row,
    RowHead,
    block_id,
    valid_aliases,
)
from .stateformat import StateFormatError
from .tiers import BLOCK_SUFFIX, FileTier, RamTier, Tier, lock_file, thread_buffer
from .writer import WriterPool

if TYPE_CHECKING:
    from .remote.tier import RemoteTier

log = logging.getLogger("barreld.cache")


@dataclass(frozen=True)
class TierConfig:
    """A tier's byte quota (0: nothing is stored there) and, for file tiers, its directory."""

    quota: int
    root: Path | None = None


@dataclass
class SaveOutcome:
    """What became of a save: queued (see `future`), published, duplicate, dropped, failed or timeout.

    An async save returns `queued` with a Future whose result is the final SaveOutcome; a sync save that
    outlives its timeout returns `timeout` with that Future (the write goes on in the background).
    """

    status: str
    key: bytes
    tier: str
    future: Future | None = None
    detail: str = ""


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


_read_buffers = threading.local()
ASSEMBLY_HELPERS = 3
"""Threads that read, verify and place a row's blocks beside the restoring thread. Four reads in flight
restored a 12-block row from a cold page cache about as fast as one whole-state read (two reads: 1.2 to 1.3
times as long), and on two cores the copying ran no slower for the extra threads."""


class _LocalBlocks:
    """This host's blocks for a remote restore, read without a row's reference: a block deleted meanwhile
    reads as missing (and is fetched from Redis instead), a damaged one is marked as in `_block_loader`."""

    def __init__(self, index: Index, tiers: dict[str, Tier], counters: Counters) -> None:
        self._index, self._tiers, self._counters = index, tiers, counters

    def _tier(self, key: bytes) -> Tier | None:
        return next((self._tiers[t] for t in self._tiers if self._index.block_refs(t, [key])[0]), None)

    def has(self, key: bytes) -> bool:
        return self._tier(key) is not None

    def read(self, key: bytes) -> memoryview:
        tier = self._tier(key)
        if tier is None:
            raise KeyError(key.hex())
        try:
            return blocks.decode_block(tier.read(tier.block_location(key.hex())), key)
        except CorruptCheckpoint:
            self._counters.count("corrupt_blocks")
            with contextlib.suppress(IndexWriteError):
                self._index.block_corrupt(tier.name, key)
            raise


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
    )


class CacheStore:
    """Content-addressed KV checkpoints in three tiers (ram, ram_file, disk) behind an LMDB index.

    One store per data dir (and per ram_file/disk root): `open()` takes an exclusive lock on each, so every
    reservation found at open belongs to a dead writer.
    """

    def __init__(
        self,
        data_dir: Path,
        tiers: dict[str, TierConfig],
        *,
        writers: int = 2,
        queue_size: int = 16,
        block_tokens: int = 0,
        remote: RemoteTier | None = None,
    ) -> None:
        unknown = set(tiers) - set(TIER_NAMES)
        if unknown:
            raise ValueError(
                f"unknown tier(s) {', '.join(sorted(unknown))}; tiers are {', '.join(TIER_NAMES)}"
            )
        if block_tokens < 0:
            raise ValueError(f"block_tokens must be 0 (whole states) or more, not {block_tokens}")
        self.block_tokens = block_tokens
        self.data_dir = Path(data_dir).absolute()
        self._configs = {name: tiers.get(name, TierConfig(0)) for name in TIER_NAMES}
        self._writers = writers
        self._queue_size = queue_size
        self.counters = Counters()
        self.last_reconcile: ReconcileReport | None = None
        self._tiers: dict[str, Tier] = {}
        self._index: Index | None = None
        self._pool: WriterPool | None = None
        self._assemblers: ThreadPoolExecutor | None = None
        self._lock_fd: int | None = None
        self._pending: dict[bytes, Future] = {}
        self._successors: dict[bytes, tuple[Checkpoint, str]] = {}  # an in-flight row -> a row that replaces it
        self._plock = threading.Lock()
        self.remote = remote

    # ---- lifecycle ----------------------------------------------------------------------------

    def open(self) -> CacheStore:
        """Lock the directories, open the index and reconcile it with the tiers (see ReconcileReport)."""
        if self._index is not None:
            raise RuntimeError("cache store is already open")
        ram_file_root = self._configs["ram_file"].root or Path(f"/dev/shm/barrel-{os.getuid()}")
        disk_root = self._configs["disk"].root or self.data_dir / "kvc"
        if Path(ram_file_root).absolute() == Path(disk_root).absolute():
            raise ValueError("the ram_file and disk tiers need different roots")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = lock_file(self.data_dir / "cache.lock", f"data dir {self.data_dir}")
        try:
            self._tiers = {
                "ram": RamTier(self._configs["ram"].quota),
                "ram_file": FileTier("ram_file", ram_file_root, self._configs["ram_file"].quota),
                "disk": FileTier("disk", disk_root, self._configs["disk"].quota),
            }
            for tier in self._file_tiers():
                tier.lock()
            quotas = {name: t.quota for name, t in self._tiers.items()}
            self._index = Index(
                self.data_dir / "index.lmdb", quotas, forget=self._forget_payload, delete=self._delete_payloads,
                block_location=lambda tier, key: self._tiers[tier].block_location(key.hex()),
            )
            self.last_reconcile = self._reconcile()
            log.info(
                "reconciled the cache at open: %s",
                " ".join(f"{k}={v}" for k, v in asdict(self.last_reconcile).items()),
            )
            self._pool = WriterPool(self._writers, self._queue_size)
            self._assemblers = ThreadPoolExecutor(ASSEMBLY_HELPERS, thread_name_prefix="barrel-assemble")
        except BaseException:
            self._release_resources()
            raise
        return self

    def close(self) -> None:
        """Finish every queued save, fold LRU touches into the index, close LMDB, drop ram payloads."""
        if self._index is None:
            return
        if self._pool is not None:
            self._pool.close()  # queued mirrors finish too
        self._release_resources()
        if self.remote is not None:
            self.remote.close()

    def _release_resources(self) -> None:
        if self._index is not None:
            self._index.close()
        for tier in self._tiers.values():
            if isinstance(tier, FileTier):
                tier.unlock()
            elif isinstance(tier, RamTier):
                tier.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        if self._assemblers is not None:
            self._assemblers.shutdown()
        self._index = self._pool = self._lock_fd = self._assemblers = None
        self._tiers = {}

    def __enter__(self) -> CacheStore:
        return self.open() if self._index is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_open(self) -> Index:
        if self._index is None:
            raise RuntimeError("cache store is not open")
        return self._index

    @property
    def index(self) -> Index:
        """The open store's index (RuntimeError when it is not open), for tools and tests that look inside."""
        return self._require_open()

    def tier(self, name: str) -> Tier:
        """The open store's tier of that name."""
        self._require_open()
        return self._tiers[name]

    def _file_tiers(self) -> list[FileTier]:
        return [t for t in self._tiers.values() if isinstance(t, FileTier)]

    def _forget_payload(self, payload: Payload) -> None:
        self._tiers[payload.tier].forget(payload.location)

    def _delete_payloads(self, payloads: list[Payload]) -> set[bytes]:
        """Delete removed rows' payloads, then sync each file tier's directory once, so a deletion is
        durable before the index forgets it was due; the keys deleted. Run outside the index's lock."""
        done: dict[bytes, str] = {}
        for p in payloads:
            try:
                self._tiers[p.tier].delete(p.location)
                done[p.key] = p.tier
            except Exception:
                log.exception("deleting the payload of %s failed; the next open deletes it", p.key.hex())
        for tier in self._file_tiers():
            if tier.name in done.values():
                try:
                    tier.sync()
                except OSError as e:
                    log.warning("syncing %s after deletions failed (the next open deletes them): %s", tier.root, e)
                    done = {k: t for k, t in done.items() if t != tier.name}
        return set(done)

    def _location_for(self, tier: Tier, key: bytes) -> str:
        return tier.location_for(key.hex()) if isinstance(tier, FileTier) else key.hex()

    # ---- reconcile ----------------------------------------------------------------------------

    def _reconcile(self) -> ReconcileReport:
        """Bring index and tiers into agreement after a restart or a crash (idempotent): one pass over the
        index, each row decoded once, against the one directory scan each file tier made as it opened."""
        index = self._require_open()
        report = ReconcileReport()
        stored = {tier.name: tier.sizes() for tier in self._file_tiers()}
        for tier in self._file_tiers():
            report.temps_removed += tier.cleanup_temps()
        listings = {tier.name: Listing(*tier.location_parts(), stored[tier.name]) for tier in self._file_tiers()}
        kept = index.survey(listings, lambda row, size: self._dropped_at_open(row, size, report))
        self._delete_gone(stored, kept, report)
        for tier in self._file_tiers():
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
        if row.tier not in self._configs or not self._tiers[row.tier].persistent:
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
        index = self._require_open()
        marks = index.gone()
        for _, tier_name, location in marks:
            files = stored.get(tier_name, {})
            if location in files and location not in kept:
                self._tiers[tier_name].delete(location)
                del files[location]
                report.gone_deleted += 1
        for tier in self._file_tiers():
            if any(name == tier.name for _, name, _ in marks):
                tier.sync()  # the deletions last before their marks go
        index.clear_gone([key for key, _, _ in marks])

    def _remove_orphan_blocks(self, stored: dict[str, dict[str, int]], report: ReconcileReport) -> None:
        """Delete the block files no row names (their rows were dropped, or their writer died first)."""
        named = {self._tiers[TIER_NAMES[bid[0]]].block_location(bid[1:].hex()) for bid in self._require_open().blocks()}
        for tier in self._file_tiers():
            orphans = [loc for loc in stored[tier.name] if loc.endswith(BLOCK_SUFFIX) and loc not in named]
            for location in orphans:
                tier.delete(location)
            if orphans:
                tier.sync()
            report.orphan_blocks_removed += len(orphans)

    def _adopt(self, tier: FileTier, location: str, size: int, report: ReconcileReport) -> None:
        """Index a complete file that has no row, after verifying every byte of it; else delete it."""
        index = self._require_open()
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

    # ---- saves --------------------------------------------------------------------------------

    def save(
        self,
        ckpt: Checkpoint,
        tier: str,
        prefixes: Iterable[tuple[bytes, int]] = (),
        *,
        sync: bool = False,
        timeout: float | None = None,
        replaces: bytes | None = None,
    ) -> SaveOutcome:
        """Save a checkpoint to a tier, findable also under `prefixes` ((prefix key, n_tokens) pairs).

        `replaces` names an earlier row of the same sequence: once this one is published it is dropped if this
        one makes it redundant (see `_supersede`).

        Async (default): returns at once; a full writer queue drops the save (`saves_dropped`). Sync:
        jumps the queue and waits for the publish, at most `timeout` seconds. The store keeps references
        to the checkpoint's buffers until the save's future is done: do not modify them before that.
        """
        index = self._require_open()
        if tier not in self._tiers:
            raise ValueError(f"unknown tier {tier!r}; tiers are {', '.join(TIER_NAMES)}")
        prefixes = tuple(prefixes)
        if prefixes:
            ckpt = replace(ckpt, prefixes=prefixes)
        size = encoded_size(ckpt)
        key = ckpt.key
        with self._plock:
            if key in self._pending or index.get(key) is not None:
                self.counters.count("saves_duplicate")
                return SaveOutcome("duplicate", key, tier)
            if size > self._tiers[tier].quota and not self._splits(ckpt):
                self.counters.count("saves_dropped")
                return SaveOutcome("dropped", key, tier, detail=f"{size} bytes exceed the {tier} quota")
            try:
                assert self._pool is not None
                fut = self._pool.submit(lambda: self._publish(ckpt, tier, replaces), urgent=sync)
            except WriterQueueFull as e:
                self.counters.count("saves_dropped")
                return SaveOutcome("dropped", key, tier, detail=str(e))
            self._pending[key] = fut
        fut.add_done_callback(lambda f: self._forget(key, f))
        if not sync:
            return SaveOutcome("queued", key, tier, future=fut)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            return SaveOutcome("timeout", key, tier, future=fut, detail=f"not published within {timeout} s")

    def _forget(self, key: bytes, fut: Future) -> None:
        with self._plock:
            if self._pending.get(key) is fut:
                del self._pending[key]
                self._successors.pop(key, None)

    def pending(self, key: bytes) -> Future | None:
        """The in-flight save of `key`, so a caller can wait for it to publish (session_resume_wait_ms)."""
        with self._plock:
            return self._pending.get(key)

    def _splits(self, ckpt: Checkpoint) -> bool:
        return self.block_tokens > 0 and ckpt.layout is not None

    def _as_blocks(self, ckpt: Checkpoint) -> tuple[Checkpoint, dict[bytes, bytearray]]:
        """The checkpoint as it is stored: a row naming its blocks (with their payloads), else whole."""
        if not self._splits(ckpt):
            return replace(ckpt, layout=None), {}
        try:
            split = blocks.split(ckpt, self.block_tokens)
        except StateFormatError as e:
            log.warning("a state of %s could not be cut into blocks (%s); it is stored whole", ckpt.model, e)
            split = None
        if split is None:
            return replace(ckpt, layout=None), {}
        return split[0], dict(split[1])

    def _publish(self, ckpt: Checkpoint, tier_name: str, replaces: bytes | None = None) -> SaveOutcome:
        """The publish protocol, run on a writer thread."""
        t0 = time.perf_counter_ns()
        index = self._require_open()
        tier = self._tiers[tier_name]
        key = ckpt.key
        ckpt, payloads = self._as_blocks(ckpt)
        try:
            res = self._reserve(ckpt, tier_name)
        except IndexWriteError as e:
            return self._failed(key, tier_name, e)
        if res.evicted:
            self.counters.count("evictions", res.evicted)
        if res.status == "duplicate":
            self.counters.count("saves_duplicate")
            return SaveOutcome("duplicate", key, tier_name)
        if res.status != "reserved":
            self.counters.count("saves_dropped")
            return SaveOutcome("dropped", key, tier_name, detail=res.status)
        index.settle(key)  # an earlier file of this key left to delete must not take the new one with it
        try:
            self._write_blocks(tier, res.unwritten, payloads, lambda: index.holds(key, res.token))
            location = tier.put(key.hex(), encode_parts(ckpt), lambda: index.holds(key, res.token))
        except TierWriteError as e:
            self._abandon(key, res.token)
            return self._failed(key, tier_name, e)
        except BaseException:
            self._abandon(key, res.token)
            raise
        try:
            marked = location is not None and index.mark_available(key, res.token, location, ckpt.prefixes)
        except IndexWriteError as e:
            tier.delete(location)  # published, but no row will ever say so
            self._abandon(key, res.token)
            return self._failed(key, tier_name, e)
        if not marked:
            if location is not None and index.get(key) is None:
                tier.delete(location)
            self.counters.count("saves_dropped")
            return SaveOutcome("dropped", key, tier_name, detail="reservation lost")
        self.counters.count(f"saves_{ckpt.save_reason}")
        self.counters.add_ns("save_ns", time.perf_counter_ns() - t0)
        self._mirror(ckpt, payloads)
        if replaces is not None:
            self._supersede(ckpt, tier_name, replaces)
        with self._plock:
            successor = self._successors.pop(key, None)
        if successor is not None:
            self._supersede(*successor, key)
        return SaveOutcome("published", key, tier_name)

    def _supersede(self, row: Checkpoint, tier_name: str, old_key: bytes) -> None:
        """Drops the older row `old_key` when the new row of full-attention blocks makes it redundant: it is in
        the same tier, its text is a prefix of the new text, and its blocks are the first of the new row's.
        Every prefix it could restore is then restorable from the new row, and its key and aliases now find
        the new row. What it alone held (its tail of under block_tokens cells and its logits, about a state's
        worth of bytes per row on a chat that adds a hundred tokens a turn) served only a resend of exactly
        its text: that now restores from the new row and prefills the tail again."""
        if row.chain is None or row.chain.opaque or row.memory != MemoryKind.FULL or old_key == row.key:
            return  # a sliding window or a recurrent state is restorable at its own length only
        index = self._require_open()
        with self._plock:  # against the older row's publish, which takes its successor under this lock
            old = index.get(old_key)
            if (old is None or old.status != AVAILABLE) and old_key in self._pending:  # checked once published
                self._successors[old_key] = (row, tier_name)
                return
        if (old is None or old.tier != tier_name or not old.blocks or old.frontier > row.frontier_tokens
                or row.chain.keys[: len(old.blocks)] != old.blocks or old.text_bytes > len(row.rendered)
                or row.key_scheme().key(row.rendered[: old.text_bytes]) != old_key):
            return
        try:
            if index.supersede(old_key, row.key):
                self.counters.count("superseded")
        except IndexWriteError as e:
            log.warning("could not drop cache row %s that %s supersedes: %s", old_key.hex(), row.key.hex(), e)

    def _reserve(self, ckpt: Checkpoint, tier_name: str) -> Reservation:
        chain = ckpt.chain
        return self._require_open().reserve(
            ckpt.key,
            tier_name,
            encoded_size(ckpt),
            model=ckpt.model,
            tokens=len(ckpt.tokens),
            text_bytes=len(ckpt.rendered),
            save_reason=ckpt.save_reason,
            memory=ckpt.memory,
            frontier=ckpt.frontier_tokens,
            blocks=chain.keys if chain is not None else (),
            block_size=chain.block_size if chain is not None else 0,
        )

    def _write_blocks(self, tier: Tier, keys: tuple[bytes, ...], payloads: dict[bytes, bytearray],
                      claim_ok: Callable[[], bool]) -> None:
        """Store the blocks no published row has in place yet, before the row that names them. A block is
        content-addressed, so a writer racing another over the same block writes the same bytes."""
        index = self._require_open()
        for key in keys:
            index.settle(block_id(tier.name, key))  # a deletion of its last copy is done first
            if tier.put(key.hex(), blocks.encode_block(key, payloads[key]), claim_ok, block=True) is None:
                raise TierWriteError(tier.name, 0, "reservation lost while writing its blocks")

    def _mirror(self, row: Checkpoint, payloads: dict[bytes, bytearray]) -> None:
        """Queue a copy of a published row (and of the blocks it names) to the remote tier behind the saves,
        off every request's path; a full queue drops the copy (counted), as it drops a save."""
        remote = self.remote
        if remote is None or not remote.writes or self._pool is None:
            return
        try:
            self._pool.submit(lambda: remote.mirror(row, payloads))
        except (WriterQueueFull, RuntimeError):  # RuntimeError: the pool is closing
            remote.dropped()

    def _failed(self, key: bytes, tier_name: str, e: Exception) -> SaveOutcome:
        """A save that storage refused (a full or failing tier or index): counted, logged, never raised,
        so a full disk costs the cache a checkpoint and never the engine a request."""
        self.counters.count("saves_failed")
        log.warning("save of %s to %s failed: %s", key.hex(), tier_name, e)
        return SaveOutcome("failed", key, tier_name, detail=str(e))

    def _abandon(self, key: bytes, token: str) -> None:
        """Drop a reservation, best effort: one the index cannot drop now is cleared by the next open."""
        try:
            self._require_open().abandon(key, token)
        except IndexWriteError as e:
            log.warning("could not drop the reservation of %s: %s", key.hex(), e)

    # ---- lookups and restores -----------------------------------------------------------------

    def lookup(self, key: bytes) -> Hit | None:
        """The row (exact key first, then a prefix alias) that can serve `key`; LMDB reads only."""
        return self._require_open().lookup(key)

    def lookup_remote(self, keys: Sequence[bytes]) -> list[Hit | None]:
        """For each key, the remote tier's row that can serve it (none without a remote tier): one round
        trip for them all. For a lookup that missed locally."""
        self._require_open()
        return [None] * len(keys) if self.remote is None else list(self.remote.probe(keys))

    @contextmanager
    def restore(self, hit: Hit, promote_to: str | None = None) -> Iterator[Checkpoint | None]:
        """Read and verify a hit's checkpoint, holding a reference (no eviction) while the caller uses it.

        Yields None when the row is gone or fails verification (then the row, its aliases and its file
        are dropped and `corrupt_files` counts it): the caller falls back to a prefill. The state and
        logits are views into the read buffer, valid inside the `with` block only. A remote hit is
        fetched into memory and, once verified, also saved to `promote_to`.
        """
        index = self._require_open()
        if hit.tier == REDIS_TIER:
            yield self._fetch_remote(hit, promote_to)
            return
        key = hit.row_key
        if not index.acquire(key):
            yield None
            return
        try:
            t0 = time.perf_counter_ns()
            row = index.get(key)
            ckpt = None
            if row is not None and row.status == AVAILABLE and hit.n_tokens <= row.tokens:
                ckpt = self._read_verified(row)
            if ckpt is not None:
                index.touch(key)
                self.counters.add_ns("restore_ns", time.perf_counter_ns() - t0)
            yield ckpt
        finally:
            index.release(key)

    def _fetch_remote(self, hit: Hit, promote_to: str | None) -> Checkpoint | None:
        if self.remote is None:
            return None
        t0 = time.perf_counter_ns()
        ckpt = self.remote.fetch(hit, self._local_blocks)  # type: ignore[arg-type]  # a remote tier's hits are RemoteHits
        if ckpt is not None:
            self.counters.add_ns("restore_ns", time.perf_counter_ns() - t0)
            if promote_to is not None and ckpt.frontier_tokens >= hit.frontier:  # not a prefix's blocks alone
                self.save(ckpt, promote_to)
        return ckpt

    @property
    def _local_blocks(self) -> _LocalBlocks:
        return _LocalBlocks(self._require_open(), self._tiers, self.counters)

    def _read_verified(self, row: Row) -> Checkpoint | None:
        """The row's checkpoint, checksum and key verified; on any failure the row is dropped."""
        index = self._require_open()
        try:
            assert row.location is not None
            ckpt = decode(self._tiers[row.tier].read(row.location))
            ckpt.check_key()
            chain = ckpt.chain
            if ckpt.key != row.key or len(ckpt.tokens) != row.tokens or (chain.keys if chain else ()) != row.blocks:
                raise CorruptCheckpoint("checkpoint does not match its index row")
            if chain is not None:
                ckpt = blocks.assemble(ckpt, self._block_loader(row), self._assemblers, ASSEMBLY_HELPERS)
        except (CorruptCheckpoint, OSError, KeyError, ValueError) as e:
            log.warning("dropping cache row %s (%s): %s", row.key.hex(), row.tier, e)
            try:
                dropped = index.remove(row.key, row.token) is not None
            except IndexWriteError as ie:  # not restored all the same; the next restore tries again
                log.warning("could not drop cache row %s: %s", row.key.hex(), ie)
                dropped = True
            if dropped:
                self.counters.count("corrupt_files")
            return None
        return ckpt

    def _block_loader(self, row: Row) -> Callable[[int], memoryview]:
        """load(i): row's block i read and verified, its payload returned. A file block is read into slot i of
        this thread's reused buffer, a ram block in place. A block that is missing or fails verification is
        counted and marked for the next save that names it to write again; the row is not assembled
        (CorruptCheckpoint)."""
        tier = self._tiers[row.tier]
        size = len(row.blocks) * row.block_size if isinstance(tier, FileTier) else 0
        buf = memoryview(thread_buffer(_read_buffers, size))

        def load(i: int) -> memoryview:
            key = row.blocks[i]
            location = tier.block_location(key.hex())
            try:
                if isinstance(tier, FileTier):
                    view = buf[i * row.block_size : (i + 1) * row.block_size]
                    view = view[: tier.read_into(location, view)]
                else:
                    view = tier.read(location)
                return blocks.decode_block(view, key)
            except (CorruptCheckpoint, OSError, KeyError) as e:
                self.counters.count("corrupt_blocks")
                with contextlib.suppress(IndexWriteError):
                    self._require_open().block_corrupt(row.tier, key)
                raise CorruptCheckpoint(f"block {i} of {len(row.blocks)}: {e}") from e

        return load

    # ---- operations ---------------------------------------------------------------------------

    def gc(self, tiers: Iterable[str] | None = None) -> int:
        """Evict every unreferenced row in `tiers` (every local one when None); returns how many."""
        evicted, _ = self._require_open().evict(TIER_NAMES if tiers is None else tuple(tiers), math.inf)
        self.counters.count("evictions", evicted)
        return evicted

    def evict_bytes(self, n: int, tiers: Iterable[str] | None = None) -> tuple[int, int]:
        """Free at least n bytes (if that many are unreferenced), least recently used first across `tiers`
        (all when None); returns (rows evicted, bytes freed)."""
        index = self._require_open()
        names = tuple(tiers) if tiers is not None else TIER_NAMES
        bad = set(names) - set(TIER_NAMES)
        if bad:
            raise ValueError(f"unknown tier(s) {', '.join(sorted(bad))}")
        if n <= 0:
            return 0, 0
        evicted, freed = index.evict(names, n)
        self.counters.count("evictions", evicted)
        return evicted, freed

    def texts(self, model: str, limit: int) -> list[tuple[bytes, bytes]]:
        """(key, rendered text) of the model's `limit` most recently used rows, read without their states and
        unverified: what a prompt is compared with to say why it missed, never restored from. A row removed
        while it is read is left out."""
        index = self._require_open()
        rows = sorted((r for r in index.rows() if r.model == model and r.status == AVAILABLE and r.location),
                      key=lambda r: r.last_used_ns, reverse=True)
        out = []
        for row in rows[:limit]:
            if not index.acquire(row.key):
                continue
            try:
                tier = self._tiers[row.tier]
                start, end = rendered_span(tier.read_range(row.location, 0, HEADER_BYTES))
                out.append((row.key, tier.read_range(row.location, start, end)))
            except (CorruptCheckpoint, OSError, KeyError) as e:
                log.debug("row %s not compared: %s", row.key.hex(), e)
            finally:
                index.release(row.key)
        return out

    def dump(self, model: str | None = None, tier: str | None = None) -> list[dict]:
        """Every row as the contract's `cache dump` shape, most recently used first.

        `location` is the file path; null for ram rows (memory has no path) and for reserved rows.
        """
        index = self._require_open()
        rows = [
            r
            for r in index.rows()
            if (model is None or r.model == model) and (tier is None or r.tier == tier)
        ]
        rows.sort(key=lambda r: r.last_used_ns, reverse=True)
        return [
            {
                **self._sharing(r),
                "key": r.key.hex(),
                "model": r.model,
                "tier": r.tier,
                "size": r.size,
                "tokens": r.tokens,
                "text_bytes": r.text_bytes,
                "save_reason": r.save_reason,
                "memory": r.memory,
                "frontier": r.frontier,
                "status": r.status,
                "refcount": index.refcount(r.key),
                "hits": r.hits,
                "last_used": r.last_used_ns / 1e9,
                "created": r.created,
                "location": r.location if r.status == AVAILABLE and r.tier != "ram" else None,
            }
            for r in rows
        ]

    def _sharing(self, row: Row) -> dict:
        """A row's blocks, the bytes only it holds (its own file and the blocks no other row names) and the
        bytes of blocks it shares with other rows."""
        refs = self._require_open().block_refs(row.tier, row.blocks)
        own = sum(1 for n in refs if n == 1) * row.block_size
        return {"blocks": len(row.blocks), "own_bytes": row.size + own,
                "shared_bytes": (len(refs) * row.block_size) - own}

    def stats(self) -> dict:
        """The contract's `cache stats` shape: counters; per tier bytes (= stored_bytes, what the tier holds),
        quota, rows (reserved included), logical_bytes (what the rows would take with no block shared) and
        their ratio; and the remote tier's status (None without one)."""
        index = self._require_open()
        tiers = {}
        for name, tier in self._tiers.items():
            used, rows = index.usage(name)
            logical = index.logical(name)
            tiers[name] = {"bytes": used, "quota": tier.quota, "rows": rows, "stored_bytes": used,
                           "logical_bytes": logical, "dedup_ratio": logical / used if used else 1.0}
        remote = self.remote.stats() if self.remote is not None else None
        return {"counters": self.counters.snapshot(), "tiers": tiers, REDIS_TIER: remote}

    def verify(self, progress: Callable[[int, int], None] | None = None) -> tuple[int, list[str]]:
        """Re-read and verify every available row; drop the bad ones. Returns (checked, bad keys as hex)."""
        index = self._require_open()
        rows = [r for r in index.rows() if r.status == AVAILABLE]
        checked, bad = 0, []
        for i, row in enumerate(rows, 1):
            if index.acquire(row.key):
                try:
                    current = index.get(row.key)
                    if current is not None and current.token == row.token:
                        checked += 1
                        if self._read_verified(current) is None:
                            bad.append(row.key.hex())
                finally:
                    index.release(row.key)
            if progress is not None:
                progress(i, len(rows))
        return checked, bad

    def check(self) -> list[str]:
        """Consistency of index, payloads and quotas; the problems found (none is healthy).

        Meant for quiet moments (tests, `cache verify`): saves in flight are allowed their reserved
        rows, temp files and not-yet-indexed files.
        """
        index = self._require_open()
        with self._plock:
            in_flight = {k.hex() for k in self._pending}
        rows = index.rows()
        stored = {name: tier.scan() for name, tier in self._tiers.items()}
        problems = index.check()
        problems += [p for r in rows if (p := self._row_problem(r, stored, in_flight)) is not None]
        block_files = self._block_problems(stored, problems, bool(in_flight))
        for name, tier in self._tiers.items():
            rest = {loc: n for loc, n in stored[name].items() if loc not in block_files}
            problems += self._tier_problems(tier, [r for r in rows if r.tier == name], rest, in_flight)
            if not in_flight and tier.used != sum(stored[name].values()):
                problems.append(f"{name}: tier counts {tier.used} bytes, holds {sum(stored[name].values())}")
        return problems

    def _block_problems(self, stored: dict[str, dict[str, int]], problems: list[str], busy: bool) -> set[str]:
        """Block files against block entries: each entry in place (once written), of its size; no block file
        without an entry (unless saves are in flight). Returns the locations of every block file."""
        entries = {}
        for bid, (_, size, written) in self._require_open().blocks().items():
            tier = self._tiers[TIER_NAMES[bid[0]]]
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

    def _row_problem(self, r: Row, stored: dict[str, dict[str, int]], in_flight: set[str]) -> str | None:
        name = r.key.hex()
        tier = self._tiers.get(r.tier)
        if tier is None:
            return f"{name}: unknown tier {r.tier!r}"
        if r.status == RESERVED:
            return None if name in in_flight else f"{name}: reserved with no save in flight"
        if r.location != self._location_for(tier, r.key):
            return f"{name}: location {r.location} is not where {r.tier} keeps it"
        size = stored[r.tier].get(r.location)
        return None if size == r.size else f"{name}: payload is {size} bytes, row says {r.size}"

    def _tier_problems(self, tier: Tier, rows: list[Row], stored: dict[str, int], in_flight: set[str]) -> list[str]:
        """Quotas, and payloads against rows, in one tier."""
        name, problems = tier.name, []
        used, _ = self._require_open().usage(name)
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

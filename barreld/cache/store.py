"""CacheStore: what the engine calls to save, find and restore KV checkpoints.

Its parts: saves and their publish protocol (`publish`), reading rows back (`restore`), the repair at open
(`repair`) and the audits (`audit`), over the index (`index`) and the tiers (`tiers`).

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

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from barreld.names import REDIS_TIER, TIER_NAMES

from . import audit
from .checkpoint import HEADER_BYTES, Checkpoint, rendered_span
from .counters import Counters
from .errors import CorruptCheckpoint
from .index import AVAILABLE, Hit, Index, Payload, Row
from .publish import Publisher, SaveOutcome
from .repair import ReconcileReport, Repair
from .restore import Reader
from .tiers import FileTier, RamTier, Tier, hold_lock
from .writer import WriterPool

if TYPE_CHECKING:
    from .remote.tier import RemoteTier

log = logging.getLogger("barreld.cache")


@dataclass(frozen=True)
class TierConfig:
    """A tier's byte quota (0: nothing is stored there) and, for file tiers, its directory."""

    quota: int
    root: Path | None = None






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
        self._reader: Reader | None = None
        self._lock_fd: int | None = None
        self._publisher: Publisher | None = None
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
        self._lock_fd = hold_lock(self.data_dir / "cache.lock", f"data dir {self.data_dir}")
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
            self.last_reconcile = Repair(self._index, self._tiers, self.counters).run()
            log.info(
                "reconciled the cache at open: %s",
                " ".join(f"{k}={v}" for k, v in asdict(self.last_reconcile).items()),
            )
            self._pool = WriterPool(self._writers, self._queue_size)
            self._publisher = Publisher(self._index, self._tiers, self.counters, self._pool,
                                        block_tokens=self.block_tokens, remote=self.remote)
            self._reader = Reader(self._index, self._tiers, self.counters)
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
        if self._reader is not None:
            self._reader.close()
        self._index = self._pool = self._lock_fd = self._reader = self._publisher = None
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

    # ---- reconcile ----------------------------------------------------------------------------


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
        one makes it redundant (see `Publisher.supersede`).

        Async (default): returns at once; a full writer queue drops the save (`saves_dropped`). Sync:
        jumps the queue and waits for the publish, at most `timeout` seconds. The store keeps references
        to the checkpoint's buffers until the save's future is done: do not modify them before that.
        """
        self._require_open()
        assert self._publisher is not None
        if tier not in self._tiers:
            raise ValueError(f"unknown tier {tier!r}; tiers are {', '.join(TIER_NAMES)}")
        prefixes = tuple(prefixes)
        if prefixes:
            ckpt = replace(ckpt, prefixes=prefixes)
        return self._publisher.save(ckpt, tier, sync=sync, timeout=timeout, replaces=replaces)

    def pending(self, key: bytes, namespace: bytes | None = None) -> Future | None:
        """The in-flight save of `key` (only of that namespace, when given), so a caller can wait for it to
        publish (session_resume_wait_ms)."""
        return None if self._publisher is None else self._publisher.pending(key, namespace)


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
                ckpt = self._reader.read_verified(row, reuse=True)
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
        ckpt = self.remote.fetch(hit, self._reader.local_blocks())  # type: ignore[arg-type]  # a remote tier's hits are RemoteHits
        if ckpt is not None:
            self.counters.add_ns("restore_ns", time.perf_counter_ns() - t0)
            if promote_to is not None and ckpt.frontier_tokens >= hit.frontier:  # not a prefix's blocks alone
                self.save(ckpt, promote_to)
        return ckpt


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

    def texts(self, model: str, limit: int, namespace: bytes = b"") -> list[tuple[bytes, bytes]]:
        """(key, rendered text) of the model's `limit` most recently used rows in one namespace, read without
        their states and unverified: what a prompt is compared with to say why it missed, never restored from.
        A row removed while it is read is left out."""
        index = self._require_open()
        rows = sorted((r for r in index.rows() if r.model == model and r.status == AVAILABLE and r.location
                       and r.namespace == namespace),
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

    def dump(self, model: str | None = None, tier: str | None = None, tenant: str | None = None) -> list[dict]:
        """Every row (of one tenant's, when named) in the shape `cache dump` reports, most recently used first.

        `location` is the file path; null for ram rows (memory has no path) and for reserved rows. `namespace`
        is the first 8 bytes of the row's namespace digest, which tells a tenant's salts apart without them.
        """
        index = self._require_open()
        rows = [
            r
            for r in index.rows()
            if (model is None or r.model == model) and (tier is None or r.tier == tier)
            and (tenant is None or r.tenant == tenant)
        ]
        rows.sort(key=lambda r: r.last_used_ns, reverse=True)
        return [
            {
                **self._sharing(r),
                "key": r.key.hex(),
                "model": r.model,
                "tenant": r.tenant,
                "namespace": r.namespace[:8].hex(),
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
        """The shape `cache stats` reports: counters; per tier bytes (= stored_bytes, what the tier holds),
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
        reader = self._reader
        assert reader is not None
        return audit.verify(self._require_open(), reader.read_verified, progress)

    def check(self) -> list[str]:
        """Consistency of index, payloads and quotas; the problems found (none is healthy). Meant for quiet
        moments (tests, `cache verify`): saves in flight are allowed their reserved rows, temp files and
        not-yet-indexed files."""
        index = self._require_open()
        assert self._publisher is not None
        in_flight = {k.hex() for k in self._publisher.in_flight()}
        return audit.store_problems(index, self._tiers, in_flight)

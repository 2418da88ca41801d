"""Saves: the publish protocol, run on a writer thread for each save, and the dropping of a row a newer one
supersedes.

One save: reserve the key and its bytes in the index (evicting that tier's least recently used unreferenced
rows to fit; their files are deleted once the index has let go of them) -> make sure no earlier file of this
key is left to delete -> write the blocks no published row has in place -> write a temp file in the tier's
directory -> fdatasync -> confirm the reservation is still ours -> rename into place -> fsync the directory
-> mark the row available, durably. A crash anywhere leaves a state that the repair at open (`repair`) undoes
or completes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from barreld.names import MemoryKind

from . import blocks
from .checkpoint import Checkpoint, encode_parts, encoded_size
from .counters import Counters
from .errors import IndexWriteError, TierWriteError, WriterQueueFull
from .index import AVAILABLE, Index, Reservation, block_id
from .stateformat import StateFormatError
from .tiers import Tier
from .writer import WriterPool

if TYPE_CHECKING:
    from .remote.tier import RemoteTier

log = logging.getLogger("barreld.cache")


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



class Publisher:
    """The saves of one open store: those in flight (`pending`), and a row that waits for one of them to be
    published before it can supersede it."""

    def __init__(self, index: Index, tiers: dict[str, Tier], counters: Counters, pool: WriterPool, *,
                 block_tokens: int, remote: RemoteTier | None) -> None:
        self._index, self._tiers, self.counters, self._pool = index, tiers, counters, pool
        self.block_tokens, self.remote = block_tokens, remote
        self._pending: dict[bytes, Future] = {}
        self._namespaces: dict[bytes, bytes] = {}  # an in-flight save's key -> its namespace digest
        self._successors: dict[bytes, tuple[Checkpoint, str]] = {}  # an in-flight row -> a row that replaces it
        self._plock = threading.Lock()

    def in_flight(self) -> set[bytes]:
        """The keys of the saves not finished yet."""
        with self._plock:
            return set(self._pending)

    def save(self, ckpt: Checkpoint, tier: str, *, sync: bool, timeout: float | None, replaces: bytes | None
             ) -> SaveOutcome:
        """Queue a save to a tier of the store, unless its key is saved or being saved already or it cannot fit;
        wait for it when `sync` (see `CacheStore.save`)."""
        index = self._index
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
                fut = self._pool.submit(lambda: self.publish(ckpt, tier, replaces), urgent=sync)
            except WriterQueueFull as e:
                self.counters.count("saves_dropped")
                return SaveOutcome("dropped", key, tier, detail=str(e))
            self._pending[key] = fut
            self._namespaces[key] = ckpt.namespace
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
                self._namespaces.pop(key, None)
                self._successors.pop(key, None)

    def pending(self, key: bytes, namespace: bytes | None = None) -> Future | None:
        """The in-flight save of `key` (of that namespace, when given), so a caller can wait for it to publish
        (session_resume_wait_ms). Given a namespace, another's save is not there: a wait on it would tell
        whether another tenant is saving that key."""
        with self._plock:
            if namespace is not None and self._namespaces.get(key, namespace) != namespace:
                return None
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

    def publish(self, ckpt: Checkpoint, tier_name: str, replaces: bytes | None = None) -> SaveOutcome:
        """The publish protocol, run on a writer thread."""
        t0 = time.perf_counter_ns()
        index = self._index
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
        the new row. What it alone held (its tail of under block_tokens cells) served only a resend of exactly
        its text: that now restores from the new row, sampling at once where the new row kept that prompt's
        logits (`Checkpoint.prompt_logits`), else prefilling its last tokens again."""
        if row.chain is None or row.chain.opaque or row.memory != MemoryKind.FULL or old_key == row.key:
            return  # a sliding window or a recurrent state is restorable at its own length only
        index = self._index
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
        return self._index.reserve(
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
            tenant=ckpt.tenant,
            namespace=ckpt.namespace,
        )

    def _write_blocks(self, tier: Tier, keys: tuple[bytes, ...], payloads: dict[bytes, bytearray],
                      claim_ok: Callable[[], bool]) -> None:
        """Store the blocks no published row has in place yet, before the row that names them. A block is
        content-addressed, so a writer racing another over the same block writes the same bytes."""
        index = self._index
        for key in keys:
            index.settle(block_id(tier.name, key))  # a deletion of its last copy is done first
            if tier.put(key.hex(), blocks.encode_block(key, payloads[key]), claim_ok, block=True) is None:
                raise TierWriteError(tier.name, 0, "reservation lost while writing its blocks")

    def _mirror(self, row: Checkpoint, payloads: dict[bytes, bytearray]) -> None:
        """Queue a copy of a published row (and of the blocks it names) to the remote tier behind the saves,
        off every request's path; a full queue drops the copy (counted), as it drops a save."""
        remote = self.remote
        if remote is None or not remote.writes:
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
            self._index.abandon(key, token)
        except IndexWriteError as e:
            log.warning("could not drop the reservation of %s: %s", key.hex(), e)

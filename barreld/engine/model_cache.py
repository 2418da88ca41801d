"""One model's view of the cache: its key scheme, policy, tier and memory rules, and the saves.

The lookup routes and the restores are `barreld.engine.warmstart`'s; this module decides when and what a
sequence saves.

Only a sequence's prefilled tokens (its frontier) are ever reused, at a reuse point its memory kind allows
(`barreld.engine.memory`). A checkpoint is keyed by all of its text (a finish checkpoint by prompt + reply)
but stores only what can be reused: a full-attention state cut at the frontier, or, for a memory that cannot
be cut, the copy of the state taken at the prompt's last chunk boundary.

The worker calls this on its own thread; the store underneath is thread-safe and does the I/O (async saves
go to its writer pool).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from barreld.cache import statecut, stateformat
from barreld.cache.key import Namespace
from barreld.engine.backend import Backend, BatchItem
from barreld.engine.memory import Memory
from barreld.engine.policy import AUTO, INFINITY, Policy
from barreld.engine.sequence import Sequence
from barreld.names import MemoryKind, SaveReason

if TYPE_CHECKING:
    from barreld.cache import CacheStore, Checkpoint

log = logging.getLogger(__name__)

StateBytes = bytes | bytearray | memoryview


class KeyFunction(Protocol):
    def key(self, rendered: bytes) -> bytes: ...

    def within(self, namespace: bytes) -> KeyFunction: ...


@dataclass(frozen=True)
class SavedState:
    """What a save of a sequence stores: a state holding its first `frontier` tokens, and their logits; for a
    state that can be cut, also the logits after earlier prompts within it, where a cut gives their own state."""

    state: StateBytes
    frontier: int
    logits: np.ndarray | None
    earlier: tuple[tuple[int, np.ndarray], ...] = ()


def state_shape(backend: Backend, memory: Memory) -> stateformat.StateShape | None:
    """The model's state shape, once a real state has passed the cache core's self-check at load (taken apart
    and assembled again, byte for byte); None for a memory with no full-attention cells, or a layout the cache
    core does not know (then states are neither cut nor stored as blocks, only whole)."""
    if memory.kind is MemoryKind.RECURRENT:
        return None
    tokens = backend.tokenize(b"Barrel checks the layout of this model's states.")[:16]
    backend.decode([BatchItem(t, i, 0, False) for i, t in enumerate(tokens)])
    try:
        spec = stateformat.StateSpec.for_memory(memory.kind, backend.mrope)
        return statecut.self_check(backend.state_get(0), spec)
    except stateformat.StateFormatError as exc:
        log.warning("this llama.cpp writes states the cache core cannot read (%s); whole states are stored", exc)
        return None
    finally:
        backend.seq_rm(0, 0, -1)


def state_cutter(shape: stateformat.StateShape | None, memory: Memory) -> Callable[[bytearray, int], StateBytes] | None:
    """For full attention, a cut of a read state to its first k tokens (byte for byte the state llama.cpp
    writes for that prefix); None for a memory that cannot be cut, or a layout the cache core does not know."""
    if shape is None or not memory.cuts_states:
        return None
    return lambda state, k: statecut.cut(stateformat.parse(state, shape), k)


class ModelCache:
    # A test seam, set only by a test entry point: drop every async save as a full writer queue would, so
    # the sync evict and shutdown saves that recover such lost states can be exercised.
    drop_async_saves: ClassVar[bool] = False

    def __init__(
        self,
        store: CacheStore | None,
        scheme: KeyFunction,
        model: str,
        tier: str,
        policy: Policy,
        read_state: Callable[[int], bytearray],
        *,
        memory: Memory,
        cut_state: Callable[[bytearray, int], StateBytes] | None = None,
        block_shape: stateformat.StateShape | None = None,
        fingerprint: bytes = b"",
        quant: str = "",
        ctx_params: bytes = b"",
    ):
        self.store = store
        self.read_state = read_state
        self.cut_state = cut_state
        self.block_shape = block_shape  # given: the store keeps this model's checkpoints as blocks
        self.scheme = scheme
        self.model = model
        self.tier = tier
        self.policy = policy
        self.memory = memory
        self.fingerprint = fingerprint
        self.quant = quant
        self.ctx_params = ctx_params

    def key(self, rendered: bytes, namespace: Namespace) -> bytes:
        """The key of these bytes in a namespace: no lookup of another namespace can find it."""
        return self.scheme.within(namespace.digest).key(rendered)

    @property
    def uncapped(self) -> bool:
        """prefill_chunk_size = infinity: a prefill runs to its end before the next sampling step."""
        return self.policy.prefill_chunk_size == INFINITY

    def prefix_points(self, n_tokens: int) -> list[int]:
        """Where a prompt of n_tokens looks for stored prefixes of itself, longest first, and where a row of
        n_tokens is indexed: every block of a state that can be cut and is stored as blocks (a prompt that
        shares any of it finds it, as an agent's next prompt finds its last one whatever their lengths), else
        the policy's alignment."""
        stride = self.policy.boundary_align_tokens
        if self.memory.cuts_states and self.block_shape is not None and self.store is not None:
            stride = min(stride, self.store.block_tokens or stride)
        elif self.snapshots_boundaries:
            stride = min(stride, self.memory.chunk)
        return self.policy.prefix_boundaries(n_tokens, stride)

    @property
    def snapshots_boundaries(self) -> bool:
        """Whether prefills store snapshots at message ends (`boundary_points`)."""
        return self.store is not None and not self.memory.cuts_states and self.snapshot_gap != INFINITY

    @property
    def snapshot_gap(self) -> int | float:
        """The fewest tokens between two boundary snapshots of a prompt (policy snapshot_gap_tokens; "auto": half
        a sliding window, whose cells each snapshot holds, or a chunk for a recurrent state), a chunk at least."""
        gap = self.policy.snapshot_gap_tokens
        if gap == AUTO:
            gap = self.memory.window // 2
        return max(gap, self.memory.chunk)

    def boundary_points(self, n_tokens: int, kept: int, message_ends: list[int]) -> frozenset[int]:
        """Where a prefill of n_tokens from `kept` stores a snapshot as its own row, for a memory that cannot
        be cut: a state there is the only way a later prompt sharing that prefix restores anything.

        Points are chunk boundaries (a prefill passes them anyway, so the snapshot changes no batch and is
        byte for byte the state a cold prefill of that prefix writes) at or below the ends of messages (of a
        raw prompt: multiples of boundary_align_tokens), first ones first, each at least
        `snapshot_gap` after the last state kept, and short of the prompt's own end snapshot (which its finish
        row stores). In the prompt's last chunk a snapshot saves a later prompt less than a chunk of prefill:
        it is taken only where snapshots are cheap (a gap of one chunk: a recurrent state, not a window's
        cells). They replace the cold save, which for such a memory would serve only prompts that part
        exactly at an aligned boundary near the prompt's end."""
        if not self.snapshots_boundaries:
            return frozenset()
        chunk, align, gap = self.memory.chunk, self.policy.boundary_align_tokens, self.snapshot_gap
        marks = message_ends or range(align, n_tokens, align)
        last, end = kept, self.memory.snapshot_point(n_tokens, kept) or INFINITY
        points = []
        for p in sorted({m // chunk * chunk for m in marks}):
            spaced = p - last >= gap and p < end and (end - p >= chunk or gap <= chunk)
            if spaced and p > 0 and self.policy.allows_save(p):
                points.append(p)
                last = p
        return frozenset(points)

    def stored_texts(self, limit: int, namespace: Namespace) -> list[tuple[bytes, bytes]]:
        """(key, text) of this model's most recently used rows in a namespace, at most `limit`."""
        return [] if self.store is None else self.store.texts(self.model, limit, namespace.digest)

    def count(self, name: str, n: int = 1) -> None:
        if self.store is not None:
            self.store.counters.count(name, n)

    # ---- save moments -----------------------------------------------------------------------

    def cold_boundary(self, n_tokens: int, kept: int) -> int | None:
        """Where to capture a cold checkpoint while prefilling n_tokens after `kept` restored ones: the
        policy's boundary, moved down to a chunk boundary so the capture does not change the prefill's split."""
        if self.store is None:
            return None
        if self.snapshots_boundaries:
            return None  # the boundary snapshots take its place (`boundary_points`)
        b = self.policy.cold_save_length(n_tokens)
        if b is None:
            return None
        b = b // self.memory.chunk * self.memory.chunk
        if not self.memory.ends_call_at(b, kept, n_tokens):
            b -= self.memory.chunk  # a call runs on past it: the boundary before, where one ends
        ok = b > kept and self.memory.ends_call_at(b, kept, n_tokens) and self.policy.allows_save(b)
        return b if ok else None

    def continued_due(self, generated: int) -> bool:
        interval = self.policy.continued_interval
        return self.store is not None and interval != float("inf") and generated % interval == 0

    def save_async(self, seq: Sequence, reason: SaveReason) -> None:
        self._save(seq, reason, sync=False)

    def save_sync(self, seq: Sequence, reason: SaveReason) -> bool:
        return self._save(seq, reason, sync=True)

    def save_all(self, seqs: list[Sequence], reason: SaveReason) -> int:
        """Saves every sequence whose state is not stored yet, within evict_save_timeout_ms in all."""
        deadline = time.monotonic() + self.policy.evict_save_timeout_ms / 1000.0
        saved = 0
        for seq in seqs:
            if seq.tokens and time.monotonic() < deadline:
                saved += self._save(seq, reason, sync=True, deadline=deadline)
        return saved

    def boundary_snapshot(self, seq: Sequence) -> Callable[[], object] | None:
        """The save of a boundary snapshot (`boundary_points`): its state is read now, and calling the result
        queues it, which the worker does once the prompt is in, so that the writer's work on it (blocks,
        hashes, files, the commit) does not run beside the prefill. A side row: the sequence's own checkpoint
        (`stored_key`, `origin`) is left as it is."""
        return self._snapshot(seq, "boundary_snapshots")

    def end_snapshot(self, seq: Sequence) -> Callable[[], object] | None:
        """The save of a prompt's state at its very end, with its logits, as a side row like a boundary
        snapshot's, for a memory that cannot be cut whose own snapshot (what the finish row stores) lies at a
        chunk boundary short of that end: the same prompt sent again (a retry, an agent session replayed after a
        restart) then restores whole, rather than prefilling up to a chunk again at the full length of its
        context. Such a state serves nothing else: it restores only at its own length, with its logits."""
        if not self.snapshots_boundaries or not self.policy.allows_save(len(seq.tokens)):
            return None  # nothing read: a prompt too short to keep is not worth its state's copy
        return self._snapshot(seq, "end_snapshots")

    def _snapshot(self, seq: Sequence, counter: str) -> Callable[[], object] | None:
        if self.store is None or self._dropped():
            return None
        t0 = time.perf_counter_ns()
        rendered = bytes(seq.rendered)
        prepared = self._prepared(seq, SaveReason.COLD, rendered, self.key(rendered, seq.namespace))
        self.count("snapshot_ns", time.perf_counter_ns() - t0)
        if prepared is None:
            return None
        self.count(counter)
        store, tier, (ckpt, prefixes) = self.store, self.tier, prepared
        return lambda: store.save(ckpt, tier, prefixes, sync=False)

    def save_before_cut(self, seq: Sequence, k: int) -> None:
        """Saves the sequence (reason `evict`) when cutting it to k tokens would lose what a save of it
        stores: the part about to be dropped may be stored nowhere else."""
        if self.memory.cuts_states or len(seq.tokens) == seq.frontier:
            keeps = k >= seq.frontier
        else:
            keeps = seq.snapshot is None or k >= seq.snapshot.length
        if not keeps:
            self.save_sync(seq, SaveReason.EVICT)

    def payload(self, seq: Sequence) -> SavedState | None:
        """What a save of the sequence stores, or None when nothing of it can ever be reused."""
        frontier, logits = seq.frontier, seq.frontier_logits
        if self.memory.cuts_states or len(seq.tokens) == frontier:
            state = self.read_state(seq.id) if frontier else None
            if state is not None and self.memory.cuts_states and len(seq.tokens) > frontier:
                state = self._cut(state, frontier)
        elif seq.snapshot is not None:
            state, frontier, logits = seq.snapshot.state, seq.snapshot.length, seq.snapshot.logits
        else:
            state = None
        if state is None or not self.memory.reusable(frontier, logits is not None):
            return None
        earlier = tuple((p, row) for p, row in sorted(seq.prompt_logits.items())
                        if p < frontier and self.memory.cuts_states and self.memory.cut_is_own(p))
        return SavedState(state, frontier, logits, earlier)

    def _cut(self, state: bytearray, frontier: int) -> StateBytes:
        """The state cut at the frontier; whole (a restore cuts it then) when the layout is not understood."""
        if self.cut_state is None:
            return state
        try:
            return self.cut_state(state, frontier)
        except stateformat.StateFormatError as exc:
            log.warning("%s: a state could not be cut (%s); it is stored whole", self.model, exc)
            return state

    def _save(self, seq: Sequence, reason: SaveReason, *, sync: bool, deadline: float | None = None) -> bool:
        if self.store is None or not self.policy.allows_save(seq.frontier):
            return False
        if not sync and self._dropped():
            return False
        rendered = bytes(seq.rendered)
        key = self.key(rendered, seq.namespace)
        if seq.stored_key == key and (self.store.lookup(key) is not None or self.store.pending(key)):
            return False
        prepared = self._prepared(seq, reason, rendered, key)
        if prepared is None:
            return False
        ckpt, prefixes = prepared
        if deadline is None:
            deadline = time.monotonic() + self.policy.evict_save_timeout_ms / 1000.0
        outcome = self.store.save(
            ckpt,
            self.tier,
            prefixes,
            sync=sync,
            timeout=max(0.0, deadline - time.monotonic()) if sync else None,
            replaces=seq.origin,
        )
        seq.stored_key = key
        if outcome.status in ("queued", "published", "duplicate"):
            seq.origin = key
        return outcome.status == "published" if sync else outcome.status == "queued"

    def _dropped(self) -> bool:
        """The test seam `drop_async_saves`: an async save dropped, and counted, as a full writer queue would."""
        if self.drop_async_saves and self.store is not None:
            self.store.counters.count("saves_dropped")
        return self.drop_async_saves

    def _prepared(self, seq: Sequence, reason: SaveReason, rendered: bytes, key: bytes
                  ) -> tuple[Checkpoint, list[tuple[bytes, int]]] | None:
        """The checkpoint a save of the sequence writes and the prefix keys it is found under; None when nothing
        of it can be reused or it is too short to keep."""
        payload = self.payload(seq)
        if payload is None or not self.policy.allows_save(payload.frontier):
            return None
        ckpt = self._checkpoint(seq, key, rendered, reason, payload)
        return ckpt, self._prefixes(seq, rendered, payload.frontier)

    def _checkpoint(self, seq: Sequence, key: bytes, rendered: bytes, reason: str, payload: SavedState) -> Checkpoint:
        from barreld.cache import Checkpoint

        logits = payload.logits
        return Checkpoint(
            key=key,
            model=self.model,
            fingerprint=self.fingerprint,
            quant=self.quant,
            ctx_params=self.ctx_params,
            rendered=rendered,
            tokens=list(seq.tokens),
            save_reason=reason,
            created=time.time(),
            state=payload.state,
            logits=None if logits is None else logits.tobytes(),
            logits_at=None if logits is None else payload.frontier,
            prompt_logits=tuple((p, row.tobytes()) for p, row in payload.earlier),
            frontier=payload.frontier,
            memory=str(self.memory.kind),
            layout=self.block_shape,
            tenant=seq.namespace.tenant,
            namespace=seq.namespace.digest,
        )

    def _prefixes(self, seq: Sequence, rendered: bytes, frontier: int) -> list[tuple[bytes, int]]:
        """The prefix keys a checkpoint is also found under: stride boundaries, and its prompt (an exact hit
        when the prompt is sent again), where its state can serve them."""
        points = set(self.prefix_points(len(seq.tokens)))
        if 0 < seq.prompt_len < len(seq.tokens):
            points.add(seq.prompt_len)
        points = {b for b in points if self.memory.indexed_at(b, frontier)}
        if self.snapshots_boundaries:
            # a state that cannot be cut, found where the lookup walks (it then checks the prompt holds the rest)
            points.add(frontier // self.memory.chunk * self.memory.chunk)
        return [(self.key(rendered[: seq.offsets[b]], seq.namespace), b) for b in sorted(points - {0})]

"""One model's view of the cache: its key scheme, policy, tier and memory rules, the lookup routes and the saves.

Only a sequence's prefilled tokens (its frontier) are ever reused, at a reuse point its memory kind allows
(`barreld.engine.memory`). A checkpoint is keyed by all of its text (a finish checkpoint by prompt + reply)
but stores only what can be reused: a full-attention state cut at the frontier, or, for a memory that cannot
be cut, the copy of the state taken at the prompt's last chunk boundary.

The worker calls this on its own thread; the store underneath is thread-safe and does the I/O (async saves
go to its writer pool).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from barreld.cache import statecut, stateformat
from barreld.cache.policy import INFINITY, Policy
from barreld.engine.backend import Backend, BatchItem
from barreld.engine.memory import Memory
from barreld.engine.plan import common_prefix_len
from barreld.engine.sequence import Sequence, Snapshot
from barreld.names import MemoryKind, Route

if TYPE_CHECKING:
    from barreld.cache import CacheStore, Checkpoint, Hit

log = logging.getLogger(__name__)

LIVE_MIN_TOKENS = 32
StateBytes = bytes | bytearray | memoryview


class KeyFunction(Protocol):
    def key(self, rendered: bytes) -> bytes: ...


@dataclass
class Found:
    """The best warm start for a prompt: `tokens` of it from `seq` (live: cut, or its snapshot restored) or
    from `hit`, as far as the lookup can tell before reading anything."""

    route: Route = Route.MISS
    tokens: int = 0
    seq: Sequence | None = None
    snapshot: Snapshot | None = None
    hit: Hit | None = None
    tier: str | None = None


@dataclass(frozen=True)
class Payload:
    """What a save of a sequence stores: a state holding its first `frontier` tokens, and their logits."""

    state: StateBytes
    frontier: int
    logits: np.ndarray | None


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
        pos_range: Callable[[int], tuple[int, int]],
        cut_state: Callable[[bytearray, int], StateBytes] | None = None,
        block_shape: stateformat.StateShape | None = None,
        fingerprint: bytes = b"",
        quant: str = "",
        ctx_params: bytes = b"",
    ):
        self.store = store
        self.read_state = read_state
        self.pos_range = pos_range
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

    def key(self, rendered: bytes) -> bytes:
        return self.scheme.key(rendered)

    @property
    def uncapped(self) -> bool:
        """prefill_chunk_size = infinity: a prefill runs to its end before the next sampling step."""
        return self.policy.prefill_chunk_size == INFINITY

    # ---- lookups ----------------------------------------------------------------------------

    def find(
        self, tokens: list[int], rendered: bytes, offsets: list[int], parent_key: bytes | None, idle: list[Sequence]
    ) -> Found:
        """Tries every route and keeps the one that reuses the most of the prompt.

        Ties go to the cheaper route: live, exact, resume, longest prefix.
        """
        best = Found()
        for seq in idle:
            candidate = self._live(seq, tokens)
            if candidate.tokens > best.tokens:
                best = candidate
        if self.store is None or best.tokens == len(tokens):
            return best
        t0 = time.perf_counter_ns()
        try:
            for candidate in (
                self._exact(len(tokens), rendered),
                self._resume(parent_key, len(tokens), rendered, offsets),
                self._longest_prefix(len(tokens), rendered, offsets, best.tokens),
            ):
                if candidate is not None and candidate.tokens > best.tokens:
                    best = candidate
            if best.hit is None and self.store.remote is not None:
                best = self._remote(len(tokens), rendered, offsets, parent_key, best)
        finally:
            self.store.counters.add_ns("lookup_ns", time.perf_counter_ns() - t0)
        return best

    def _live(self, seq: Sequence, tokens: list[int]) -> Found:
        """What a live sequence offers: a cut of itself, else its snapshot; the prompt must share its tokens."""
        n, matched = len(tokens), common_prefix_len(seq.tokens, tokens)
        # A few shared tokens (a common header) are not worth a live sequence's state.
        if matched < min(LIVE_MIN_TOKENS, max(2, n // 2)):
            return Found()
        logits_at = seq.frontier if seq.frontier_logits is not None else None
        k = self.memory.live_point(len(seq.tokens), seq.frontier, matched, n, logits_at)
        if k and self.memory.kind is MemoryKind.SWA and not self.memory.holds(k, self.pos_range(seq.id)[0], k - 1):
            k = 0
        if k:
            return Found(Route.LIVE, k, seq=seq)
        snap = seq.snapshot
        if snap is not None:
            k = self.memory.restore_point(snap.length, matched, n, snap.length if snap.logits is not None else None)
            if k:
                return Found(Route.LIVE, k, seq=seq, snapshot=snap)
        self.refused(Route.LIVE, self.memory.aligned(min(seq.frontier, matched), n, logits_at))
        return Found()

    def refused(self, route: Route, could: int) -> None:
        """Counts a candidate the memory's rules skipped, where full attention would have reused `could`."""
        if could > 0 and self.store is not None:
            self.store.counters.count("reuse_refused")
            log.debug("%s: a %s reuse of %d tokens refused for %s memory", self.model, route, could, self.memory.kind)

    def _stored(self, route: Route, hit: Hit, n: int) -> Found | None:
        """A stored candidate, judged by its row alone: the prompt shares its first hit.n_tokens tokens' text."""
        k = self.memory.restore_point(hit.frontier, hit.n_tokens, n, hit.frontier)
        if not k:
            self.refused(route, self.memory.aligned(min(hit.frontier, hit.n_tokens), n, hit.frontier))
            return None
        return Found(route, k, hit=hit, tier=hit.tier)

    def _exact(self, n: int, rendered: bytes) -> Found | None:
        """The whole prompt's key: a checkpoint of exactly this prompt, or one that extends it (a finish
        checkpoint is also indexed under its prompt's key)."""
        hit = self.store.lookup(self.key(rendered))
        return None if hit is None else self._stored(Route.EXACT, hit, n)

    def _resume(self, parent_key: bytes | None, n: int, rendered: bytes, offsets: list[int]) -> Found | None:
        """The parent checkpoint's bytes must be a strict prefix of the prompt: checked through the key
        itself (the hash of the prompt's first bytes), so no file is read to decide."""
        if not parent_key:
            return None
        hit = self.store.lookup(parent_key)
        if hit is None:
            pending = self.store.pending(parent_key)
            if pending is not None:
                self.store.counters.count("resume_waits")
                with contextlib.suppress(Exception):
                    pending.result(timeout=self.policy.session_resume_wait_ms / 1000.0)
                hit = self.store.lookup(parent_key)
        if hit is None or not self._continues(hit, parent_key, rendered, offsets):
            return None
        return self._stored(Route.RESUME, hit, n)

    def _continues(self, hit: Hit, parent_key: bytes, rendered: bytes, offsets: list[int]) -> bool:
        """Whether the parent's bytes are a strict prefix of the prompt: a whole checkpoint renders to
        hit.text_bytes bytes; a prefix alias to the bytes of its first n tokens, which are the prompt's own
        first n tokens when both tokenise alike."""
        lengths = {hit.text_bytes} if hit.n_tokens == hit.total_tokens else set()
        if hit.n_tokens < len(offsets):
            lengths.add(offsets[hit.n_tokens])
        return any(size < len(rendered) and self.key(rendered[:size]) == parent_key for size in lengths)

    def _longest_prefix(self, n: int, rendered: bytes, offsets: list[int], floor: int) -> Found | None:
        """Walks the prompt's stride boundaries, longest first, while a boundary could still beat the best
        found (a state that cannot be cut may serve less than the boundary it was found under)."""
        best = None
        for b in self.policy.prefix_boundaries(n):
            if b <= max(floor, best.tokens if best else 0):
                break
            self.store.counters.count("longest_prefix_probes")
            hit = self.store.lookup(self.key(rendered[: offsets[b]]))
            candidate = None if hit is None else self._stored(Route.LONGEST_PREFIX, hit, n)
            if candidate is not None and (best is None or candidate.tokens > best.tokens):
                best = candidate
        return best

    def _remote(self, n: int, rendered: bytes, offsets: list[int], parent_key: bytes | None, best: Found) -> Found:
        """After a local miss, the keys the local lookups tried (exact, parent, prefix boundaries above what
        is covered) go to the remote tier in one round trip; the usable hit that covers the most wins."""
        probes = [(Route.EXACT, self.key(rendered))]
        if parent_key:
            probes.append((Route.RESUME, parent_key))
        probes += [
            (Route.LONGEST_PREFIX, self.key(rendered[: offsets[b]]))
            for b in self.policy.prefix_boundaries(n)
            if b > best.tokens
        ]
        hits = self.store.lookup_remote([key for _, key in probes])
        for (route, key), hit in zip(probes, hits, strict=True):
            if hit is None or hit.n_tokens <= best.tokens:
                continue
            if route is Route.RESUME and not self._continues(hit, key, rendered, offsets):
                continue
            candidate = self._stored(route, hit, n)
            if candidate is not None and candidate.tokens > best.tokens:
                best = candidate
        return best

    def stored_texts(self, limit: int) -> list[tuple[bytes, bytes]]:
        """(key, text) of this model's most recently used rows, at most `limit`."""
        return [] if self.store is None else self.store.texts(self.model, limit)

    def usable(self, ckpt: Checkpoint, hit: Hit, tokens: list[int]) -> int:
        """Tokens of a read checkpoint the prompt can reuse: its tokens must be the prompt's own."""
        matched = common_prefix_len(ckpt.tokens[: hit.n_tokens], tokens)
        logits_at = ckpt.logits_tokens if ckpt.logits is not None else None
        return self.memory.restore_point(ckpt.frontier_tokens, matched, len(tokens), logits_at)

    def count(self, name: str) -> None:
        if self.store is not None:
            self.store.counters.count(name)

    @contextlib.contextmanager
    def restore(self, hit: Hit) -> Iterator[Checkpoint | None]:
        with self.store.restore(hit, promote_to=self.tier) as ckpt:
            if ckpt is not None and (ckpt.fingerprint != self.fingerprint or ckpt.ctx_params != self.ctx_params):
                log.error("checkpoint %s belongs to another model or context layout; not restored", hit.row_key.hex())
                ckpt = None
            yield ckpt

    # ---- save moments -----------------------------------------------------------------------

    def cold_boundary(self, n_tokens: int, kept: int) -> int | None:
        """Where to capture a cold checkpoint while prefilling n_tokens after `kept` restored ones: the
        policy's boundary, moved down to a chunk boundary so the capture does not change the prefill's split."""
        if self.store is None:
            return None
        b = self.policy.cold_save_length(n_tokens)
        b = None if b is None else b // self.memory.chunk * self.memory.chunk
        return b if b is not None and b > kept and self.policy.allows_save(b) else None

    def continued_due(self, generated: int) -> bool:
        interval = self.policy.continued_interval
        return self.store is not None and interval != float("inf") and generated % interval == 0

    def save_async(self, seq: Sequence, reason: str) -> None:
        self._save(seq, reason, sync=False)

    def save_sync(self, seq: Sequence, reason: str) -> bool:
        return self._save(seq, reason, sync=True)

    def save_all(self, seqs: list[Sequence], reason: str) -> int:
        """Saves every sequence whose state is not stored yet, within evict_save_timeout_ms in all."""
        deadline = time.monotonic() + self.policy.evict_save_timeout_ms / 1000.0
        saved = 0
        for seq in seqs:
            if seq.tokens and time.monotonic() < deadline:
                saved += self._save(seq, reason, sync=True, deadline=deadline)
        return saved

    def keeps(self, seq: Sequence, k: int) -> bool:
        """Whether cutting the sequence to k tokens loses nothing that a save of it would store."""
        if self.memory.cuts_states or len(seq.tokens) == seq.frontier:
            return k >= seq.frontier
        return seq.snapshot is None or k >= seq.snapshot.length

    def payload(self, seq: Sequence) -> Payload | None:
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
        return Payload(state, frontier, logits)

    def _cut(self, state: bytearray, frontier: int) -> StateBytes:
        """The state cut at the frontier; whole (a restore cuts it then) when the layout is not understood."""
        if self.cut_state is None:
            return state
        try:
            return self.cut_state(state, frontier)
        except stateformat.StateFormatError as exc:
            log.warning("%s: a state could not be cut (%s); it is stored whole", self.model, exc)
            return state

    def _save(self, seq: Sequence, reason: str, *, sync: bool, deadline: float | None = None) -> bool:
        if self.store is None or not self.policy.allows_save(seq.frontier):
            return False
        if not sync and self.drop_async_saves:
            self.store.counters.count("saves_dropped")
            return False
        rendered = bytes(seq.rendered)
        key = self.key(rendered)
        if seq.stored_key == key and (self.store.lookup(key) is not None or self.store.pending(key)):
            return False
        payload = self.payload(seq)
        if payload is None or not self.policy.allows_save(payload.frontier):
            return False
        ckpt = self._checkpoint(seq, key, rendered, reason, payload)
        if deadline is None:
            deadline = time.monotonic() + self.policy.evict_save_timeout_ms / 1000.0
        outcome = self.store.save(
            ckpt,
            self.tier,
            self._prefixes(seq, rendered, payload.frontier),
            sync=sync,
            timeout=max(0.0, deadline - time.monotonic()) if sync else None,
            replaces=seq.origin,
        )
        seq.stored_key = key
        if outcome.status in ("queued", "published", "duplicate"):
            seq.origin = key
        return outcome.status == "published" if sync else outcome.status == "queued"

    def _checkpoint(self, seq: Sequence, key: bytes, rendered: bytes, reason: str, payload: Payload) -> Checkpoint:
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
            frontier=payload.frontier,
            memory=str(self.memory.kind),
            layout=self.block_shape,
        )

    def _prefixes(self, seq: Sequence, rendered: bytes, frontier: int) -> list[tuple[bytes, int]]:
        """The prefix keys a checkpoint is also found under: stride boundaries, and its prompt (an exact hit
        when the prompt is sent again), where its state can serve them."""
        points = set(self.policy.prefix_boundaries(len(seq.tokens)))
        if 0 < seq.prompt_len < len(seq.tokens):
            points.add(seq.prompt_len)
        points = {b for b in points if self.memory.indexed_at(b, frontier)}
        return [(self.key(rendered[: seq.offsets[b]]), b) for b in sorted(points)]

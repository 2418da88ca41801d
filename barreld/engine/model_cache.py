"""One model's view of the cache: its key scheme, policy and tier, the lookup paths and the save moments.

The worker calls this on its own thread; the store underneath is thread-safe and does the I/O
(async saves go to its writer pool).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from barreld.cache.policy import Policy
from barreld.engine.plan import MIN_CHUNK, common_prefix_len, tokens_within
from barreld.engine.sequence import Sequence
from barreld.names import Route

if TYPE_CHECKING:
    from barreld.cache import CacheStore, Checkpoint, Hit

log = logging.getLogger(__name__)

LIVE_MIN_TOKENS = 32


class KeyFunction(Protocol):
    def key(self, rendered: bytes) -> bytes: ...


@dataclass
class Found:
    """The best warm start for a prompt: `tokens` of it are available from `seq` (live) or `hit`."""

    route: Route = Route.MISS
    tokens: int = 0
    seq: Sequence | None = None
    hit: Hit | None = None
    tier: str | None = None


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
        fingerprint: bytes = b"",
        quant: str = "",
        ctx_params: bytes = b"",
    ):
        self.store = store
        self.read_state = read_state
        self.scheme = scheme
        self.model = model
        self.tier = tier
        self.policy = policy
        self.fingerprint = fingerprint
        self.quant = quant
        self.ctx_params = ctx_params

    def key(self, rendered: bytes) -> bytes:
        return self.scheme.key(rendered)

    # ---- lookups ----------------------------------------------------------------------------

    def find(
        self, tokens: list[int], rendered: bytes, offsets: list[int], parent_key: bytes | None, idle: list[Sequence]
    ) -> Found:
        """Tries every path and keeps the one that covers the most of the prompt.

        Ties go to the cheaper route: live, exact, resume, longest prefix.
        """
        best = Found()
        for seq in idle:
            n = tokens_within(seq.offsets, common_prefix_len(seq.rendered, rendered))
            # A few shared tokens (a common header) are not worth a live sequence's state.
            if n > best.tokens and n >= min(LIVE_MIN_TOKENS, max(2, len(tokens) // 2)):
                best = Found(Route.LIVE, n, seq=seq)
        if self.store is None or best.tokens == len(tokens):
            return best
        t0 = time.perf_counter_ns()
        try:
            for candidate in (
                self._exact(tokens, rendered),
                self._resume(parent_key, rendered, offsets),
                self._longest_prefix(tokens, rendered, offsets, best.tokens),
            ):
                if candidate is not None and candidate.tokens > best.tokens:
                    best = candidate
            if best.hit is None and self.store.remote is not None:
                best = self._remote(tokens, rendered, offsets, parent_key, best)
        finally:
            self.store.counters.add_ns("lookup_ns", time.perf_counter_ns() - t0)
        return best

    def _exact(self, tokens: list[int], rendered: bytes) -> Found | None:
        """The whole prompt's key: a checkpoint of exactly this prompt, or one that extends it (a finish
        checkpoint is also indexed under its prompt's key)."""
        hit = self.store.lookup(self.key(rendered))
        if hit is None:
            return None
        return Found(Route.EXACT, hit.n_tokens, hit=hit, tier=hit.tier)

    def _resume(self, parent_key: bytes | None, rendered: bytes, offsets: list[int]) -> Found | None:
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
        return Found(Route.RESUME, hit.n_tokens, hit=hit, tier=hit.tier)

    def _continues(self, hit: Hit, parent_key: bytes, rendered: bytes, offsets: list[int]) -> bool:
        """Whether the parent's bytes are a strict prefix of the prompt: a whole checkpoint renders to
        hit.text_bytes bytes; a prefix alias to the bytes of its first n tokens, which are the prompt's own
        first n tokens when both tokenise alike."""
        lengths = {hit.text_bytes} if hit.n_tokens == hit.total_tokens else set()
        if hit.n_tokens < len(offsets):
            lengths.add(offsets[hit.n_tokens])
        return any(n < len(rendered) and self.key(rendered[:n]) == parent_key for n in lengths)

    def _longest_prefix(self, tokens: list[int], rendered: bytes, offsets: list[int], floor: int) -> Found | None:
        """Walks the prompt's stride boundaries, longest first; stops below what is already covered."""
        for b in self.policy.prefix_boundaries(len(tokens)):
            if b <= floor:
                break
            self.store.counters.count("longest_prefix_probes")
            hit = self.store.lookup(self.key(rendered[: offsets[b]]))
            if hit is not None:
                return Found(Route.LONGEST_PREFIX, hit.n_tokens, hit=hit, tier=hit.tier)
        return None

    def _remote(
        self, tokens: list[int], rendered: bytes, offsets: list[int], parent_key: bytes | None, best: Found
    ) -> Found:
        """After a local miss, the keys the local lookups tried (exact, parent, prefix boundaries above what
        is covered) go to the remote tier in one round trip; the hit that covers the most wins."""
        probes = [(Route.EXACT, self.key(rendered))]
        if parent_key:
            probes.append((Route.RESUME, parent_key))
        probes += [(Route.LONGEST_PREFIX, self.key(rendered[: offsets[b]]))
                   for b in self.policy.prefix_boundaries(len(tokens)) if b > best.tokens]
        hits = self.store.lookup_remote([key for _, key in probes])
        for (route, key), hit in zip(probes, hits, strict=True):
            if hit is None or hit.n_tokens <= best.tokens:
                continue
            if route is Route.RESUME and not self._continues(hit, key, rendered, offsets):
                continue
            best = Found(route, hit.n_tokens, hit=hit, tier=hit.tier)
        return best

    def count_route(self, route: Route) -> None:
        if self.store is not None:
            self.store.counters.count(route.counter)

    @contextlib.contextmanager
    def restore(self, hit: Hit) -> Iterator[Checkpoint | None]:
        with self.store.restore(hit, promote_to=self.tier) as ckpt:
            if ckpt is not None and (ckpt.fingerprint != self.fingerprint or ckpt.ctx_params != self.ctx_params):
                log.error("checkpoint %s belongs to another model or context layout; not restored", hit.row_key.hex())
                ckpt = None
            yield ckpt

    # ---- save moments -----------------------------------------------------------------------

    def cold_boundary(self, n_tokens: int, kept: int) -> int | None:
        """Where to capture a cold checkpoint while prefilling n_tokens after `kept` restored ones."""
        if self.store is None:
            return None
        b = self.policy.cold_save_length(n_tokens)
        return b if b is not None and b > kept else None

    def chunk_size(self, n_batch: int) -> int | None:
        """Per-tick prefill cap; None (prefill_chunk_size = infinity) lets a prefill run to its end."""
        size = self.policy.chunk_size(n_batch)
        return None if size is None else max(MIN_CHUNK, min(size, n_batch))

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

    @staticmethod
    def _logits(seq: Sequence) -> dict:
        """The prompt's last logits when the sequence has grown past its prompt (a resent prompt is the
        common exact hit), else those of its last token, if known."""
        if seq.prompt_logits is not None and 0 < seq.prompt_len < len(seq.tokens):
            return {"logits": seq.prompt_logits.tobytes(), "logits_at": seq.prompt_len}
        return {"logits": seq.logits.tobytes() if seq.logits is not None else None}

    def _save(self, seq: Sequence, reason: str, *, sync: bool, deadline: float | None = None) -> bool:
        if self.store is None or not self.policy.allows_save(len(seq.tokens)):
            return False
        if not sync and self.drop_async_saves:
            self.store.counters.count("saves_dropped")
            return False
        rendered = bytes(seq.rendered)
        key = self.key(rendered)
        if seq.stored_key == key and (self.store.lookup(key) is not None or self.store.pending(key)):
            return False
        from barreld.cache import Checkpoint

        ckpt = Checkpoint(
            key=key,
            model=self.model,
            fingerprint=self.fingerprint,
            quant=self.quant,
            ctx_params=self.ctx_params,
            rendered=rendered,
            tokens=list(seq.tokens),
            save_reason=reason,
            created=time.time(),
            state=self.read_state(seq.id),
            **self._logits(seq),
        )
        points = set(self.policy.prefix_boundaries(len(seq.tokens)))
        if 0 < seq.prompt_len < len(seq.tokens):
            points.add(seq.prompt_len)
        prefixes = [(self.key(rendered[: seq.offsets[b]]), b) for b in sorted(points)]
        if deadline is None:
            deadline = time.monotonic() + self.policy.evict_save_timeout_ms / 1000.0
        outcome = self.store.save(
            ckpt, self.tier, prefixes, sync=sync, timeout=max(0.0, deadline - time.monotonic()) if sync else None
        )
        seq.stored_key = key
        return outcome.status == "published" if sync else outcome.status == "queued"

"""The warm start of a prompt, decided in one place: found as one plan, applied to a sequence, checked.

`WarmStarts.find` tries every lookup route and returns one `WarmStart`: the route, how many tokens it keeps,
and what to put back (a live sequence to cut back or whose snapshot to restore, or a stored row to read).
`WarmStarts.apply` puts that prefix into a sequence through the backend and checks it: a read checkpoint's
tokens must be the prompt's own, and llama.cpp's own account of the sequence's positions must be what the
memory kind needs (`Memory.holds`). Anything short of that clears the sequence and the prompt is prefilled
cold; a reuse the memory's rules or llama.cpp refused is counted as `reuse_refused` here, in `_refuse`.

Only a sequence's prefilled tokens (its frontier) are ever reused, at a reuse point its memory kind allows
(`barreld.engine.memory`). The routes, cheapest first: live (an idle sequence that still holds the prompt's
start), exact (the whole prompt's key), resume (the parent checkpoint the client names), longest prefix (the
prompt's stride boundaries, longest first), then the remote tier in one round trip after a local miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from barreld.cache.key import Namespace
from barreld.engine.backend import Backend, BackendError
from barreld.engine.model_cache import ModelCache
from barreld.engine.plan import common_prefix_len
from barreld.engine.sequence import Sequence, Snapshot
from barreld.names import Route, SaveReason

if TYPE_CHECKING:
    from barreld.cache import Checkpoint, Hit

log = logging.getLogger(__name__)

LIVE_MIN_TOKENS = 32

Keys = Callable[[bytes], bytes]
"""The key of a prompt's bytes in the namespace of the request looking it up."""


@dataclass(frozen=True)
class WarmStart:
    """The plan for one prompt's warm start, as far as the lookup can tell before reading anything: keep its
    first `tokens` tokens from the live sequence `seq` (cut back to them, or its `snapshot` put back) or from
    the stored row `hit` (its tier named in `tier`); the route MISS with 0 tokens is a cold prefill.

    Applied, llama.cpp must then report positions that hold exactly the tokens kept (`Memory.holds`): 0 to
    kept - 1 for full attention, the window's last cells for a sliding window, kept - 1 alone for a recurrent
    state. A stored row may keep fewer tokens than planned once read (its tokens must be the prompt's own: a
    parent whose bytes the prompt extends may end on a token the prompt splits otherwise); then `fallback`,
    the next best stored row, is tried."""

    route: Route = Route.MISS
    tokens: int = 0
    seq: Sequence | None = None
    snapshot: Snapshot | None = None
    hit: Hit | None = None
    tier: str | None = None
    fallback: WarmStart | None = None

    def served(self, kept: int) -> tuple[Route, str | None]:
        """The route and tier a request reports once `kept` tokens were put back (none: a miss)."""
        if kept <= 0:
            return Route.MISS, None
        return self.route, None if self.route is Route.LIVE else self.tier


class WarmStarts:
    """One model's warm starts: the lookup routes over its idle sequences and its cache's store, and their
    application to a sequence through its backend. Runs on the model's worker thread."""

    def __init__(self, name: str, cache: ModelCache, backend: Backend):
        self.name = name
        self.cache = cache
        self.backend = backend
        self.memory = cache.memory

    # ---- finding ----------------------------------------------------------------------------

    def find(
        self, tokens: list[int], rendered: bytes, offsets: list[int], parent_key: bytes | None, idle: list[Sequence],
        namespace: Namespace,
    ) -> WarmStart:
        """Tries every route within the request's namespace and keeps the one that reuses the most of the prompt:
        a live sequence of another namespace is never offered, and every stored key is derived in this one.

        Ties go to the cheaper route: live, exact, resume, longest prefix.
        """
        best = WarmStart()
        key: Keys = lambda text: self.cache.key(text, namespace)  # noqa: E731 - one key function per lookup
        for seq in (s for s in idle if s.namespace.digest == namespace.digest):
            candidate = self._live_offer(seq, tokens)
            if candidate.tokens > best.tokens:
                best = candidate
        store = self.cache.store
        if store is None or best.tokens == len(tokens):
            return best
        t0 = time.perf_counter_ns()
        try:
            stored = [c for c in (
                self._exact(key, len(tokens), rendered),
                self._resume(key, namespace, parent_key, len(tokens), rendered, offsets),
                self._longest_prefix(key, len(tokens), rendered, offsets, best.tokens),
            ) if c is not None and c.tokens > best.tokens]
            if not stored and store.remote is not None:
                best = self._remote(key, len(tokens), rendered, offsets, parent_key, best)
        finally:
            store.counters.add_ns("lookup_ns", time.perf_counter_ns() - t0)
        return self._chained(stored) or best

    @staticmethod
    def _chained(stored: list[WarmStart]) -> WarmStart | None:
        """The stored candidate that reuses the most (ties to the cheaper route, first in `stored`), with the
        others behind it as fallbacks, most first, one per row."""
        ranked: dict[bytes | None, WarmStart] = {}
        for c in sorted(stored, key=lambda c: -c.tokens):
            ranked.setdefault(c.hit.row_key if c.hit else None, c)
        chain = None
        for c in reversed(ranked.values()):
            chain = dataclasses.replace(c, fallback=chain)
        return chain

    def _live_offer(self, seq: Sequence, tokens: list[int]) -> WarmStart:
        """What a live sequence offers: a cut of itself, else its snapshot; the prompt must share its tokens."""
        n, matched = len(tokens), common_prefix_len(seq.tokens, tokens)
        # A few shared tokens (a common header) are not worth a live sequence's state.
        if matched < min(LIVE_MIN_TOKENS, max(2, n // 2)):
            return WarmStart()
        logits_at = seq.logits_at(n)
        pos_min = self.backend.seq_pos_range(seq.id)[0]
        k = self.memory.live_point(len(seq.tokens), seq.frontier, matched, n, logits_at, pos_min)
        if k:
            return WarmStart(Route.LIVE, k, seq=seq)
        snap = seq.snapshot
        if snap is not None:
            k = self.memory.restore_point(snap.length, matched, n, snap.length if snap.logits is not None else None)
            if k:
                return WarmStart(Route.LIVE, k, seq=seq, snapshot=snap)
        self._refuse(Route.LIVE, self.memory.aligned(seq.frontier, matched, n, logits_at))
        return WarmStart()

    def _stored(self, route: Route, hit: Hit, n: int) -> WarmStart | None:
        """A stored candidate, judged by its row alone: the prompt shares its first hit.n_tokens tokens' text."""
        k = self.memory.restore_point(hit.frontier, hit.n_tokens, n, hit.frontier)
        if not k:
            self._refuse(route, self.memory.aligned(hit.frontier, hit.n_tokens, n, hit.frontier))
            return None
        return WarmStart(route, k, hit=hit, tier=hit.tier)

    def _exact(self, key: Keys, n: int, rendered: bytes) -> WarmStart | None:
        """The whole prompt's key: a checkpoint of exactly this prompt, or one that extends it (a finish
        checkpoint is also indexed under its prompt's key)."""
        hit = self.cache.store.lookup(key(rendered))
        return None if hit is None else self._stored(Route.EXACT, hit, n)

    def _resume(self, key: Keys, namespace: Namespace, parent_key: bytes | None, n: int, rendered: bytes,
                offsets: list[int]) -> WarmStart | None:
        """The parent checkpoint's bytes must be a strict prefix of the prompt: checked through the key
        itself (the hash of the prompt's first bytes, in the request's namespace), so no file is read to
        decide. Only a save of the request's own namespace is waited for."""
        if not parent_key:
            return None
        store = self.cache.store
        hit = store.lookup(parent_key)
        if hit is None:
            pending = store.pending(parent_key, namespace.digest)
            if pending is not None:
                store.counters.count("resume_waits")
                with contextlib.suppress(Exception):
                    pending.result(timeout=self.cache.policy.session_resume_wait_ms / 1000.0)
                hit = store.lookup(parent_key)
        if hit is None or not self._continues(key, hit, parent_key, rendered, offsets):
            return None
        return self._stored(Route.RESUME, hit, n)

    def _continues(self, key: Keys, hit: Hit, parent_key: bytes, rendered: bytes, offsets: list[int]) -> bool:
        """Whether the parent's bytes are a strict prefix of the prompt: a whole checkpoint renders to
        hit.text_bytes bytes; a prefix alias to the bytes of its first n tokens, which are the prompt's own
        first n tokens when both tokenise alike."""
        lengths = {hit.text_bytes} if hit.n_tokens == hit.total_tokens else set()
        if hit.n_tokens < len(offsets):
            lengths.add(offsets[hit.n_tokens])
        return any(size < len(rendered) and key(rendered[:size]) == parent_key for size in lengths)

    def _longest_prefix(self, key: Keys, n: int, rendered: bytes, offsets: list[int], floor: int
                        ) -> WarmStart | None:
        """Walks the prompt's stride boundaries, longest first, while a boundary could still beat the best
        found (a state that cannot be cut may serve less than the boundary it was found under)."""
        store, best = self.cache.store, None
        for b in self.cache.prefix_points(n):
            if b <= max(floor, best.tokens if best else 0):
                break
            store.counters.count("longest_prefix_probes")
            hit = store.lookup(key(rendered[: offsets[b]]))
            if hit is not None and not self.memory.cuts_states and hit.n_tokens < hit.frontier < n:
                hit = self._at_frontier(key, hit, rendered, offsets)
            candidate = None if hit is None else self._stored(Route.LONGEST_PREFIX, hit, n)
            if candidate is not None and (best is None or candidate.tokens > best.tokens):
                best = candidate
        return best

    def _at_frontier(self, key: Keys, hit: Hit, rendered: bytes, offsets: list[int]) -> Hit | None:
        """A state that cannot be cut, found under a probe point below its frontier (the walk's chunk boundary
        below it), serves the prompt only if the prompt holds its text up to the frontier: the prompt's own
        prefix there must lead to the same row (every row is indexed at its frontier)."""
        there = self.cache.store.lookup(key(rendered[: offsets[hit.frontier]]))
        return there if there is not None and there.row_key == hit.row_key else None

    def _remote(
        self, key: Keys, n: int, rendered: bytes, offsets: list[int], parent_key: bytes | None, best: WarmStart
    ) -> WarmStart:
        """After a local miss, the keys the local lookups tried (exact, parent, prefix boundaries above what
        is covered) go to the remote tier in one round trip; the usable hit that covers the most wins."""
        probes = [(Route.EXACT, key(rendered))]
        if parent_key:
            probes.append((Route.RESUME, parent_key))
        probes += [
            (Route.LONGEST_PREFIX, key(rendered[: offsets[b]]))
            for b in self.cache.prefix_points(n)
            if b > best.tokens
        ]
        hits = self.cache.store.lookup_remote([k for _, k in probes])
        for (route, probe), hit in zip(probes, hits, strict=True):
            if hit is None or hit.n_tokens <= best.tokens:
                continue
            if route is Route.RESUME and not self._continues(key, hit, probe, rendered, offsets):
                continue
            candidate = self._stored(route, hit, n)
            if candidate is not None and candidate.tokens > best.tokens:
                best = candidate
        return best

    # ---- applying ---------------------------------------------------------------------------

    def claim(self, plan: WarmStart, idle: list[Sequence], namespace: Namespace) -> Sequence:
        """The sequence the plan goes into, now the namespace's: its live one, else an empty one if there is one,
        else the least recently used idle one, saved (in its own namespace) then cleared."""
        if plan.seq is not None:
            victim = plan.seq  # its namespace's, or its group's: what it saves next is the request's tenant's
        elif empty := [s for s in idle if not s.tokens]:
            victim = empty[0]
        else:
            victim = min(idle, key=lambda s: s.last_used)
            self.cache.save_sync(victim, SaveReason.EVICT)
            self.backend.seq_rm(victim.id, 0, -1)
            victim.clear()
        victim.namespace = namespace
        return victim

    def apply(self, plan: WarmStart, seq: Sequence, tokens: list[int]) -> int:
        """Puts the plan's prefix of `tokens` into seq and checks it; returns the tokens kept, 0 when the
        prompt must be prefilled cold (the sequence is empty then). On an error seq is left empty."""
        try:
            kept = self._cut_live(plan, seq) if plan.route is Route.LIVE else self._restore(plan, seq, tokens)
            held = self.backend.seq_pos_range(seq.id)
            if kept and not self.memory.holds(kept, *held):
                self._refuse(plan.route, kept, held)
                self._empty(seq)
                kept = 0
            return kept
        except Exception:
            self._empty(seq)  # whatever state is half set up, the sequence is free again
            raise

    def _empty(self, seq: Sequence) -> None:
        self.backend.seq_rm(seq.id, 0, -1)
        seq.clear()

    def _cut_live(self, plan: WarmStart, seq: Sequence) -> int:
        """Keeps the planned prefix of a live sequence: cut back, or its snapshot put back."""
        k, held = plan.tokens, seq.frontier
        self.cache.save_before_cut(seq, k)
        snap = plan.snapshot
        if snap is None:
            self.backend.seq_rm(seq.id, k, -1)
        else:
            self.backend.state_set(seq.id, memoryview(snap.state))
        seq.truncate(k)
        if snap is not None and snap.logits is not None:
            seq.frontier_logits = snap.logits
        elif snap is None and k < held and self.memory.cut_is_own(k):
            seq.frontier_logits = seq.prompt_logits.get(k)  # a cut to a prompt's end: its own state and logits
        return k

    def _restore(self, plan: WarmStart, seq: Sequence, tokens: list[int]) -> int:
        """Puts the planned checkpoint's reusable prefix into seq; returns how many tokens it holds now."""
        if seq.tokens:
            self._empty(seq)
        if plan.hit is None:
            return 0
        with self._read(plan.hit, seq.namespace) as ckpt:
            k = 0 if ckpt is None else self._usable(ckpt, tokens)
            if k == 0:
                return 0
            try:
                self.backend.state_set(seq.id, ckpt.state)
            except BackendError:
                log.exception("restoring %s failed; prefilling instead", plan.hit)
                return 0
            if k < len(ckpt.tokens) and self.memory.cuts_states:
                self.backend.seq_rm(seq.id, k, -1)
            kept = ckpt.tokens[:k]
            seq.extend_prefilled(kept, [self.backend.piece(t) for t in kept])
            seq.origin = plan.hit.row_key
            points = [*([ckpt.logits_tokens] if ckpt.logits is not None else []), *(p for p, _ in ckpt.prompt_logits)]
            seq.keep_logits({p: np.frombuffer(ckpt.logits_after(p), dtype=np.float32).copy()
                             for p in points if p <= k and (p == k or self.memory.cut_is_own(p))})
            seq.frontier_logits = seq.prompt_logits.get(k)
            return k

    @contextlib.contextmanager
    def _read(self, hit: Hit, namespace: Namespace) -> Iterator[Checkpoint | None]:
        """The hit's checkpoint, promoted to this model's tier; None when it cannot be read or belongs to
        another model, context layout or namespace (its key says so; checked again all the same)."""
        cache = self.cache
        with cache.store.restore(hit, promote_to=cache.tier) as ckpt:
            if ckpt is not None and (ckpt.fingerprint != cache.fingerprint or ckpt.ctx_params != cache.ctx_params
                                     or ckpt.namespace != namespace.digest):
                log.error("checkpoint %s belongs to another model, context layout or namespace; not restored",
                          hit.row_key.hex())
                ckpt = None
            yield ckpt

    def _usable(self, ckpt: Checkpoint, tokens: list[int]) -> int:
        """Tokens of a read checkpoint the prompt can reuse: its tokens must be the prompt's own. Found under a
        prefix of the prompt (a block boundary), a row may share more of it than that prefix: every token the
        two have in common counts, up to the row's frontier."""
        matched, n = common_prefix_len(ckpt.tokens, tokens), len(tokens)
        logits_at = n if ckpt.logits_after(n) is not None else ckpt.logits_tokens if ckpt.logits is not None else None
        return self.memory.restore_point(ckpt.frontier_tokens, matched, n, logits_at)

    def _refuse(self, route: Route, could: int, held: tuple[int, int] | None = None) -> None:
        """Counts `reuse_refused`: a candidate the memory's rules skipped where full attention would have
        reused `could` tokens, or (`held`: the positions llama.cpp reported) a start of `could` tokens that
        llama.cpp did not account for."""
        if could <= 0:
            return
        if held is None:
            log.debug("%s: a %s reuse of %d tokens refused for %s memory", self.name, route, could, self.memory.kind)
        else:
            log.warning(
                "%s: a %s start of %d tokens left positions %d..%d in the sequence; prefilling instead",
                self.name,
                route,
                could,
                *held,
            )
        self.cache.count("reuse_refused")

    def snapshot(self, seq: Sequence) -> None:
        """Copies the state of a memory that cannot be cut, at a point a later prompt can start from (what a
        live sequence then offers besides a cut of itself)."""
        if seq.snapshot is None or seq.snapshot.length != len(seq.tokens):
            seq.snapshot = Snapshot(len(seq.tokens), self.backend.state_get(seq.id), seq.frontier_logits)

"""What a model's memory kind lets the cache reuse: pure rules over token counts and llama.cpp's positions.

The rules rest on what llama.cpp was measured to do:
- Logits depend on where a prefill's batches split (flash attention on, repacked quantised kernels), and a
  token decoded alone in its batch gets other KV than the same token inside a prefill. So only tokens
  computed by prefill are ever reused (a sequence's frontier), and every prefill splits at absolute
  multiples of the chunk size C. How fine a reuse point may be is measured per model at load
  (`barreld.engine.exactness`): the grain G, a divisor of C, such that a prefill whose batches start on
  multiples of G gives the KV and logits of the canonical split. Every reuse point is a multiple of G (G = C
  when nothing finer is proven), except a whole prompt whose last logits are stored (it samples without any
  prefill). A batch of fewer than B tokens takes other kernels than a full chunk (B = 2: a token alone;
  flash attention on the CPU: 64, its tiled path; Gemma 3's quantised kernels: 8), B measured with G: a
  reuse point never leaves fewer than B tokens to be prefilled before the next chunk boundary, and the
  tokens of a prompt's last chunk, when it held fewer than B, are never reused by a longer prompt.
- full attention: the KV of a prefix does not depend on what follows it: restore anything, cut anywhere.
- swa: a saved state holds only the last `window` cells of the sliding-window layers, so restored it is
  usable at its own length only. With swa_full a live sequence can be cut to K while its SWA layers still hold
  positions K - window .. K - 1 (pos_min <= max(0, K - window)); seq_rm says yes even when they do not.
  Without swa_full the live SWA cache is a ring of window + n_ubatch cells, as llama-server sizes it. Left to
  itself it wraps, its cells then lie in another order than a restored state's and later logits differ; so
  every prefill call on a ring ends with the window put back in position order from the first cell
  (`Backend.decode`), which is the order a restore gives it, and a state of any length restores exactly at a
  reuse point the probe proved (measured on Gemma 3: at multiples of 16 tokens, not at odd multiples of 8,
  where a warm call's cells lie shifted from a cold call's). A ring's live sequence is never cut: once the
  window moves on, the cells a cut needs are gone, so a prompt's prefill keeps a copy of its state at the last
  such point (`snapshot_point`) for the next prompt to extend.
- recurrent and hybrid: the recurrent state exists at the last position only and seq_rm of a tail is
  refused: a state is usable at exactly its own length.
"""

from __future__ import annotations

from dataclasses import dataclass

from barreld.engine.plan import chunk_end
from barreld.names import MemoryKind


def memory_kind(n_swa: int, recurrent: bool, hybrid: bool) -> MemoryKind:
    """The kind llama.cpp's model flags describe; a hybrid is checked first (it is also recurrent in part)."""
    if hybrid:
        return MemoryKind.HYBRID
    if recurrent:
        return MemoryKind.RECURRENT
    return MemoryKind.SWA if n_swa > 0 else MemoryKind.FULL


@dataclass(frozen=True)
class Memory:
    """One loaded model's memory: its kind, sliding window, swa_full setting, prefill chunk size, reuse
    grain (0: the chunk size, the rule for a model with nothing finer proven), the fewest tokens a batch
    off a chunk boundary may hold (`min_batch`), and whether every prefill call holds that many (`spans`,
    `barreld.engine.plan.call_end`)."""

    kind: MemoryKind
    window: int = 0
    swa_full: bool = False
    chunk: int = 64
    grain: int = 0
    min_batch: int = 2
    spans: bool = False

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"the chunk size must be at least 1, got {self.chunk}")
        if self.grain == 0:
            object.__setattr__(self, "grain", self.chunk)
        if self.grain < 1 or self.chunk % self.grain:
            raise ValueError(f"the reuse grain must divide the chunk size ({self.chunk}), got {self.grain}")
        if self.min_batch < 2:
            raise ValueError(f"the fewest tokens of a batch must be at least 2, got {self.min_batch}")
        if (self.kind is MemoryKind.SWA) != (self.window > 0):
            raise ValueError("a sliding window goes with the swa kind, and only with it")

    @property
    def cuts_states(self) -> bool:
        """Whether a saved state can serve a prefix shorter than itself."""
        return self.kind is MemoryKind.FULL

    @property
    def ring(self) -> bool:
        """A sliding window kept as llama.cpp's ring of window + n_ubatch cells (swa_full off)."""
        return self.kind is MemoryKind.SWA and not self.swa_full

    @property
    def cuts_live(self) -> bool:
        """Whether a live sequence can be cut back (still subject to `holds` for a sliding window)."""
        return self.kind is MemoryKind.FULL or (self.kind is MemoryKind.SWA and not self.ring)

    @property
    def summary(self) -> str:
        """The reuse this memory allows, in words, for `barrelctl models`."""
        if self.grain == self.chunk:
            points = "chunk boundary"
        else:
            points = "token" if self.grain == 1 else f"multiple of {self.grain} tokens"
        if self.kind is MemoryKind.FULL:
            return f"restores and cuts at any {points}"
        if self.kind is not MemoryKind.SWA:
            return "a state at its own length only"
        if self.swa_full:
            return f"live cuts at any {points}; restores at their own length"
        return f"a ring: restores at their own length at any {points}"

    def extendable(self, frontier: int) -> int:
        """How many of `frontier` prefilled tokens a longer prompt can reuse before the grain is applied: all
        but a last chunk of fewer than min_batch tokens (a longer prompt's cold prefill holds them in a larger
        batch, which takes other kernels); with `spans`, where every call held min_batch tokens, all of them,
        unless the prompt was shorter than that."""
        if frontier <= 0:
            return frontier
        if self.spans:  # every call held min_batch tokens, but a prompt's only call may hold fewer
            return frontier if frontier >= self.min_batch else 0
        tail = frontier - (frontier - 1) // self.chunk * self.chunk
        return frontier - tail if tail < self.min_batch else frontier

    def cut_is_own(self, p: int) -> bool:
        """Whether a state that grew past p prefilled tokens, cut at p, is the state a prefill of exactly p gives
        (so p's own logits may go with it): the tokens after p's last reuse point were computed again by the
        prefill that grew it, unproven equal unless p is itself a reuse point a longer prompt may extend from."""
        return p > 0 and self.extendable(p) == p and p % self.grain == 0

    def aligned(self, frontier: int, matched: int, n: int, logits_at: int | None) -> int:
        """The reuse point for a prompt of n tokens whose first `matched` tokens are those of a state holding
        `frontier` prefilled ones: the whole prompt when its logits after n tokens are known, else the last
        multiple of the grain below n that leaves at least min_batch tokens before the next chunk boundary (with
        `spans`, before the prompt's end: the warm start's first call runs on past that boundary)."""
        if min(frontier, matched) == n and logits_at == n and (frontier == n or self.cut_is_own(n)):
            return n
        k = min(self.extendable(frontier), matched, n - 1) // self.grain * self.grain
        if self.spans:
            return max(min(k, (n - self.min_batch) // self.grain * self.grain), 0)
        while k > 0 and k % self.chunk and chunk_end(k, n, self.chunk) - k < self.min_batch:
            k -= self.grain
        return max(k, 0)

    def restore_point(self, length: int, matched: int, n: int, logits_at: int | None) -> int:
        """Tokens a prompt of n tokens can take from a saved state of `length` prefilled tokens, when the
        prompt's first `matched` tokens are the state's; 0 when the rules refuse it."""
        if self.cuts_states:
            return self.aligned(length, matched, n, logits_at)
        if not 0 < length <= min(matched, n):
            return 0
        return length if self.aligned(length, length, n, logits_at) == length else 0

    def reusable(self, length: int, logits: bool) -> bool:
        """Whether a state of `length` prefilled tokens can serve some prompt: a longer one, or with its logits
        the same one again."""
        longer = self.restore_point(length, length, length + 2, None) > 0
        return longer or (logits and self.restore_point(length, length, length, length) > 0)

    def live_point(
        self, held: int, frontier: int, matched: int, n: int, logits_at: int | None, pos_min: int = 0
    ) -> int:
        """Tokens a prompt can keep of a live sequence holding `held` tokens, the first `frontier` of them
        prefilled, by cutting it (or, for a memory that cannot be cut, by taking it whole); `pos_min` is the
        lowest position llama.cpp reports for it, which a sliding window's cut must still hold."""
        if self.cuts_live:
            k = self.aligned(frontier, matched, n, logits_at)
            if k and self.kind is MemoryKind.SWA and not self.holds(k, pos_min, k - 1):
                return 0
            return k
        if held != frontier:
            return 0
        return self.restore_point(held, matched, n, logits_at)

    def holds(self, k: int, pos_min: int, pos_max: int) -> bool:
        """Whether a sequence that should hold k tokens does, by llama.cpp's own account of its positions
        (which speaks for the SWA cache alone in a sliding-window model, for the recurrent part in a hybrid)."""
        if k <= 0:
            return pos_max < 0
        if pos_max != k - 1:
            return False
        if self.kind is MemoryKind.FULL:
            return pos_min == 0
        if self.kind is MemoryKind.SWA:
            return pos_min <= max(0, k - self.window)
        return pos_min == k - 1

    def ends_call_at(self, b: int, kept: int, n: int) -> bool:
        """Whether a prefill of n tokens from `kept` can end a call at the chunk boundary b (where a save must
        be taken): with `spans`, not within min_batch tokens of either end, where a call runs on past it."""
        return not self.spans or (b - kept >= self.min_batch and n - b >= self.min_batch)

    def snapshot_point(self, n: int, kept: int) -> int:
        """Where a memory that cannot be cut keeps a copy of its state while prefilling a prompt of n tokens
        from `kept` restored ones: the last reuse point a later prompt can take from it, where the prefill may
        stop a call as a warm start from there would (min_batch tokens before n at least), else the chunk
        boundary below n, where every prefill splits anyway; 0 for none."""
        if self.cuts_states:
            return 0
        if kept == n or self.aligned(n, n, n + 2, None) == n:
            return n
        k = (n - 1) // self.grain * self.grain
        while k % self.chunk and self.restore_point(k, k, n, None) != k:
            k -= self.grain
        return k

    def indexed_at(self, boundary: int, frontier: int) -> bool:
        """Whether a state of `frontier` prefilled tokens is worth finding under a prefix of `boundary`
        tokens: a cut serves any shorter prefix; a state that cannot be cut, only prefixes it lies within."""
        return boundary <= frontier if self.cuts_states else boundary >= frontier

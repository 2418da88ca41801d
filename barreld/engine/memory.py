"""What a model's memory kind lets the cache reuse: pure rules over token counts and llama.cpp's positions.

The rules rest on what llama.cpp was measured to do:
- Logits depend on where a prefill's batches split (flash attention on, repacked quantised kernels), and a
  token decoded alone in its batch gets other KV than the same token inside a prefill. So only tokens
  computed by prefill are ever reused (a sequence's frontier), every prefill splits at absolute multiples
  of the chunk size C, and every reuse point is such a multiple, except a whole prompt whose last logits are
  stored (it samples without any prefill).
- full attention: the KV of a prefix does not depend on what follows it: restore anything, cut anywhere.
- swa: a saved state holds only the last `window` cells of the sliding-window layers, so restored it is
  usable at its own length only. A live sequence can be cut to K while its SWA layers still hold positions
  K - window .. K - 1 (pos_min <= max(0, K - window)); seq_rm says yes even when they do not. Without
  swa_full the live SWA cache is a ring: once it wraps, its cells lie in another order than a fresh run's and
  later logits differ. Then a state is restored only if all of its cells were saved (at most `window`
  tokens), and a live sequence is cut only if its ring never wrapped (pos_min == 0).
- recurrent and hybrid: the recurrent state exists at the last position only and seq_rm of a tail is
  refused: a state is usable at exactly its own length.
"""

from __future__ import annotations

from dataclasses import dataclass

from barreld.names import MemoryKind

_SUMMARY = {
    MemoryKind.FULL: "restores and cuts at any chunk boundary",
    MemoryKind.RECURRENT: "a state at its own length only",
    MemoryKind.HYBRID: "a state at its own length only",
}


def memory_kind(n_swa: int, recurrent: bool, hybrid: bool) -> MemoryKind:
    """The kind llama.cpp's model flags describe; a hybrid is checked first (it is also recurrent in part)."""
    if hybrid:
        return MemoryKind.HYBRID
    if recurrent:
        return MemoryKind.RECURRENT
    return MemoryKind.SWA if n_swa > 0 else MemoryKind.FULL


@dataclass(frozen=True)
class Memory:
    """One loaded model's memory: its kind, sliding window, swa_full setting and prefill chunk size."""

    kind: MemoryKind
    window: int = 0
    swa_full: bool = False
    chunk: int = 64

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"the chunk size must be at least 1, got {self.chunk}")
        if (self.kind is MemoryKind.SWA) != (self.window > 0):
            raise ValueError("a sliding window goes with the swa kind, and only with it")

    @property
    def cuts_states(self) -> bool:
        """Whether a saved state can serve a prefix shorter than itself."""
        return self.kind is MemoryKind.FULL

    @property
    def cuts_live(self) -> bool:
        """Whether a live sequence can be cut back (still subject to `holds` for a sliding window)."""
        return self.kind in (MemoryKind.FULL, MemoryKind.SWA)

    @property
    def summary(self) -> str:
        """The reuse this memory allows, in words, for `barrelctl models`."""
        if self.kind is not MemoryKind.SWA:
            return _SUMMARY[self.kind]
        if self.swa_full:
            return "live cuts at chunk boundaries; restores at their own length"
        return f"live cuts until the SWA ring wraps; restores of at most {self.window} tokens"

    def aligned(self, k: int, n: int, logits_at: int | None) -> int:
        """The reuse point at or below k for a prompt of n tokens: the whole prompt when its logits after n
        tokens are known, else the last multiple of the chunk size below n."""
        if k == n and logits_at == n:
            return n
        return min(k, n - 1) // self.chunk * self.chunk

    def restore_point(self, length: int, matched: int, n: int, logits_at: int | None) -> int:
        """Tokens a prompt of n tokens can take from a saved state of `length` prefilled tokens, when the
        prompt's first `matched` tokens are the state's; 0 when the rules refuse it."""
        if self.cuts_states:
            return self.aligned(min(length, matched), n, logits_at)
        if length > min(matched, n) or not self.restorable(length):
            return 0
        return length if self.aligned(length, n, logits_at) == length else 0

    def reusable(self, length: int, logits: bool) -> bool:
        """Whether a state of `length` prefilled tokens can serve some prompt: a longer one, or with its logits
        the same one again."""
        longer = self.restore_point(length, length, length + 1, None) > 0
        return longer or (logits and self.restore_point(length, length, length, length) > 0)

    def restorable(self, length: int) -> bool:
        """Whether a saved state of `length` tokens can be restored at all."""
        return length > 0 and (self.kind is not MemoryKind.SWA or self.swa_full or length <= self.window)

    def live_point(
        self, held: int, frontier: int, matched: int, n: int, logits_at: int | None, pos_min: int = 0
    ) -> int:
        """Tokens a prompt can keep of a live sequence holding `held` tokens, the first `frontier` of them
        prefilled, by cutting it (or, for a memory that cannot be cut, by taking it whole); `pos_min` is the
        lowest position llama.cpp reports for it, which a sliding window's cut must still hold."""
        if self.cuts_live:
            k = self.aligned(min(frontier, matched), n, logits_at)
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
            return pos_min <= max(0, k - self.window) if self.swa_full else pos_min == 0
        return pos_min == k - 1

    def snapshot_point(self, n: int, kept: int) -> int:
        """Where a memory that cannot be cut keeps a copy of its state while prefilling a prompt of n tokens
        from `kept` restored ones: the last reuse point a later prompt can take from it; 0 for none."""
        if self.cuts_states:
            return 0
        point = n if kept == n else n // self.chunk * self.chunk
        return point if self.restorable(point) else 0

    def indexed_at(self, boundary: int, frontier: int) -> bool:
        """Whether a state of `frontier` prefilled tokens is worth finding under a prefix of `boundary`
        tokens: a cut serves any shorter prefix; a state that cannot be cut, only prefixes it lies within."""
        return boundary <= frontier if self.cuts_states else boundary >= frontier

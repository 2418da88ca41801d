"""One sequence's memory in FakeBackend, for each memory kind llama.cpp has, as it was measured to behave.

A cell's KV stands as a digest of everything its computation saw: the digest before it, its position and
token, how its batch was split, and for a sliding window which window cells were there and in what order.
Logits are a function of the digest, so whatever would make llama.cpp compute other floats makes other
logits here:
- a token that is the only one of its sequence in a batch (llama.cpp's one-token kernel path);
- on a split-sensitive model (repacked quantised kernels, flash attention), where its batch starts and ends;
- sliding window: window cells missing (a cut below a restored state's window), or lying out of position
  order in the cache (a wrapped ring), change the cells computed after them.

What each kind keeps:
- full: one cell per position; any range can be removed.
- swa: every cell in the base layers, plus an SWA cache of slots: with swa_full as many as the context, else a
  ring of window + n_batch slots whose masked cells (window or more behind the newest) are overwritten, in
  slot order from a head that a removal moves back. A saved state holds the last `window` SWA cells only, and
  a restore puts them in the first slots; so does a ring's prefill call at its end (`order_window`).
  Positions reported are the SWA cache's.
- recurrent: the digest and position of the last token only; removing a tail is refused.
- hybrid: attention cells plus the recurrent tip; removing a tail is refused (the recurrent part answers
  first), and positions reported are the recurrent part's.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from barreld.engine.backend import BackendError
from barreld.names import MemoryKind

_STEP = struct.Struct("<ii")


@dataclass(frozen=True)
class Cell:
    pos: int
    token: int
    digest: bytes


@dataclass
class SeqMemory:
    kind: MemoryKind
    root: bytes
    window: int = 0
    slots: int = 0  # size of the SWA cache
    cells: list[Cell] = field(default_factory=list)  # attention cells in position order (not recurrent)
    swa: dict[int, int] = field(default_factory=dict)  # SWA slot -> position held
    head: int = 0
    tip: Cell | None = None  # the last position's cell: the recurrent state, or the newest attention cell

    @property
    def attention(self) -> bool:
        return self.kind is not MemoryKind.RECURRENT

    @property
    def recurrent(self) -> bool:
        return self.kind in (MemoryKind.RECURRENT, MemoryKind.HYBRID)

    def next_pos(self) -> int:
        return self.tip.pos + 1 if self.tip is not None else 0

    def pos_range(self) -> tuple[int, int]:
        if self.kind is MemoryKind.SWA:
            held = self.swa.values()
            return (min(held), max(held)) if held else (-1, -1)
        if self.recurrent or not self.cells:
            return (self.tip.pos, self.tip.pos) if self.tip is not None else (-1, -1)
        return self.cells[0].pos, self.cells[-1].pos

    # ---- computing -----------------------------------------------------------------------

    def add(self, pos: int, token: int, split: bytes) -> bytes:
        """Computes and keeps the cell at `pos`; returns its digest. `split` says how its batch was split."""
        seen = self._window_seen(pos) if self.kind is MemoryKind.SWA else b""
        prev = self.tip.digest if self.tip is not None else self.root
        digest = hashlib.blake2b(prev + _STEP.pack(pos, token) + split + seen, digest_size=16).digest()
        self.tip = Cell(pos, token, digest)
        if self.attention:
            self.cells.append(self.tip)
        if self.kind is MemoryKind.SWA:
            self._place(pos)
        return digest

    def _window_seen(self, pos: int) -> bytes:
        """Which window positions the new cell attends to, and whether they lie in position order."""
        seen = sorted((slot, p) for slot, p in self.swa.items() if pos - p < self.window)
        order = [p for _, p in seen]
        return struct.pack("<i?", len(order), order == sorted(order))

    def _place(self, pos: int) -> None:
        for i in range(self.slots):
            slot = (self.head + i) % self.slots
            held = self.swa.get(slot)
            if held is None or pos - held >= self.window:
                self.swa[slot] = pos
                self.head = (slot + 1) % self.slots
                return
        raise BackendError(f"no free SWA cell for position {pos}")

    # ---- removing ------------------------------------------------------------------------

    def remove(self, p0: int, p1: int) -> None:
        """Drops positions p0 <= pos < p1 (p1 < 0: to the end), or raises BackendError as llama.cpp refuses."""
        end = p1 if p1 >= 0 else 1 << 62
        if self.recurrent and self.tip is not None:
            last = self.tip.pos
            if 0 < p0 < last or 0 < end <= last:
                raise BackendError(f"positions {p0}..{p1} cut into a recurrent state (llama.cpp refuses)")
            if not p0 <= last < end:
                return
        self.cells = [c for c in self.cells if not p0 <= c.pos < end]
        freed = [slot for slot, p in self.swa.items() if p0 <= p < end]
        for slot in freed:
            del self.swa[slot]
        if freed:
            self.head = min(self.head, min(freed))
        self.tip = None if self.recurrent or not self.cells else self.cells[-1]

    def clear(self) -> None:
        self.cells, self.swa, self.head, self.tip = [], {}, 0, None

    # ---- saving --------------------------------------------------------------------------

    def saved_window(self) -> list[Cell]:
        """The SWA cells a saved state holds: the last `window` positions, as llama.cpp writes them."""
        if self.tip is None:
            return []
        by_pos = {c.pos: c for c in self.cells}
        return [by_pos[p] for p in sorted(self.swa.values()) if self.tip.pos - p < self.window]

    def order_window(self) -> None:
        """The saved window put back in the first slots, as llama.cpp's partial state round trip does."""
        window = self.saved_window()
        self.swa = {slot: c.pos for slot, c in enumerate(window)}
        self.head = len(window) % self.slots

    def load(self, cells: list[Cell], window: list[Cell], tip: Cell | None) -> None:
        """A restored state: attention cells, SWA cells in the first slots, the recurrent tip."""
        self.clear()
        self.cells = list(cells)
        for slot, c in enumerate(window):
            self.swa[slot] = c.pos
        self.head = len(window) % self.slots if self.slots else 0
        self.tip = tip if self.recurrent else (self.cells[-1] if self.cells else None)

"""Synthetic llama.cpp sequence states, written field by field with struct, independently of
barreld.cache.stateformat, with a record of which bytes are structure (not KV data) for corruption tests.

Each cell's bytes are a pure function of (seed, position), so two states holding the same positions hold
the same KV whatever their storage order, sequence or stream.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field, replace

MAGIC = 0xAF143CD8
BLOCK_BYTES = {0: 4, 1: 2, 2: 18, 8: 34, 30: 2}  # f32, f16, q4_0, q8_0, bf16: the types drawn here


@dataclass(frozen=True)
class Layer:
    k_type: int
    k_row: int
    v_type: int
    v_row: int  # bytes of one cell's V
    v_el: int = 0  # element size when V is transposed


@dataclass(frozen=True)
class Kv:
    kind: str  # "attention" or "window"
    n_stream: int
    v_trans: bool
    ext: int
    layers: tuple[Layer, ...]
    order: tuple[int, ...]  # positions, in storage order
    seed: int

    def cell(self, pos: int) -> bytes:
        size = self.ext + sum(layer.k_row + layer.v_row for layer in self.layers)
        return random.Random(f"{self.seed}:{pos}").randbytes(size)


@dataclass(frozen=True)
class Recurrent:
    positions: tuple[int, ...]  # 0 or 1 cell
    n_layer: int
    records: tuple[tuple[int, int], ...]  # (type, row_size), R records then S
    seed: int
    kind: str = "recurrent"


@dataclass
class Built:
    data: bytes
    structure: list[tuple[int, int, str]] = field(default_factory=list)  # (offset, length, what)


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()
        self.structure: list[tuple[int, int, str]] = []

    def field(self, fmt: str, what: str, *values: int) -> None:
        packed = struct.pack("<" + fmt, *values)
        self.structure.append((len(self.out), len(packed), what))
        self.out += packed

    def data(self, raw: bytes) -> None:
        self.out += raw


def build(seq_id: int, sections: list[Kv | Recurrent]) -> Built:
    w = _Writer()
    w.field("I", "magic", MAGIC)
    w.field("i", "seq_id", seq_id)
    for section in sections:
        if isinstance(section, Kv):
            _kv(w, section, seq_id)
        else:
            _recurrent(w, section)
    return Built(bytes(w.out), w.structure)


def _kv(w: _Writer, kv: Kv, seq_id: int) -> None:
    w.field("I", "n_stream", kv.n_stream)
    home = seq_id if kv.n_stream > 1 else 0
    for s in range(kv.n_stream):
        n = len(kv.order) if s == home else 0
        w.field("I", "cell_count", n)
        if n:
            _kv_cells(w, kv, seq_id)


def _kv_cells(w: _Writer, kv: Kv, seq_id: int) -> None:
    cells = [kv.cell(pos) for pos in kv.order]
    for pos, raw in zip(kv.order, cells, strict=True):
        w.field("i", "pos", pos)
        w.field("I", "n_seq_id", 1)
        w.data(raw[: kv.ext])
        w.field("i", "cell seq_id", seq_id)
    w.field("I", "v_trans", int(kv.v_trans))
    w.field("I", "n_layer", len(kv.layers))
    off = kv.ext
    for layer in kv.layers:
        w.field("i", "k type", layer.k_type)
        w.field("Q", "k row", layer.k_row)
        for raw in cells:
            w.data(raw[off : off + layer.k_row])
        off += layer.k_row
    for layer in kv.layers:
        if kv.v_trans:
            w.field("i", "v type", layer.v_type)
            w.field("I", "v el", layer.v_el)
            w.field("I", "n_embd_v", layer.v_row // layer.v_el)
            for j in range(layer.v_row // layer.v_el):
                for raw in cells:
                    w.data(raw[off + j * layer.v_el : off + (j + 1) * layer.v_el])
        else:
            w.field("i", "v type", layer.v_type)
            w.field("Q", "v row", layer.v_row)
            for raw in cells:
                w.data(raw[off : off + layer.v_row])
        off += layer.v_row


def _recurrent(w: _Writer, rec: Recurrent) -> None:
    w.field("I", "recurrent cell_count", len(rec.positions))
    for pos in rec.positions:
        w.field("i", "recurrent pos", pos)
        w.field("I", "recurrent n_seq_id", 0)
    w.field("I", "s_trans", 0)
    w.field("I", "recurrent n_layer", rec.n_layer)
    rng = random.Random(rec.seed)
    for type_id, row in rec.records:
        w.field("i", "record type", type_id)
        w.field("Q", "record row", row)
        w.data(rng.randbytes(row * len(rec.positions)))


def sorted_attention(sections: list[Kv | Recurrent], upto: int | None = None) -> list[Kv | Recurrent]:
    """The same sections with the attention cells in position order (and only positions < upto)."""
    out: list[Kv | Recurrent] = []
    for s in sections:
        if isinstance(s, Kv) and s.kind == "attention":
            s = replace(s, order=tuple(p for p in sorted(s.order) if upto is None or p < upto))
        out.append(s)
    return out


def payload(kv: Kv, positions: range) -> bytes:
    """A chunk payload as the block store gets it: extras, then K of each layer, then V of each layer."""
    cells = [kv.cell(p) for p in positions]
    parts = [b"".join(c[: kv.ext] for c in cells)]
    off = kv.ext
    for layer in kv.layers:
        parts.append(b"".join(c[off : off + layer.k_row] for c in cells))
        off += layer.k_row
    for layer in kv.layers:
        if layer.v_el:
            for j in range(layer.v_row // layer.v_el):
                parts.append(b"".join(c[off + j * layer.v_el : off + (j + 1) * layer.v_el] for c in cells))
        else:
            parts.append(b"".join(c[off : off + layer.v_row] for c in cells))
        off += layer.v_row
    return b"".join(parts)

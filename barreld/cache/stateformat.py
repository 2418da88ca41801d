"""The sequence state of the pinned llama.cpp (llama-cpp-python 0.3.36) as pure functions over bytes.

`llama_state_seq_get_data` writes (little-endian, no padding, u64 fields unaligned):

    u32 magic 0xaf143cd8, i32 seq_id, then one section per memory of the model, in its order:
    KV section (full attention, or a sliding window):
        u32 n_stream; per stream u32 cell_count, and when it is not 0:
            per cell: i32 pos, u32 n_seq_id (1), [8 bytes on M-RoPE models], i32 seq_id
            u32 v_trans, u32 n_layer
            per layer K: i32 type, u64 row_size, cell_count rows
            per layer V, v_trans 0: i32 type, u64 row_size, cell_count rows
                         v_trans 1: i32 type, u32 el_size, u32 n_embd_v_gqa, per channel a run of cell_count elements
    recurrent section (always the last one):
        u32 cell_count; per cell i32 pos, u32 n_seq_id (0); u32 s_trans (0), u32 n_layer;
        then to the end, per layer that has them: (i32 type, u64 row_size, cell_count rows), R records before S.

Only the seq's own stream has cells (stream = seq_id when there are several). Cells are written in storage
order, which is not position order after a removal, so everything here selects cells by position.

`parse` reads a state into a layout that `statecut` cuts, takes apart and assembles again. Every length is
checked against the buffer; anything inconsistent raises StateFormatError, and a layout this module does not
know is refused, never misread.
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass, fields
from enum import StrEnum

import numpy as np

from barreld.names import MemoryKind

from .checkpoint import Buffer
from .errors import CacheError

MAGIC = 0xAF143CD8
HEADER = struct.Struct("<Ii")
MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: the most streams a context can have
MROPE_CELL_EXT = 8  # bytes of llama_kv_cell_ext per cell on M-RoPE models

# ggml types a KV or recurrent cache may hold: type id -> bytes per block (rows are whole blocks).
GGML_BLOCK_BYTES = {0: 4, 1: 2, 2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 20: 18, 30: 2}
# Types that llama.cpp can store transposed (one element per cell, no blocks): f32, f16, bf16.
GGML_PLAIN_TYPES = frozenset({0, 1, 30})

U32 = struct.Struct("<I")
TWO_U32 = struct.Struct("<II")
ROWS_HEAD = struct.Struct("<iQ")
RUNS_HEAD = struct.Struct("<iII")


class StateFormatError(CacheError):
    """A sequence state this module cannot read exactly: corrupt, truncated, or another llama.cpp's layout."""


class SectionKind(StrEnum):
    """What one memory of the model keeps, which decides whether its section can be cut by position."""

    ATTENTION = "attention"  # full attention: one cell per position, any prefix is a valid state
    WINDOW = "window"  # sliding-window attention: only the last window of cells
    RECURRENT = "recurrent"  # one state at the last position


_SECTIONS_OF = {
    MemoryKind.FULL: (SectionKind.ATTENTION,),
    MemoryKind.SWA: (SectionKind.ATTENTION, SectionKind.WINDOW),
    MemoryKind.RECURRENT: (SectionKind.RECURRENT,),
    MemoryKind.HYBRID: (SectionKind.ATTENTION, SectionKind.RECURRENT),
}


@dataclass(frozen=True)
class StateSpec:
    """What the caller knows of the model from llama.cpp: its memories in order, and the per-cell extra bytes."""

    sections: tuple[SectionKind, ...]
    cell_ext: int = 0

    def __post_init__(self) -> None:
        kinds = self.sections
        if not kinds or kinds.count(SectionKind.ATTENTION) > 1:
            raise ValueError("a state has one or more sections, at most one of them full attention")
        if SectionKind.RECURRENT in kinds[:-1] or kinds.count(SectionKind.RECURRENT) > 1:
            raise ValueError("a recurrent section can only be the last one")
        if self.cell_ext not in (0, MROPE_CELL_EXT):
            raise ValueError(f"cell_ext is 0 or {MROPE_CELL_EXT} (M-RoPE), not {self.cell_ext}")

    @classmethod
    def for_memory(cls, kind: MemoryKind, mrope: bool = False) -> StateSpec:
        return cls(_SECTIONS_OF[MemoryKind(kind)], MROPE_CELL_EXT if mrope else 0)


@dataclass(frozen=True)
class LayerShape:
    """One layer's bytes per cell: K, and V (rows, or `v_row // v_el` channels of `v_el` bytes when transposed)."""

    k_type: int
    k_row: int
    v_type: int
    v_row: int
    v_el: int = 0


@dataclass(frozen=True)
class KvShape:
    """Everything of a KV section that does not depend on which cells or sequence it holds."""

    n_stream: int
    v_trans: bool
    cell_ext: int
    layers: tuple[LayerShape, ...]

    @property
    def meta_bytes(self) -> int:
        """Bytes of one cell's metadata: pos, n_seq_id, the M-RoPE extra, seq_id."""
        return 12 + self.cell_ext

    @property
    def kv_bytes(self) -> int:
        """Bytes of one cell's K and V, all layers."""
        return sum(layer.k_row + layer.v_row for layer in self.layers)

    @property
    def cell_bytes(self) -> int:
        """Bytes one cell adds to a chunk payload: its M-RoPE extra, then its K and V."""
        return self.cell_ext + self.kv_bytes

    def section_size(self, cells: int) -> int:
        """Bytes of a section of this shape holding `cells` cells of one sequence."""
        counts = 4 + 4 * self.n_stream
        if cells == 0:
            return counts
        return counts + 8 + 24 * len(self.layers) + cells * (self.meta_bytes + self.kv_bytes)


@dataclass(frozen=True)
class RecurrentShape:
    """A recurrent section's tensors: `layers` of its n_layer layers write one R and one S row per cell, each of
    one type and size for the whole model."""

    n_layer: int
    layers: int
    r_type: int
    r_row: int
    s_type: int
    s_row: int


@dataclass(frozen=True)
class StateShape:
    """Everything of a model's states that does not depend on the cells held, section by section: learned from
    one real state at load, then held against every state read or assembled."""

    spec: StateSpec
    sections: tuple[KvShape | RecurrentShape, ...]

    @property
    def kv(self) -> KvShape | None:
        """The full-attention section's shape, None when the model has none."""
        kinds = self.spec.sections
        return self.sections[kinds.index(SectionKind.ATTENTION)] if SectionKind.ATTENTION in kinds else None


@dataclass(frozen=True)
class KvLayer:
    """Where one layer's rows are: K row i at k_offset + i*k_row; V row i at v_offset + i*v_row, or, when
    transposed, channel j's run of cell_count elements at v_offset + j*cell_count*v_el."""

    shape: LayerShape
    k_offset: int
    v_offset: int


@dataclass(frozen=True)
class KvStream:
    index: int
    cell_count: int
    meta_offset: int
    positions: np.ndarray  # int32, in storage order (a view into the state)
    layers: tuple[KvLayer, ...]


@dataclass(frozen=True)
class KvSection:
    kind: SectionKind
    start: int
    end: int
    seq_id: int
    shape: KvShape | None  # None when no stream holds a cell (nothing past the cell counts is written)
    streams: tuple[KvStream, ...]

    @property
    def cells(self) -> KvStream | None:
        """The stream that holds the sequence's cells, if any."""
        return next((s for s in self.streams if s.cell_count), None)


@dataclass(frozen=True)
class Record:
    """One recurrent tensor's rows: `cell_count` rows of `row_size` bytes at `offset`."""

    type: int
    row_size: int
    offset: int


@dataclass(frozen=True)
class RecurrentSection:
    kind: SectionKind
    start: int
    end: int
    cell_count: int
    positions: np.ndarray
    n_layer: int
    records: tuple[Record, ...]

    @property
    def shape(self) -> RecurrentShape:
        r, s = self.records[0], self.records[-1]
        return RecurrentShape(self.n_layer, len(self.records) // 2, r.type, r.row_size, s.type, s.row_size)


Section = KvSection | RecurrentSection


@dataclass(frozen=True)
class StateLayout:
    """A parsed state: offsets and views into `buf`, which it keeps; nothing is copied."""

    buf: memoryview
    spec: StateSpec
    seq_id: int
    sections: tuple[Section, ...]

    @property
    def attention(self) -> KvSection | None:
        """The full-attention section, the one that can be cut by position."""
        return next((s for s in self.sections if s.kind is SectionKind.ATTENTION), None)

    @property
    def shape(self) -> StateShape:
        """This state's shape, to hold other states of the same model against."""
        shapes = tuple(s.shape for s in self.sections)
        if None in shapes:
            raise StateFormatError("a KV section without cells has no shape (no layers are written)")
        return StateShape(self.spec, shapes)

    def section_bytes(self, index: int) -> memoryview:
        """A section's bytes as they lie in the state, to carry whole."""
        section = self.sections[index]
        return self.buf[section.start : section.end]


@dataclass(frozen=True)
class Pieces:
    """A state taken apart: whole blocks and a shorter tail of attention cells (by position), and the other
    sections as views into the state, each exactly as long as its section."""

    shape: StateShape
    blocks: list[bytearray]
    tail: bytearray
    opaque: list[memoryview]


class Reader:
    """Reads fixed fields forward through buf[..end], never past it."""

    def __init__(self, buf: memoryview, off: int, end: int) -> None:
        self.buf, self.off, self.end = buf, off, end

    def fail(self, why: str) -> StateFormatError:
        return StateFormatError(f"unknown llama.cpp sequence-state layout: {why} (at byte {self.off})")

    def skip(self, n: int, what: str) -> int:
        """Steps over n bytes; returns where they start."""
        if n < 0 or n > self.end - self.off:
            raise self.fail(f"{what} needs {n} bytes, {self.end - self.off} left")
        start, self.off = self.off, self.off + n
        return start

    def read(self, fmt: struct.Struct, what: str) -> tuple:
        return fmt.unpack_from(self.buf, self.skip(fmt.size, what))

    def u32(self, what: str) -> int:
        return self.read(U32, what)[0]

    def count(self, what: str, least_bytes_each: int) -> int:
        """A u32 count, refused when that many items could not fit in the bytes left."""
        n = self.u32(what)
        if n * least_bytes_each > self.end - self.off:
            raise self.fail(f"{what} {n} cannot fit in the {self.end - self.off} bytes left")
        return n


def int32s(buf: memoryview, off: int, count: int, stride: int) -> np.ndarray:
    """Every stride-th int32 from off: a view (numpy refuses an empty one at the buffer's end)."""
    if count == 0:
        return np.zeros(0, np.int32)
    return np.ndarray((count,), "<i4", buf, off, (stride,))


def _row_bytes(r: Reader, what: str, type_id: int, size: int, plain: bool = False) -> None:
    block = GGML_BLOCK_BYTES.get(type_id)
    if block is None or (plain and type_id not in GGML_PLAIN_TYPES):
        raise r.fail(f"{what} has ggml type {type_id}, not one a cache can hold here")
    if size < 0 or size % block or (plain and size != block):
        raise r.fail(f"{what} of {size} bytes does not fit ggml type {type_id}")


def parse(buf: Buffer, expect: StateSpec | StateShape) -> StateLayout:
    """Reads a whole state; raises StateFormatError unless every byte is accounted for exactly and, given the
    model's shape, every section has it (a recurrent section is only bounded by the state's end, so a state
    cut or extended by whole recurrent tensors is caught by its shape alone)."""
    spec = expect.spec if isinstance(expect, StateShape) else expect
    try:
        view = memoryview(buf).cast("B")
    except TypeError as e:
        raise StateFormatError(f"a state must be one contiguous buffer: {e}") from e
    r = Reader(view, 0, len(view))
    magic, seq_id = r.read(HEADER, "header")
    if magic != MAGIC:
        raise r.fail(f"magic {magic:#010x}, expected {MAGIC:#010x}")
    if not 0 <= seq_id < MAX_SEQ:
        raise r.fail(f"seq_id {seq_id}")
    sections: list[Section] = []
    for i, kind in enumerate(spec.sections):
        if kind is SectionKind.RECURRENT:
            sections.append(parse_recurrent(r))
        else:
            sections.append(parse_kv(r, kind, seq_id, spec.cell_ext))
        if isinstance(expect, StateShape):
            expect_shape(sections[-1], expect.sections[i])
    if r.off != r.end:
        raise r.fail(f"{r.end - r.off} bytes after the last section")
    return StateLayout(view, spec, seq_id, tuple(sections))


def expect_shape(section: Section, want: KvShape | RecurrentShape) -> None:
    got = section.shape
    if got is None or got == want:
        return
    differ = [f.name for f in fields(want) if getattr(got, f.name) != getattr(want, f.name)]
    raise StateFormatError(f"the {section.kind} section at byte {section.start} is not of the model's shape "
                           f"(its {', '.join(differ)} differ)")


def parse_kv(r: Reader, kind: SectionKind, seq_id: int | None, cell_ext: int) -> KvSection:
    """A KV section of sequence `seq_id` (None: whichever its cells name, for a section carried alone)."""
    start = r.off
    n_stream = r.count("n_stream", 4)
    if not 1 <= n_stream <= MAX_SEQ:
        raise r.fail(f"n_stream {n_stream}")
    streams: list[KvStream] = []
    shape: KvShape | None = None
    for index in range(n_stream):
        cell_count = r.count("cell_count", 12 + cell_ext)
        if cell_count == 0:
            streams.append(KvStream(index, 0, r.off, np.zeros(0, np.int32), ()))
            continue
        if shape is not None:
            raise r.fail("a second stream holds cells of the sequence")
        meta_offset = r.skip(cell_count * (12 + cell_ext), "cell metadata")
        seq_id = _check_cells(r, meta_offset, cell_count, cell_ext, seq_id)
        if n_stream > 1 and index != seq_id:
            raise r.fail(f"cells of sequence {seq_id} in stream {index}")
        stream, shape = _parse_layers(r, index, cell_count, meta_offset, n_stream, cell_ext)
        streams.append(stream)
    return KvSection(kind, start, r.off, -1 if seq_id is None else seq_id, shape, tuple(streams))


def _check_cells(r: Reader, off: int, count: int, cell_ext: int, seq_id: int | None) -> int:
    """Every cell of a sequence's state names that one sequence; returns it."""
    stride = 12 + cell_ext
    n_seq = int32s(r.buf, off + 4, count, stride)
    seqs = int32s(r.buf, off + 8 + cell_ext, count, stride)
    if seq_id is None:
        seq_id = int(seqs[0])
    if not (n_seq == 1).all() or not (seqs == seq_id).all() or not 0 <= seq_id < MAX_SEQ:
        raise r.fail(f"cells that do not each belong to sequence {seq_id} alone")
    return seq_id


def _parse_layers(
    r: Reader, index: int, cells: int, meta_offset: int, n_stream: int, cell_ext: int
) -> tuple[KvStream, KvShape]:
    v_trans, n_layer = r.read(TWO_U32, "v_trans, n_layer")
    if v_trans > 1 or not 1 <= n_layer <= (r.end - r.off) // 24:
        raise r.fail(f"v_trans {v_trans}, n_layer {n_layer}")
    k_parts = []
    for il in range(n_layer):
        k_type, k_row = r.read(ROWS_HEAD, "K header")
        _row_bytes(r, f"layer {il} K rows", k_type, k_row)
        k_parts.append((k_type, k_row, r.skip(cells * k_row, "K rows")))
    layers = []
    for il, (k_type, k_row, k_offset) in enumerate(k_parts):
        if v_trans:
            v_type, v_el, n_embd = r.read(RUNS_HEAD, "V header")
            _row_bytes(r, f"layer {il} V elements", v_type, v_el, plain=True)
            shape = LayerShape(k_type, k_row, v_type, v_el * n_embd, v_el)
        else:
            v_type, v_row = r.read(ROWS_HEAD, "V header")
            _row_bytes(r, f"layer {il} V rows", v_type, v_row)
            shape = LayerShape(k_type, k_row, v_type, v_row)
        if shape.k_row == 0 or shape.v_row == 0:
            raise r.fail(f"layer {il} has empty rows")
        layers.append(KvLayer(shape, k_offset, r.skip(cells * shape.v_row, "V rows")))
    positions = int32s(r.buf, meta_offset, cells, 12 + cell_ext)
    kv = KvShape(n_stream, bool(v_trans), cell_ext, tuple(layer.shape for layer in layers))
    return KvStream(index, cells, meta_offset, positions, tuple(layers)), kv


def parse_recurrent(r: Reader) -> RecurrentSection:
    """The recurrent section runs to the end of the state: records are counted by the bytes, since layers
    without recurrent tensors (the attention layers of a hybrid) are skipped and not announced. R and S rows
    have one size each for the whole model: bytes appended after the section pass for layers only if they
    repeat those shapes exactly, and the model's shape refuses them then."""
    start = r.off
    cell_count = r.count("recurrent cell_count", 8)
    meta = r.skip(8 * cell_count, "recurrent cell metadata")
    if not (int32s(r.buf, meta + 4, cell_count, 8) == 0).all():
        raise r.fail("recurrent cells that name sequences (a whole-context state, not one sequence's)")
    s_trans, n_layer = r.read(TWO_U32, "s_trans, n_layer")
    if s_trans != 0 or n_layer == 0:
        raise r.fail(f"s_trans {s_trans}, n_layer {n_layer}")
    records = []
    while r.off < r.end:
        type_id, row_size = r.read(ROWS_HEAD, "recurrent tensor header")
        _row_bytes(r, f"recurrent tensor {len(records)}", type_id, row_size)
        records.append(Record(type_id, row_size, r.skip(cell_count * row_size, "recurrent rows")))
    half = len(records) // 2
    if not records or len(records) % 2 or half > n_layer:
        raise r.fail(f"{len(records)} recurrent tensors for {n_layer} layers (R and S of each)")
    r_shapes = {(x.type, x.row_size) for x in records[:half]}
    s_shapes = {(x.type, x.row_size) for x in records[half:]}
    if len(r_shapes) != 1 or len(s_shapes) != 1 or records[0].row_size == 0:
        raise r.fail("recurrent tensors that are not one R shape then one S shape (both are model-wide)")
    positions = int32s(r.buf, meta, cell_count, 8)
    return RecurrentSection(SectionKind.RECURRENT, start, r.off, cell_count, positions, n_layer, tuple(records))


def shape_to_json(shape: StateShape) -> dict:
    """A shape as plain JSON values, so a stored row can be assembled without the model loaded."""
    def one(s: KvShape | RecurrentShape) -> list:
        if isinstance(s, KvShape):
            return ["kv", s.n_stream, int(s.v_trans), s.cell_ext, [list(astuple(layer)) for layer in s.layers]]
        return ["recurrent", *astuple(s)]

    return {"sections": [str(k) for k in shape.spec.sections], "cell_ext": shape.spec.cell_ext,
            "shapes": [one(s) for s in shape.sections]}


def shape_from_json(data: object) -> StateShape:
    """The shape `shape_to_json` wrote; StateFormatError for anything else."""
    try:
        spec = StateSpec(tuple(SectionKind(k) for k in data["sections"]), int(data["cell_ext"]))
        shapes: list[KvShape | RecurrentShape] = []
        for s in data["shapes"]:
            if s[0] == "kv":
                layers = tuple(LayerShape(*(int(x) for x in layer)) for layer in s[4])
                shapes.append(KvShape(int(s[1]), bool(s[2]), int(s[3]), layers))
            elif s[0] == "recurrent":
                shapes.append(RecurrentShape(*(int(x) for x in s[1:7])))
            else:
                raise ValueError(f"unknown section shape {s[0]!r}")
        kinds_match = all(isinstance(x, KvShape) == (k is not SectionKind.RECURRENT)
                          for k, x in zip(spec.sections, shapes, strict=True))
        if not kinds_match:
            raise ValueError("section shapes do not match the section kinds")
        return StateShape(spec, tuple(shapes))
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise StateFormatError(f"unreadable state shape: {e}") from None

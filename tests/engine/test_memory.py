"""The memory rules alone: pure, so each fact they rest on is one line here (the engine over the fake and the
real models prove them in tests/engine/test_memory_kinds.py and tests/test_cache_paths.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from barreld.engine.memory import Memory, memory_kind
from barreld.engine.model_cache import ModelCache
from barreld.engine.policy import Policy
from barreld.names import MemoryKind

FULL = Memory(MemoryKind.FULL, chunk=64)
SWA = Memory(MemoryKind.SWA, window=512, swa_full=True, chunk=64)
RING = Memory(MemoryKind.SWA, window=512, swa_full=False, chunk=64)
RECURRENT = Memory(MemoryKind.RECURRENT, chunk=64)
HYBRID = Memory(MemoryKind.HYBRID, chunk=64)


def test_the_kind_comes_from_llama_cpps_flags() -> None:
    assert memory_kind(0, False, False) is MemoryKind.FULL
    assert memory_kind(512, False, False) is MemoryKind.SWA
    assert memory_kind(0, True, False) is MemoryKind.RECURRENT
    assert memory_kind(0, True, True) is MemoryKind.HYBRID and memory_kind(4096, False, True) is MemoryKind.HYBRID
    with pytest.raises(ValueError):
        Memory(MemoryKind.FULL, window=512)
    with pytest.raises(ValueError):
        Memory(MemoryKind.SWA)
    with pytest.raises(ValueError):
        Memory(MemoryKind.FULL, chunk=0)


def test_a_reuse_point_is_a_chunk_boundary_or_the_whole_prompt_with_its_logits() -> None:
    assert FULL.aligned(700, 800, 800, None) == 640
    assert FULL.aligned(900, 700, 800, None) == 640  # as far as the prompt matches
    assert FULL.aligned(800, 800, 800, 800) == 800  # samples from the stored logits, no prefill
    assert FULL.aligned(800, 800, 800, None) == 768  # the last chunk again: its last row gives the logits
    assert FULL.aligned(800, 800, 800, 640) == 768  # logits of another position are no use
    assert FULL.aligned(64, 64, 64, None) == 0
    # a prompt whose last chunk was one token, found in a state that grew past it: that token was prefilled again
    # in a full batch, so the state cut there is not the prompt's own, whatever logits were kept
    assert FULL.aligned(1100, 961, 961, 961) == 960 and FULL.aligned(961, 961, 961, 961) == 961
    # ... nor is a cut off the grain: the tokens after its last reuse point were computed in a later batch
    assert FULL.aligned(1100, 962, 962, 962) == 960
    assert Memory(MemoryKind.FULL, grain=1).aligned(1100, 962, 962, 962) == 962
    assert Memory(MemoryKind.FULL, grain=4, min_batch=8).aligned(1100, 972, 972, 972) == 972
    assert Memory(MemoryKind.FULL, grain=4, min_batch=8).aligned(1100, 970, 970, 970) == 960


FINE = Memory(MemoryKind.FULL, chunk=64, grain=1)
BY4 = Memory(MemoryKind.FULL, chunk=64, grain=4)


def test_a_finer_grain_reuses_more_and_never_leaves_a_token_to_be_prefilled_alone() -> None:
    assert FINE.aligned(700, 800, 800, None) == 700 and BY4.aligned(703, 800, 800, None) == 700
    assert FINE.aligned(800, 800, 800, None) == 798  # 799 would prefill token 799 alone; cold runs 768..799
    assert FINE.aligned(800, 800, 801, None) == 799  # 799..800 is a batch of two
    assert FINE.aligned(830, 900, 900, None) == 830 and FINE.aligned(831, 900, 900, None) == 830  # 831: alone
    assert FINE.aligned(832, 900, 900, None) == 832  # a chunk boundary: the cold run splits there too
    assert FINE.aligned(769, 900, 900, None) == 768  # token 768 was its prompt's last, prefilled alone
    assert BY4.aligned(769, 900, 900, None) == 768
    assert FINE.aligned(1, 900, 900, None) == 0 and FINE.aligned(2, 900, 900, None) == 2
    with pytest.raises(ValueError, match="divide"):
        Memory(MemoryKind.FULL, chunk=64, grain=3)


TILED = Memory(MemoryKind.FULL, chunk=128, grain=1, min_batch=64)  # flash attention on the CPU


def test_a_fewest_batch_keeps_every_warm_batch_on_the_full_chunks_kernels() -> None:
    assert TILED.aligned(1000, 1000, 1100, None) == 960  # 961..1023 would be a batch of 63: the chunk start
    assert TILED.aligned(1000, 950, 1100, None) == 950 and TILED.aligned(1000, 961, 1100, None) == 960
    assert TILED.aligned(1100, 1100, 1100, None) == 1036  # the prompt's end: 1036..1099 is a batch of 64
    assert TILED.extendable(1000) == 1000 and TILED.extendable(1023) == 1023  # last chunks of 104, 127 tokens
    assert TILED.extendable(960) == 960 and TILED.extendable(930) == 896  # last chunks of 64 and 34 tokens
    assert TILED.aligned(930, 930, 1100, None) == 896  # its last 34 were a small batch: not reused
    assert FINE.extendable(769) == 768 == Memory(MemoryKind.FULL, chunk=64, grain=1, min_batch=2).extendable(769)
    with pytest.raises(ValueError, match="at least 2"):
        Memory(MemoryKind.FULL, chunk=64, grain=1, min_batch=1)


SPANNING = dataclasses.replace(TILED, spans=True)  # and every call holds 64 tokens at least


def test_with_spans_a_state_is_reusable_to_its_end_and_a_warm_start_leaves_min_batch_to_the_prompt_end() -> None:
    assert SPANNING.extendable(930) == 930 and SPANNING.extendable(897) == 897  # short last chunks joined a call
    assert SPANNING.extendable(63) == 0 and SPANNING.extendable(64) == 64  # a prompt's only call held 63
    assert SPANNING.aligned(1000, 1000, 1100, None) == 1000  # 1000..1099: one call of 100, over 1024
    assert SPANNING.aligned(1050, 1050, 1100, None) == 1036 and SPANNING.aligned(1100, 1100, 1100, 1100) == 1100
    assert SPANNING.aligned(930, 930, 1100, None) == 930 and TILED.aligned(930, 930, 1100, None) == 896
    assert SPANNING.aligned(1024, 1024, 1050, None) == 986  # a chunk boundary too: 1024..1049 alone is short
    assert SPANNING.aligned(100, 100, 120, None) == 56 and SPANNING.aligned(100, 100, 60, None) == 0
    assert SPANNING.reusable(64, False) and not SPANNING.reusable(63, False) and SPANNING.reusable(63, True)
    assert SPANNING.ends_call_at(1024, 960, 1100) and not SPANNING.ends_call_at(1024, 1000, 1200)
    assert not SPANNING.ends_call_at(1024, 896, 1050) and TILED.ends_call_at(1024, 1000, 1050)


def test_the_grain_is_the_chunk_unless_a_finer_one_is_given() -> None:
    assert FULL.grain == 64 and FULL.summary == "restores and cuts at any chunk boundary"
    assert FINE.summary == "restores and cuts at any token" and "multiple of 4 tokens" in BY4.summary
    fine_recurrent = Memory(MemoryKind.RECURRENT, chunk=64, grain=1)
    assert fine_recurrent.snapshot_point(700, 0) == 700 and RECURRENT.snapshot_point(700, 0) == 640
    assert fine_recurrent.snapshot_point(639, 0) == 637  # 638..639 would be a batch of one: two before
    assert fine_recurrent.restore_point(700, 700, 800, None) == 700 and fine_recurrent.reusable(650, False)


def test_a_ring_keeps_its_prompt_at_the_last_multiple_of_its_grain_that_leaves_min_batch_tokens() -> None:
    """Gemma 3's verdict on a ring (a grain of 16, batches of 8): a Claude Code call of 13,005 tokens keeps
    its state 13 short of its end where the chunk rule kept it 77 short; 13,272 keeps 8 short, the fewest."""
    ring = Memory(MemoryKind.SWA, window=512, chunk=128, grain=16, min_batch=8)
    coarse = Memory(MemoryKind.SWA, window=512, chunk=128)
    assert ring.snapshot_point(13_005, 0) == 12_992 and coarse.snapshot_point(13_005, 0) == 12_928
    assert ring.snapshot_point(13_272, 0) == 13_264 and ring.snapshot_point(13_270, 0) == 13_248
    assert ring.snapshot_point(13_196, 0) == 13_184  # the chunk boundary is the last point below
    assert ring.snapshot_point(13_264, 13_264) == 13_264 == ring.restore_point(13_264, 13_264, 13_300, None)
    assert ring.restore_point(13_256, 13_256, 13_300, None) == 0  # off the grain: not this state


@pytest.mark.parametrize(
    ("memory", "length", "matched", "n", "logits_at", "expected"),
    [
        (FULL, 1000, 1000, 1200, 1000, 960),  # cut back to a chunk boundary
        (FULL, 1000, 700, 1200, 1000, 640),  # as far as the prompt shares it
        (FULL, 1000, 1000, 1000, 1000, 1000),  # the whole prompt, its logits stored
        (SWA, 1024, 1024, 1200, None, 1024),  # at its own length
        (SWA, 1024, 1000, 1200, None, 0),  # the prompt leaves it earlier: a window state cannot be cut
        (SWA, 1000, 1000, 1200, 1000, 0),  # not a chunk boundary, and not the whole prompt
        (SWA, 1000, 1000, 1000, 1000, 1000),  # the whole prompt with its logits
        (SWA, 1000, 1000, 1000, None, 0),  # ... without them there is nothing to sample from
        (RING, 1024, 1024, 1200, None, 1024),  # past the window too: a ring's prefill leaves it in order
        (RING, 512, 512, 1200, None, 512),
        (RECURRENT, 256, 256, 300, None, 256),
        (RECURRENT, 256, 255, 300, None, 0),
        (HYBRID, 320, 320, 320, 320, 320),
        (HYBRID, 256, 256, 256, None, 0),
    ],
)
def test_restore_points(
    memory: Memory, length: int, matched: int, n: int, logits_at: int | None, expected: int
) -> None:
    assert memory.restore_point(length, matched, n, logits_at) == expected


def test_live_points_cut_full_and_window_memories_and_take_recurrent_ones_whole() -> None:
    assert FULL.live_point(held=1012, frontier=1000, matched=1012, n=1100, logits_at=1000) == 960
    assert SWA.live_point(1012, 1000, 1012, 1100, 1000) == 960
    assert RECURRENT.live_point(1012, 1000, 1012, 1100, 1000) == 0  # generated tokens: not its own length
    assert RECURRENT.live_point(1024, 1024, 1024, 1100, 1024) == 1024


def test_a_window_is_cut_live_only_while_it_still_holds_the_cells_below_the_cut() -> None:
    """llama.cpp's lowest position: a cut to 960 needs 448..959 in the window."""
    assert SWA.live_point(1012, 1000, 1012, 1100, 1000, pos_min=448) == 960
    assert SWA.live_point(1012, 1000, 1012, 1100, 1000, pos_min=449) == 0
    assert RING.live_point(1012, 1000, 1012, 1100, 1000, pos_min=1) == 0
    assert RING.live_point(1012, 1000, 1012, 1100, 1000, pos_min=0) == 0  # a ring is never cut
    assert FULL.live_point(1012, 1000, 1012, 1100, 1000, pos_min=449) == 960  # only a window drops cells


@pytest.mark.parametrize(
    ("memory", "k", "pos", "holds"),
    [
        (FULL, 640, (0, 639), True),
        (FULL, 640, (1, 639), False),
        (FULL, 640, (0, 700), False),  # a cut that did not happen
        (SWA, 1024, (512, 1023), True),  # a restored state: its last window
        (SWA, 640, (512, 639), False),  # ... cut: positions 128..511 are gone, though seq_rm said yes
        (SWA, 640, (0, 639), True),
        (RING, 896, (384, 895), True),  # a restored state: its last window
        (RING, 896, (385, 895), False),
        (RECURRENT, 256, (255, 255), True),
        (HYBRID, 128, (255, 255), False),  # seq_rm refused: the state is still at 256
        (FULL, 0, (-1, -1), True),
    ],
)
def test_holds_reads_llama_cpps_account_of_the_positions(
    memory: Memory, k: int, pos: tuple[int, int], holds: bool
) -> None:
    assert memory.holds(k, *pos) is holds


def test_snapshots_and_indexing_for_memories_that_cannot_be_cut() -> None:
    assert FULL.snapshot_point(700, 0) == 0  # a full state is cut when it is saved instead
    assert SWA.snapshot_point(700, 0) == 640 and SWA.snapshot_point(700, 700) == 700
    assert RING.snapshot_point(700, 0) == 640 and RING.snapshot_point(500, 0) == 448
    assert FULL.indexed_at(512, 700) and not FULL.indexed_at(768, 700)
    assert RECURRENT.indexed_at(768, 640) and not RECURRENT.indexed_at(512, 640)
    assert RECURRENT.reusable(640, False) and not RECURRENT.reusable(650, False) and RECURRENT.reusable(650, True)
    assert RING.reusable(640, True) and FULL.reusable(10, True) and not FULL.reusable(10, False)


@given(
    st.sampled_from([FULL, SWA, RING, RECURRENT, HYBRID]),
    st.integers(0, 4096),
    st.integers(0, 4096),
    st.integers(1, 4096),
    st.booleans(),
)
def test_every_restore_point_is_one_the_cold_prefill_also_reaches(
    memory: Memory, length: int, matched: int, n: int, logits: bool
) -> None:
    k = memory.restore_point(length, matched, n, length if logits else None)
    assert 0 <= k <= min(length, matched, n)
    assert k % memory.chunk == 0 or (k == n == length and logits)
    assert k == 0 or memory.cuts_states or k == length


def boundary_cache(memory: Memory, gap: int | str = 8, align: int = 16) -> ModelCache:
    policy = Policy(min_tokens=8, boundary_align_tokens=align, snapshot_gap_tokens=gap)
    return ModelCache(object(), None, "m", "disk", policy, lambda seq: bytearray(), memory=memory)  # type: ignore[arg-type]


def test_boundary_snapshots_land_on_chunk_boundaries_below_message_ends_spaced_by_the_gap() -> None:
    recurrent = Memory(MemoryKind.RECURRENT, chunk=8, grain=1)
    cache = boundary_cache(recurrent)
    # message ends at 13, 19, 21, 37, 49; the prompt's own end is snapshotted anyway (at 50, its last token)
    assert cache.boundary_points(50, 0, [13, 19, 21, 37, 49]) == {8, 16, 32, 48}
    assert cache.boundary_points(50, 16, [13, 19, 21, 37]) == {32}  # nothing at or below what was restored
    # snapshots a gap of two chunks apart are dear: none in the prompt's last chunk
    assert boundary_cache(recurrent, gap=16).boundary_points(50, 0, [13, 19, 21, 37, 49]) == {16, 32}
    assert boundary_cache(recurrent).boundary_points(50, 0, []) == {16, 32, 48}  # a raw prompt: the alignment
    assert boundary_cache(recurrent, gap="auto").snapshot_gap == 8  # a recurrent state: a chunk
    assert boundary_cache(Memory(MemoryKind.SWA, window=24, chunk=4), gap="auto").snapshot_gap == 12
    assert boundary_cache(recurrent, gap="infinity").boundary_points(50, 0, [13, 37]) == frozenset()
    assert boundary_cache(Memory(MemoryKind.FULL, chunk=8)).boundary_points(50, 0, [13, 37]) == frozenset()
    ring = Memory(MemoryKind.SWA, window=24, chunk=8)  # without swa_full: past the window too, the gap apart
    assert boundary_cache(ring).boundary_points(50, 0, [13, 37]) == {8, 32}
    # prefix lookups walk every chunk boundary where snapshots may lie, the alignment otherwise
    assert cache.prefix_points(40) == [32, 24, 16, 8]
    assert boundary_cache(recurrent, gap="infinity").prefix_points(40) == [32, 16]

"""Pure engine helpers: prefill chunk planning, byte offsets, stop-string scanning, sampling."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from barreld.engine.plan import byte_offsets, common_prefix_len, next_chunk, tokens_within
from barreld.engine.sampling import Sampler
from barreld.engine.stops import StopScanner


@given(st.integers(0, 5000), st.integers(1, 3000), st.integers(3, 600))
def test_chunks_cover_the_span_and_are_never_one_token(start: int, length: int, cap: int) -> None:
    pos, end, sizes = start, start + length, []
    while pos < end:
        size = next_chunk(pos, end, cap)
        assert size > 0
        sizes.append(size)
        pos += size
    assert pos == end
    assert all(s <= cap or s == length for s in sizes[:1]) and all(s <= cap for s in sizes[1:])
    assert length == 1 or 1 not in sizes


def test_a_cap_too_small_to_avoid_a_one_token_tail_waits() -> None:
    assert next_chunk(0, 3, 2) == 0       # 2 now would leave 1
    assert next_chunk(0, 10, 9) == 8      # leave 2, not 1
    assert next_chunk(5, 5, 100) == 0


@given(st.lists(st.binary(max_size=6), max_size=40), st.binary(max_size=300))
def test_offsets_and_prefix_lengths_agree(pieces: list[bytes], other: bytes) -> None:
    offsets = byte_offsets(pieces)
    rendered = b"".join(pieces)
    assert offsets[-1] == len(rendered)
    n = common_prefix_len(rendered, other)
    assert rendered[:n] == other[:n] and (n == min(len(rendered), len(other)) or rendered[n] != other[n])
    k = tokens_within(offsets, n)
    assert offsets[k] <= n and (k == len(pieces) or offsets[k + 1] > n)


@given(st.lists(st.binary(min_size=1, max_size=4), max_size=30), st.binary(min_size=1, max_size=5))
def test_stop_scanner_never_streams_part_of_a_stop_string(pieces: list[bytes], stop: bytes) -> None:
    scanner = StopScanner([stop])
    streamed = b"".join(scanner.feed(p) for p in pieces)
    if not scanner.stopped:
        streamed += scanner.flush()
    whole = b"".join(pieces)
    cut = whole.find(stop)
    assert streamed == (whole if cut < 0 else whole[:cut])
    assert scanner.text == streamed


def test_greedy_and_seeded_sampling() -> None:
    logits = np.array([0.1, 3.0, 0.2, 2.9], dtype=np.float32)
    assert Sampler(0.0, None).sample(logits) == 1
    s1, s2 = Sampler(1.0, 42), Sampler(1.0, 42)
    assert [s1.sample(logits) for _ in range(20)] == [s2.sample(logits) for _ in range(20)]
    draws = Sampler(1.0, 7)
    assert {1, 3} <= {draws.sample(logits) for _ in range(200)}  # both likely tokens are drawn

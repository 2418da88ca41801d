"""Pure engine helpers: prefill chunks, byte offsets, token prefixes, stop-string scanning, sampling."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from barreld.engine.plan import byte_offsets, chunk_end, common_prefix_len
from barreld.engine.sampling import Sampler
from barreld.engine.stops import StopScanner


@given(st.integers(0, 5000), st.integers(1, 3000), st.integers(1, 600))
def test_chunks_from_a_boundary_cover_the_span_and_end_on_multiples(start: int, length: int, chunk: int) -> None:
    pos, end, ends = start // chunk * chunk, start + length, []
    while pos < end:
        pos = chunk_end(pos, end, chunk)
        ends.append(pos)
    assert pos == end and all(e % chunk == 0 for e in ends[:-1])


@given(st.lists(st.binary(max_size=6), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_offsets_and_prefix_lengths_agree(pieces: list[bytes], other: list[int]) -> None:
    offsets = byte_offsets(pieces)
    assert offsets[-1] == len(b"".join(pieces)) and offsets == sorted(offsets)
    tokens = [len(p) % 4 for p in pieces]
    n = common_prefix_len(tokens, other)
    assert tokens[:n] == other[:n] and (n == min(len(tokens), len(other)) or tokens[n] != other[n])


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

"""Pure engine helpers: prefill chunks, byte offsets, token prefixes, stop-string scanning, sampling (llama.cpp's
chain over made-up logits), the sampler's bounds, and the integer ranges a JSON schema's bounds become."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from barreld.engine.grammar import int_range, schema_grammar
from barreld.engine.plan import byte_offsets, chunk_end, common_prefix_len
from barreld.engine.sampler import Sampler, logprobs
from barreld.engine.sampling import SamplingParams
from barreld.engine.stops import StopScanner
from barreld.errors import InvalidArgument


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


@given(st.lists(st.binary(min_size=1, max_size=4), max_size=30), st.binary(min_size=1, max_size=5))
def test_a_turn_end_stops_only_text_that_holds_more_than_whitespace(pieces: list[bytes], end: bytes) -> None:
    scanner = StopScanner([], [end])
    streamed = b"".join(scanner.feed(p) for p in pieces)
    if not scanner.stopped:
        streamed += scanner.flush()
    whole = b"".join(pieces)
    cut = next((i for i in range(len(whole)) if whole.startswith(end, i) and whole[:i].strip()), -1)
    assert streamed == (whole if cut < 0 else whole[:cut]) and scanner.text == streamed
    assert not scanner.stopped or scanner.matched == end


def test_a_turn_end_at_the_start_of_a_reply_is_passed_over() -> None:
    scanner = StopScanner([], [b"\nUser:"])
    assert scanner.feed(b"\nUser:") + scanner.feed(b" Hi") + scanner.feed(b"\nUser:") == b"\nUser: Hi"
    assert scanner.stopped and scanner.text == b"\nUser: Hi"


def sampler(n_vocab: int = 4, **params: object) -> Sampler:
    return Sampler(SamplingParams(**params), n_vocab)


def test_greedy_and_seeded_sampling() -> None:
    logits = np.array([0.1, 3.0, 0.2, 2.9], dtype=np.float32)
    assert sampler().sample(logits) == 1
    s1, s2 = sampler(temperature=1.0, seed=42), sampler(temperature=1.0, seed=42)
    assert [s1.sample(logits) for _ in range(20)] == [s2.sample(logits) for _ in range(20)]
    draws = sampler(temperature=1.0, seed=7)
    assert {1, 3} <= {draws.sample(logits) for _ in range(200)}  # both likely tokens are drawn


def test_each_stage_of_the_chain_cuts_what_it_should() -> None:
    logits = np.array([0.1, 3.0, 0.2, 2.9], dtype=np.float32)
    for cut in ({"top_k": 1}, {"top_p": 0.01}, {"min_p": 0.99}):
        s = sampler(temperature=1.0, seed=1, **cut)
        assert {s.sample(logits) for _ in range(100)} == {1}, cut
    banned = sampler(temperature=1.0, seed=1, logit_bias=((1, -100.0),))
    assert 1 not in {banned.sample(logits) for _ in range(200)}
    assert sampler(logit_bias=((2, 100.0),)).sample(logits) == 2
    repeat = sampler(presence_penalty=2.0)
    repeat.history([1])
    assert repeat.sample(logits) == 3  # token 1, just seen, loses 2.0 and falls below token 3
    forgetful = sampler(presence_penalty=2.0, repeat_last_n=0)
    forgetful.history([1])
    assert forgetful.sample(logits) == 1


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = np.array([0.1, 3.0, 0.2, 2.9], dtype=np.float32)
    own, top = logprobs(logits, 2, 2)
    expected = np.log(np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum())
    assert own == pytest.approx(expected[2]) and [t for t, _ in top] == [1, 3]
    assert [lp for _, lp in top] == pytest.approx([expected[1], expected[3]])


@pytest.mark.parametrize(
    "bad",
    [{"top_p": 0}, {"top_p": 1.1}, {"top_k": -1}, {"top_k": 2**32}, {"min_p": 2}, {"typical_p": 0},
     {"repeat_penalty": 0}, {"repeat_last_n": -1}, {"presence_penalty": 2.1}, {"frequency_penalty": float("nan")},
     {"temperature": -1}, {"seed": -1}, {"logit_bias": ((-1, 1.0),)}, {"logit_bias": ((1, 101.0),)}],
)
def test_each_bad_sampling_value_is_named(bad: dict) -> None:
    name = next(iter(bad))
    with pytest.raises(InvalidArgument, match=f"bad {name}"):
        SamplingParams(**bad)


def test_a_token_id_beyond_the_vocabulary_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="bad logit_bias key 4"):
        sampler(logit_bias=((4, 1.0),))


def gbnf_regex(rule: str) -> str:
    """The fragment int_range writes (digit literals, classes, groups, |, *, {m,n}) as a Python regex."""
    return re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), rule).replace(" ", "")


@given(st.integers(-300, 300) | st.none(), st.integers(0, 400), st.integers(-1000, 1000))
def test_integer_ranges_match_exactly_the_integers_in_range(low: int | None, width: int, probe: int) -> None:
    high = None if low is None else low + width
    pattern = re.compile(gbnf_regex(int_range(low, high)))
    for n in (probe, low or 0, high or 0, (low or 0) - 1, (high or 0) + 1, 0, -1, 10**6):
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(pattern.fullmatch(str(n))) == inside, (low, high, n)
    assert not pattern.fullmatch("007") and not pattern.fullmatch("-0")


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "minLength": 5, "maxLength": 2}, "empty range"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "empty range"),
        ({"type": "integer", "minimum": 3, "maximum": 1}, "empty range"),
        ({"type": "string", "pattern": "^a{100000}$"}, "a repetition above 1000"),
        ({"type": "string", "maxLength": 100000}, "at most 1000"),
        ({"type": "number", "maximum": 0.5}, "unsupported bounds"),
        ({"type": "object", "patternProperties": {}}, "'patternProperties'"),
        ({"type": "string", "format": "email"}, "unsupported format"),
        ({"type": "nothing"}, "not a valid JSON Schema"),
        (True, "must be an object"),
    ],
)
def test_a_schema_the_grammar_cannot_enforce_is_refused_by_name(schema: object, words: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(words)):
        schema_grammar(schema)

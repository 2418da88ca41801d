"""The caching specification's policy gates: defaults, parsing of overrides, and the save/probe arithmetic."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from barreld.engine.policy import AUTO, INFINITY, Policy, PolicyError

GUIDE_DEFAULTS = {
    "min_tokens": 512,
    "cold_min_tokens": 512,
    "cold_max_tokens": 30000,
    "continued_interval": 2048,
    "boundary_trim_tokens": 32,
    "boundary_align_tokens": 2048,
    "session_resume_wait_ms": 500,
    "prefill_chunk_size": "auto",
    "evict_save_timeout_ms": 30000,
    "settle_tokens": "infinity",  # settle every reply while idle; reuse at the finest grain proven exact
    "settle_after_ms": 200,
    "snapshot_gap_tokens": "auto",
    "reuse_grain": "auto",
}


def test_defaults_are_the_guides() -> None:
    assert Policy().as_dict() == GUIDE_DEFAULTS


def test_overrides_parse_strings_and_ints() -> None:
    p = Policy().with_overrides(
        {"min_tokens": "256", "boundary_align_tokens": 256, "prefill_chunk_size": " 128 "}
    )
    assert (p.min_tokens, p.boundary_align_tokens, p.prefill_chunk_size) == (256, 256, 128)


@pytest.mark.parametrize("text", ["infinity", "INFINITY", "inf", " Infinity "])
def test_infinity_is_math_inf(text: str) -> None:
    p = Policy().with_overrides({"min_tokens": text, "cold_max_tokens": text, "continued_interval": text})
    assert p.min_tokens == p.cold_max_tokens == p.continued_interval == math.inf


def test_toml_inf_float_is_accepted() -> None:
    assert Policy().with_overrides({"prefill_chunk_size": float("inf")}).prefill_chunk_size == INFINITY


def test_overrides_leave_the_original_alone() -> None:
    base = Policy()
    base.with_overrides({"min_tokens": "1"})
    assert base.min_tokens == 512


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("min_tokens", "abc"),
        ("min_tokens", "-1"),
        ("min_tokens", -1),
        ("min_tokens", "1.5"),
        ("min_tokens", 1.5),
        ("min_tokens", True),
        ("min_tokens", "auto"),
        ("min_tokens", ""),
        ("cold_min_tokens", "infinity"),
        ("boundary_align_tokens", "0"),
        ("boundary_align_tokens", "infinity"),
        ("continued_interval", 0),
        ("prefill_chunk_size", 0),
        ("session_resume_wait_ms", "-5"),
        ("evict_save_timeout_ms", float("nan")),
        ("min_tokens", "9" * 25),
        ("min_tokens", 2**63),
    ],
)
def test_bad_value_names_key_and_value(key: str, value: object) -> None:
    with pytest.raises(PolicyError) as info:
        Policy().with_overrides({key: value})  # type: ignore[dict-item]
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: bad value {value!r}")
    assert isinstance(info.value, ValueError)


def test_unknown_key_is_named() -> None:
    with pytest.raises(PolicyError, match=r"^min_token: unknown policy key \(known: .*min_tokens"):
        Policy().with_overrides({"min_token": "5"})


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(PolicyError):
        Policy(boundary_align_tokens=0)
    assert Policy(min_tokens="infinity").min_tokens == INFINITY  # type: ignore[arg-type]


def test_policy_is_frozen() -> None:
    with pytest.raises(AttributeError):
        Policy().min_tokens = 1  # type: ignore[misc]


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "min_tokens": st.one_of(st.integers(0, 10**6), st.just("infinity")),
            "cold_max_tokens": st.one_of(st.integers(0, 10**6), st.just("infinity")),
            "continued_interval": st.one_of(st.integers(1, 10**6), st.just("infinity")),
            "boundary_align_tokens": st.integers(1, 10**5),
            "prefill_chunk_size": st.one_of(st.integers(1, 10**5), st.just("infinity"), st.just("auto")),
        },
    )
)
def test_as_dict_round_trips_through_overrides(overrides: dict) -> None:
    p = Policy().with_overrides(overrides)
    assert Policy().with_overrides(p.as_dict()) == p


# cold saves


def test_cold_save_lands_on_the_trimmed_aligned_boundary() -> None:
    p = Policy()
    assert p.cold_save_length(2080) == 2048
    assert p.cold_save_length(2079) is None  # 2047 trims to 0 aligned tokens
    assert p.cold_save_length(4200) == 4096
    assert p.cold_save_length(4128) == 4096
    assert p.cold_save_length(4127) == 2048


def test_cold_save_cap_is_rounded_down_to_the_alignment() -> None:
    p = Policy()
    assert p.cold_save_length(100_000) == 28672  # 30000 rounded down to a multiple of 2048
    q = p.with_overrides({"cold_max_tokens": "infinity"})
    assert q.cold_save_length(100_000) == 98304


def test_cold_save_cap_below_alignment_means_no_cold_save() -> None:
    assert Policy(cold_max_tokens=1000).cold_save_length(100_000) is None


def test_cold_save_gated_by_cold_min_tokens_on_the_prefill() -> None:
    p = Policy(boundary_align_tokens=64, boundary_trim_tokens=0, cold_min_tokens=1000, min_tokens=0)
    assert p.cold_save_length(999) is None
    assert p.cold_save_length(1000) == 960


def test_cold_save_gated_by_min_tokens_on_the_saved_length() -> None:
    p = Policy(boundary_align_tokens=256, cold_min_tokens=0, min_tokens=512)
    assert p.cold_save_length(600) == 512
    assert p.cold_save_length(543) is None  # saves 256 < 512


def test_min_tokens_infinity_disables_every_save() -> None:
    p = Policy(min_tokens="infinity")  # type: ignore[arg-type]
    assert p.cold_save_length(10**6) is None
    assert not p.allows_save(10**9)


def test_zero_gates_still_never_save_nothing() -> None:
    p = Policy(min_tokens=0, cold_min_tokens=0, boundary_trim_tokens=0, boundary_align_tokens=1)
    assert p.cold_save_length(0) is None
    assert p.cold_save_length(1) == 1
    assert not p.allows_save(0)


@given(
    n=st.integers(0, 200_000),
    trim=st.integers(0, 100),
    align=st.integers(1, 4096),
    cap=st.one_of(st.integers(0, 50_000), st.just(INFINITY)),
    min_tokens=st.integers(0, 5000),
    cold_min=st.integers(0, 5000),
)
def test_cold_save_invariants(
    n: int, trim: int, align: int, cap: float, min_tokens: int, cold_min: int
) -> None:
    p = Policy(
        boundary_trim_tokens=trim,
        boundary_align_tokens=align,
        cold_max_tokens=cap,
        min_tokens=min_tokens,
        cold_min_tokens=cold_min,
    )
    length = p.cold_save_length(n)
    if length is None:
        return
    assert n >= cold_min
    assert length % align == 0
    assert 0 < length <= n - trim
    assert length <= cap
    assert length >= min_tokens
    # the largest such boundary: the next one up would break the trim or the cap
    assert length + align > min(n - trim, cap)


def test_allows_save_is_the_min_tokens_gate() -> None:
    p = Policy()
    assert not p.allows_save(511)
    assert p.allows_save(512)


# probing and chunking


def test_prefix_boundaries_are_strictly_below_and_descending() -> None:
    p = Policy(boundary_align_tokens=256)
    assert p.prefix_boundaries(1000) == [768, 512, 256]
    assert p.prefix_boundaries(1024) == [768, 512, 256]
    assert p.prefix_boundaries(1025) == [1024, 768, 512, 256]
    assert p.prefix_boundaries(256) == []
    assert p.prefix_boundaries(0) == []


@given(n=st.integers(0, 100_000), align=st.integers(1, 5000))
def test_prefix_boundaries_property(n: int, align: int) -> None:
    got = Policy(boundary_align_tokens=align).prefix_boundaries(n)
    assert got == sorted(got, reverse=True)
    assert all(0 < b < n and b % align == 0 for b in got)
    assert len(got) == max(0, (n - 1) // align)


def test_chunk_size_auto_infinity_and_fixed() -> None:
    assert Policy().prefill_chunk_size == AUTO
    assert Policy().chunk_size(512) == 128
    assert Policy().chunk_size(100) == 64
    assert Policy(prefill_chunk_size="infinity").chunk_size(512) is None  # type: ignore[arg-type]
    assert Policy(prefill_chunk_size=32).chunk_size(512) == 32
    with pytest.raises(ValueError):
        Policy().chunk_size(0)


def test_as_dict_spells_infinity() -> None:
    d = Policy(min_tokens=INFINITY, prefill_chunk_size=INFINITY).as_dict()
    assert d["min_tokens"] == "infinity"
    assert d["prefill_chunk_size"] == "infinity"

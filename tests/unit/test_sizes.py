"""SIZE syntax of the contract: what parses, what is refused, and that display agrees with parsing."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from barreld.sizes import MAX_SIZE, format_size, parse_size

KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256M", 256 * MIB),
        ("256m", 256 * MIB),
        ("256MiB", 256 * MIB),
        ("256mib", 256 * MIB),
        ("256MB", 256 * MIB),
        ("1K", KIB),
        ("1kB", KIB),
        ("3G", 3 * GIB),
        ("2T", 2 * TIB),
        ("512B", 512),
        ("512b", 512),
        ("0", 0),
        ("1048576", MIB),
        ("  4G\t", 4 * GIB),
        ("2 GiB", 2 * GIB),
        ("8388607T", 8388607 * TIB),
    ],
)
def test_parses_contract_syntax(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_contract_example_is_the_guides_arithmetic() -> None:
    assert parse_size("256M") == 268435456 == 256 * 1024 * 1024


def test_int_is_bytes() -> None:
    assert parse_size(4096) == 4096
    assert parse_size(MAX_SIZE) == MAX_SIZE


@pytest.mark.parametrize(
    "text",
    [
        "12X",
        "-1",
        "+1",
        "1.5G",
        "",
        "   ",
        "G",
        "iB",
        "1iB",
        "1KBB",
        "1 K B",
        "256  M",
        "1_000",
        "0x10",
        "١٢",
    ],
)
def test_refuses_and_names_the_bad_value(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)


def test_error_message_reads_as_the_contract_says() -> None:
    expected = r"^bad size '12X': expected a whole number of bytes with an optional K, M, G or T suffix$"
    with pytest.raises(ValueError, match=expected):
        parse_size("12X")


@pytest.mark.parametrize("value", [-1, True, 1.5, None, 2**63, "8388608T", "9" * 5000])
def test_refuses_negative_overflow_and_non_sizes(value: object) -> None:
    with pytest.raises(ValueError, match="bad size"):
        parse_size(value)  # type: ignore[arg-type]


def test_huge_value_is_cut_short_in_the_message() -> None:
    with pytest.raises(ValueError) as info:
        parse_size("9" * 5000)
    assert len(str(info.value)) < 200


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (KIB, "1 KiB"),
        (1536, "1.5 KiB"),
        (256 * MIB, "256 MiB"),
        (3 * GIB // 2, "1.5 GiB"),
        (GIB - 1, "1.0 GiB"),
        (5 * TIB, "5 TiB"),
        (2048 * TIB, "2048 TiB"),
    ],
)
def test_format_size(n: int, expected: str) -> None:
    assert format_size(n) == expected


def test_format_refuses_negative() -> None:
    with pytest.raises(ValueError):
        format_size(-1)


@given(
    count=st.integers(min_value=1, max_value=1023),
    unit=st.sampled_from([1, KIB, MIB, GIB, TIB]),
)
def test_format_then_parse_is_identity_for_exact_multiples(count: int, unit: int) -> None:
    n = count * unit
    assert "." not in format_size(n)
    assert parse_size(format_size(n)) == n


@given(st.integers(min_value=0, max_value=MAX_SIZE))
def test_whatever_formats_without_a_decimal_parses_back(n: int) -> None:
    text = format_size(n)
    if "." not in text:
        assert parse_size(text) == n


@given(
    count=st.integers(min_value=0, max_value=10**6),
    suffix=st.sampled_from(["", "B", "K", "KB", "KiB", "M", "MiB", "G", "GB", "T", "TiB"]),
    lower=st.booleans(),
)
def test_parse_is_count_times_power_of_1024(count: int, suffix: str, lower: bool) -> None:
    power = {"": 0, "B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[suffix[:1]]
    text = f"{count}{suffix.lower() if lower else suffix}"
    assert parse_size(text) == count * 1024**power


@given(st.integers(min_value=0, max_value=MAX_SIZE))
def test_format_never_fails_and_is_close(n: int) -> None:
    text = format_size(n)
    number, unit = text.split(" ")
    scale = {"B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB, "TiB": TIB}[unit]
    assert abs(float(number) * scale - n) <= 0.05 * scale * (1 + 1e-9)  # half a unit, as floats count it

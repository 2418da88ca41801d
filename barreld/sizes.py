"""Byte sizes as operators write them: `256M`, `2GiB`, `512B`, `1048576`.

One parser serves the config file's quotas and `barrelctl cache evict-bytes SIZE`, so both accept exactly
the contract's syntax: a whole number with an optional K, M, G or T suffix (case-insensitive, optionally
followed by `iB` or `B`), each a power of 1024.
"""

import re

MAX_SIZE = 2**63 - 1
"""The largest size accepted: what fits a signed 64-bit field (LMDB rows, protobuf int64)."""

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE_RE = re.compile(r"([0-9]+) ?(?:([KMGT])(?:I?B)?|B)?", re.IGNORECASE | re.ASCII)
_EXPECTED = "expected a whole number of bytes with an optional K, M, G or T suffix"


def parse_size(value: str | int) -> int:
    """Return the number of bytes `value` names; raise ValueError naming `value` when it is not a size.

    An int is taken as bytes. A string is trimmed, then must be digits with an optional unit: `256M`,
    `256m`, `256MiB`, `256MB` all mean 268435456, `512B` means 512. One space may separate the number
    from the unit, so `format_size` output of an exact multiple ("2 GiB") parses back.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"bad size {_shown(value)}: {_EXPECTED}")
    if isinstance(value, int):
        n = value
    else:
        match = _SIZE_RE.fullmatch(value.strip())
        if match is None:
            raise ValueError(f"bad size {_shown(value)}: {_EXPECTED}")
        digits, unit = match.groups()
        if len(digits) > 30:  # far past MAX_SIZE; also keeps int() clear of its digit-count limit
            raise ValueError(f"bad size {_shown(value)}: larger than the maximum of {MAX_SIZE} bytes")
        n = int(digits) * _UNITS[(unit or "").upper()]
    if n < 0:
        raise ValueError(f"bad size {_shown(value)}: a size cannot be negative")
    if n > MAX_SIZE:
        raise ValueError(f"bad size {_shown(value)}: larger than the maximum of {MAX_SIZE} bytes")
    return n


def _shown(value: object) -> str:
    """The bad value for an error message, cut short so a pasted megabyte does not flood the terminal."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def format_size(n: int) -> str:
    """Render a byte count for people: "512 B", "2 GiB", "1.5 GiB" (binary units, one decimal at most).

    Exact multiples of a unit print without a decimal, so they read back through `parse_size` unchanged;
    anything else is rounded to one decimal and is for display only.
    """
    if n < 0:
        raise ValueError(f"cannot format a negative size: {n}")
    if n < 1024:
        return f"{n} B"
    names = ("KiB", "MiB", "GiB", "TiB")
    index = 0
    while index + 1 < len(names) and n >= 1024 ** (index + 2):
        index += 1
    unit = 1024 ** (index + 1)
    if n % unit == 0:
        return f"{n // unit} {names[index]}"
    shown = round(n / unit, 1)
    if shown >= 1024 and index + 1 < len(names):
        # 1023.96 MiB would print as "1024.0 MiB"; say "1.0 GiB" instead.
        index += 1
        shown = round(n / 1024 ** (index + 1), 1)
    return f"{shown:.1f} {names[index]}"

"""The save policy's gates, their defaults, and the arithmetic built on them.

Saving every prefix would flood the writer pool, so saves are gated by a few thresholds, all overridable
per model (`barrelctl load --policy K=V`, a model's `policy` table) and daemon-wide (the config's
`[policy]` table). Overrides arrive as strings or TOML values and are parsed here, in one place.

"infinity" is represented as `math.inf` (a float): every gate is a comparison, and `n >= math.inf` is
never true, so `min_tokens = infinity` disables every save with no special case in the callers.
"""

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

INFINITY = math.inf
AUTO = "auto"

_MAX = 2**63 - 1  # what an int64 field (protobuf, LMDB row) holds
_WHOLE = re.compile(r"[0-9]{1,30}", re.ASCII)  # longer is surely too large; int() would refuse 4300+


class PolicyError(ValueError):
    """A policy key that does not exist, or a value it cannot take; names both."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


def _gate(default: int | float | str, minimum: int, infinity: bool = False, auto: bool = False) -> Any:
    """A policy field whose metadata says which values it accepts: whole numbers >= minimum, maybe more."""
    return field(default=default, metadata={"minimum": minimum, "infinity": infinity, "auto": auto})


@dataclass(frozen=True)
class Policy:
    """Save gates and prefill slicing for one model; the defaults are the caching specification's.

    Values are validated on construction: whole numbers (token counts, milliseconds) at or above each
    field's minimum, `math.inf` where "infinity" makes sense, "auto" for `prefill_chunk_size`. The strings
    "infinity" / "inf" and digit strings are accepted too and normalised.
    """

    min_tokens: int | float = _gate(512, 0, infinity=True)
    """Skip any save shorter than this; infinity disables every save."""
    cold_min_tokens: int = _gate(512, 0)
    """No cold save after a prefill shorter than this."""
    cold_max_tokens: int | float = _gate(30000, 0, infinity=True)
    """Cap on a cold save's length, rounded down to the alignment; infinity for no cap."""
    continued_interval: int | float = _gate(2048, 1, infinity=True)
    """A continued save every this many generated tokens; infinity for none."""
    boundary_trim_tokens: int = _gate(32, 0)
    """Tokens dropped from the end before a cold save: mid-sentence ends make poor resume points."""
    boundary_align_tokens: int = _gate(2048, 1)
    """Cold saves land on multiples of this; it is also the longest-prefix walk's stride."""
    session_resume_wait_ms: int = _gate(500, 0)
    """How long a resume waits for the parent's in-flight finish save before prefilling instead."""
    prefill_chunk_size: int | float | Literal["auto"] = _gate(AUTO, 1, infinity=True, auto=True)
    """Per-tick cap on one prefill's tokens: "auto" is max(64, n_batch // 4), infinity disables."""
    evict_save_timeout_ms: int = _gate(30000, 0)
    """Bound on a sync shutdown save."""
    settle_tokens: int | float = _gate(INFINITY, 0, infinity=True)
    """The most tokens of an idle sequence's text settled (prefilled again in the canonical chunks so that the
    next turn reuses them) after a reply; 0 turns settling off."""
    settle_after_ms: int = _gate(200, 0)
    """How long a model stays idle after a reply before settling starts: a request that comes sooner (an
    agent's next call) finds the model free, not in the middle of a chunk."""
    snapshot_gap_tokens: int | float | Literal["auto"] = _gate(AUTO, 1, infinity=True, auto=True)
    """A model whose states cannot be cut (sliding window, recurrent, hybrid) stores its state as its own row
    where a prefill passes the end of a message (of a raw prompt: a multiple of boundary_align_tokens), at
    least this many tokens after the last one, so a later prompt that shares only that far restores it;
    infinity for none. "auto": half the sliding window (a snapshot holds the window's cells), the chunk size
    for a recurrent state (of a fixed size)."""
    reuse_grain: int | Literal["auto"] = _gate(AUTO, 1, auto=True)
    """Reuse points are multiples of it: "auto" is the finest grain the load's probe proves exact; a number
    is a floor (a grain at least the chunk size keeps reuse at chunk boundaries and skips the probe)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f, getattr(self, f.name)))

    def with_overrides(self, overrides: Mapping[str, str | int | float]) -> "Policy":
        """A copy with `overrides` applied; a PolicyError (a ValueError) names an unknown key or bad value."""
        known = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in known:
                raise PolicyError(key, f"unknown policy key (known: {', '.join(sorted(known))})")
        return dataclasses.replace(self, **overrides)

    def allows_save(self, n_tokens: int) -> bool:
        """Whether a save of `n_tokens` tokens clears the `min_tokens` gate (an empty save never does)."""
        return n_tokens > 0 and n_tokens >= self.min_tokens

    def cold_save_length(self, n_tokens: int) -> int | None:
        """Where the cold save after a prefill of `n_tokens` lands, or None when there is none.

        The save keeps `((n - trim) // align) * align` tokens, capped at `cold_max_tokens` rounded down to
        the alignment, so a very long prompt still leaves a checkpoint of its head. None when the prefill is
        shorter than `cold_min_tokens`, or the saved length is 0 or fails `min_tokens`.
        """
        if n_tokens < self.cold_min_tokens:
            return None
        align = self.boundary_align_tokens
        length = max(0, n_tokens - self.boundary_trim_tokens) // align * align
        if self.cold_max_tokens != INFINITY:
            length = min(length, int(self.cold_max_tokens) // align * align)
        return length if self.allows_save(length) else None

    def prefix_boundaries(self, n_tokens: int, stride: int | None = None) -> list[int]:
        """Multiples of the alignment (or of `stride`) strictly below `n_tokens`, longest first.

        These are the longest-prefix walk's probe points for a prompt of `n_tokens` (the whole prompt is
        the exact lookup), and the prefixes under which a checkpoint of `n_tokens` is indexed.
        """
        align = stride or self.boundary_align_tokens
        if n_tokens <= 1:
            return []
        return list(range((n_tokens - 1) // align * align, 0, -align))

    def chunk_size(self, n_batch: int) -> int | None:
        """Per-tick prefill token cap for a context with `n_batch`; None means unbounded."""
        if n_batch < 1:
            raise ValueError(f"n_batch must be at least 1, got {n_batch}")
        if self.prefill_chunk_size == AUTO:
            return max(64, n_batch // 4)
        if self.prefill_chunk_size == INFINITY:
            return None
        return int(self.prefill_chunk_size)

    def as_dict(self) -> dict[str, int | str]:
        """Every gate by name, infinity spelled "infinity": for display, JSON, and `with_overrides`."""
        return {
            f.name: "infinity" if getattr(self, f.name) == INFINITY else getattr(self, f.name)
            for f in dataclasses.fields(self)
        }


def _coerce(f: dataclasses.Field, value: object) -> int | float | str:
    """`value` as field `f` stores it, or a PolicyError saying what the field accepts."""
    meta = f.metadata
    given = value
    accepts = f"a whole number >= {meta['minimum']}"
    if meta["infinity"]:
        accepts += " or 'infinity'"
    if meta["auto"]:
        accepts += " or 'auto'"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("infinity", "inf"):
            value = INFINITY
        elif text == AUTO:
            value = AUTO
        elif _WHOLE.fullmatch(text):
            value = int(text)
    if value == INFINITY and meta["infinity"]:
        return INFINITY
    if value == AUTO and meta["auto"]:
        return AUTO
    if isinstance(value, int) and not isinstance(value, bool) and value >= meta["minimum"]:
        if value > _MAX:
            raise PolicyError(f.name, f"bad value {given!r}: larger than 2**63-1")
        return value
    raise PolicyError(f.name, f"bad value {given!r}: expected {accepts}")

"""Why a miss missed: how far a prompt matched the closest text the model holds (its live sequences; for
`barrelctl cache explain`, its stored rows too), and the bytes on each side of the first difference, so a user
sees the timestamp in a system prompt, or the client that rewrote an old turn, instead of a bare miss. Pure:
bytes in, a report out.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

SHOWN_BYTES = 48  # of each side of the first difference
LIVE = "live"  # a live sequence's text, as `Divergence.against` names it


@dataclass(frozen=True)
class Divergence:
    matched_tokens: int  # whole tokens of the prompt the closest cached text shares
    matched_bytes: int
    cached: bytes  # the closest text's bytes from the first difference (empty: the prompt runs on past it)
    prompt: bytes  # the prompt's bytes from the first difference
    against: str = LIVE  # the text compared with: LIVE, or the hex key of a stored row

    def doc(self) -> dict[str, int | str]:
        """The report as the HTTP API and `barrelctl --json` show it: both sides as text."""
        return {"matched_tokens": self.matched_tokens, "matched_bytes": self.matched_bytes,
                "cached": self.cached.decode("utf-8", "replace"), "prompt": self.prompt.decode("utf-8", "replace"),
                "against": self.against}


Labelled = tuple[str, bytes | bytearray]  # a text and what holds it


def divergence(rendered: bytes, offsets: list[int], texts: Iterable[Labelled]) -> Divergence | None:
    """The report against the text among `texts` (each labelled with what holds it) that shares the longest
    prefix with `rendered`; the first such wins. `offsets[i]` is the length in bytes of the prompt's first i
    tokens. None when nothing is held."""
    best: tuple[int, str, bytes | bytearray] | None = None
    for label, text in texts:
        n = common_prefix(rendered, text)
        if best is None or n > best[0]:
            best = (n, label, text)
    if best is None:
        return None
    n, label, text = best
    return Divergence(
        matched_tokens=bisect.bisect_right(offsets, n) - 1,
        matched_bytes=n,
        cached=bytes(text[n : n + SHOWN_BYTES]),
        prompt=rendered[n : n + SHOWN_BYTES],
        against=label,
    )


def common_prefix(a: bytes | bytearray, b: bytes | bytearray) -> int:
    """Bytes `a` and `b` share from the start, by halving: each step one comparison of two slices in C. Slices
    copy (microseconds for a 55 KB prompt), where a comparison of memoryviews goes item by item: 2 ms a call."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:  # a[:low] == b[:low] and a[:high + 1] != b[:high + 1]
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low

"""Pure planning helpers: each tick's batch, prefill chunk sizes, and byte offsets of token prefixes.

llama.cpp evaluates a batch of exactly one token through a different kernel path than a larger
batch, so a prefill that ends with a one-token chunk is not bit-identical to a cold prefill (measured:
logits differed by up to 0.45 and greedy output diverged). Every chunk planned here is therefore at
least two tokens long, unless the whole span is a single token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from barreld.engine.backend import BatchItem

MIN_CHUNK = 3


def next_chunk(pos: int, end: int, cap: int) -> int:
    """Size of the next prefill chunk from pos towards end (exclusive), at most cap tokens.

    Never leaves exactly one token for a later chunk; returns 0 when cap is too small to make
    progress without doing so (the caller tries again next tick). A cap of 3 or more always makes
    progress, which is why the worker never plans with less (MIN_CHUNK).
    """
    remaining = end - pos
    if remaining <= 0:
        return 0
    if remaining <= cap:
        return remaining
    size = cap
    if remaining - size == 1:
        size -= 1
    return size if size >= 2 else 0


def byte_offsets(pieces: list[bytes]) -> list[int]:
    """offsets[i] is the length in bytes of the rendering of the first i tokens."""
    return [0, *accumulate(len(p) for p in pieces)]


def common_prefix_len(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tokens_within(offsets: list[int], nbytes: int) -> int:
    """The largest i such that the first i tokens render to at most nbytes bytes."""
    lo, hi = 0, len(offsets) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= nbytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Slot:
    """What the batch planner needs to know of one running request."""

    seq: int
    pos: int  # tokens in the sequence's KV
    target: Sequence[int]  # the tokens it must hold before sampling
    pending: int | None  # a sampled token not yet in KV
    cold_at: int | None  # a prefix length to stop at for a cold checkpoint


@dataclass
class Batch:
    """One tick's batch, and where the logits each slot needs will be: (slot index, batch index) pairs."""

    items: list[BatchItem] = field(default_factory=list)
    samples: list[tuple[int, int]] = field(default_factory=list)
    prefills: list[tuple[int, int]] = field(default_factory=list)


def plan_batch(slots: Sequence[Slot], cap: int, n_batch: int, prefill_only: bool = False) -> Batch:
    """The next token of every decoding slot first, then a chunk of at most `cap` prompt tokens of each
    prefilling slot while n_batch has room; a chunk stops at the slot's cold checkpoint boundary."""
    batch = Batch()
    for i, s in enumerate(slots):
        if s.pending is not None and not prefill_only:
            batch.samples.append((i, len(batch.items)))
            batch.items.append(BatchItem(s.pending, s.pos, s.seq, True))
    for i, s in enumerate(slots):
        if s.pending is not None or s.pos >= len(s.target):
            continue
        end = s.cold_at if s.cold_at is not None and s.pos < s.cold_at else len(s.target)
        size = next_chunk(s.pos, end, min(cap, n_batch - len(batch.items)))
        if size == 0:
            continue
        last = s.pos + size - 1
        batch.prefills.append((i, len(batch.items) + size - 1))
        batch.items.extend(BatchItem(s.target[p], p, s.seq, p == last) for p in range(s.pos, last + 1))
    return batch

"""Pure planning helpers: each tick's batch, the canonical prefill chunks, and byte offsets of token prefixes.

Every prefill, cold or warm, is cut at absolute multiples of the chunk size C, and a chunk goes into a batch
only whole. llama.cpp's logits depend on where a prefill's batches split on some models (flash attention,
repacked quantised kernels), and a batch holding one token of a sequence takes another kernel path: with one
schedule for every prefill, a warm prefill from a multiple of C evaluates exactly the batches a cold prefill
of the same prompt does, one-token tail included, and gets the same KV and logits.

A prefill with the context to itself (one request running) may put several whole chunks in one call, up to
n_batch tokens, where the load-time probe proved that such calls give the chunked floats
(`barreld.engine.exactness`): llama.cpp prefills faster in larger batches (its CPU kernels split the work
over more rows and meet at fewer barriers). A call still ends at every point the prompt is saved at.

Where a short batch takes other kernels (flash attention's CPU kernel under 64 rows), the probe may prove a
third rule, `spans`: every call holds min_batch tokens at least, running on past a chunk boundary where it
must. A warm start then reuses up to min_batch tokens before the prompt's end, not before the next chunk
boundary, and a state whose last chunk was short is still reusable to its last token.

Each prefill run is decoded in a llama.cpp call of its own, or beside runs of equal length from sequences of
the next ids where the load-time probe proved that each gets the floats it gets alone (`share_calls`), and the
sampling steps in one call after them. With several sequences (a KV stream each), llama.cpp cuts a batch into
micro-batches holding equally many tokens of every sequence in it, so beside one sampling step a chunk's first
token would go into a micro-batch of its own and take the one-token path (with flash attention, the path of
any batch under 64 tokens); and kernels that take rows in groups count them from the call's first row.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from barreld.engine.backend import BatchItem


def chunk_end(pos: int, end: int, chunk: int) -> int:
    """Where the prefill chunk that starts at pos ends: the next multiple of `chunk`, or the prompt's end."""
    return min((pos // chunk + 1) * chunk, end)


def call_end(pos: int, end: int, chunk: int, room: int, stops: Collection[int] = (), min_batch: int = 2,
             spans: bool = False) -> int:
    """Where one llama.cpp call that prefills from pos ends when it may hold several whole chunks: the last
    chunk end within `room` tokens of pos (the first chunk's end at least), short of any of `stops`, which may
    lie inside a chunk (a snapshot where a memory that cannot be cut keeps a prompt: a warm start from there
    splits its chunk the same way, as the probe proved for the grain that allows the point); such a chunk is
    merged with none before it, as in the probe. A prompt's
    last chunk of fewer than min_batch tokens stays a call of its own, as the chunked prefill has it: inside a
    larger call its tokens would take the larger call's kernels (flash attention's tiled path; with a chunk of
    one token, the path of a batch).

    With `spans` (proven at load, `barreld.engine.exactness`) every call holds min_batch tokens at least instead:
    a call that would hold fewer runs on through the next chunk, and a last chunk of fewer joins the call
    before it, whatever `stops` and `room` say. Every token then takes the kernels of a full batch, wherever a
    warm start began, so a state is reusable to its last token and a warm start may begin anywhere short of
    min_batch tokens before the prompt's end."""
    def inside(a: int, b: int) -> bool:
        return not spans and any(a < s < b for s in stops)

    stop = chunk_end(pos, end, chunk)
    if inside(pos, stop):
        return min(s for s in stops if pos < s < stop)
    while spans and stop < end and (stop - pos < min_batch or end - stop < min_batch):
        stop = chunk_end(stop, end, chunk)
    while stop < end and stop not in stops:
        after = chunk_end(stop, end, chunk)
        if spans and end - after < min_batch:
            after = end
        if after - pos > room or (not spans and after == end and end - stop < min_batch) or inside(stop, after):
            break
        stop = after
    return stop


def byte_offsets(pieces: list[bytes]) -> list[int]:
    """offsets[i] is the length in bytes of the rendering of the first i tokens."""
    return [0, *accumulate(len(p) for p in pieces)]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items two token lists share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class Slot:
    """What the batch planner needs to know of one running request."""

    seq: int
    pos: int  # tokens in the sequence's KV
    target: Sequence[int]  # the tokens it must hold before sampling
    pending: int | None  # a sampled token not yet in KV
    stops: Collection[int] = ()  # where a call that holds several chunks must end


@dataclass
class DecodeBatch:
    """One tick's batch, and where the logits each slot needs will be: (slot index, batch index) pairs.
    `calls` are the [start, stop) ranges of `items` that go to llama.cpp in one call each, the sampling steps
    all in the last (the worker reads their logits in place, after every call). `waiting` says a
    prefill chunk did not fit beside the sampling steps."""

    items: list[BatchItem] = field(default_factory=list)
    samples: list[tuple[int, int]] = field(default_factory=list)
    prefills: list[tuple[int, int]] = field(default_factory=list)
    calls: list[tuple[int, int]] = field(default_factory=list)
    waiting: bool = False

    def add(self, items: list[BatchItem]) -> None:
        """Appends what goes to llama.cpp in one call."""
        if items:
            self.calls.append((len(self.items), len(self.items) + len(items)))
            self.items.extend(items)


def plan_batch(slots: Sequence[Slot], chunk: int, n_batch: int, prefill_only: bool = False,
               merge: bool = False, min_batch: int = 2, spans: bool = False, shared: int = 0) -> DecodeBatch:
    """The next whole chunk of each prefilling slot while n_batch has room for it beside the sampling steps,
    then the next token of every decoding slot. With `merge` (proven exact at load), a slot that is alone
    prefills as many whole chunks as n_batch holds in one call, up to its next stop, but for a last chunk of
    fewer than min_batch tokens; with `spans`, every call holds min_batch tokens at least (`call_end`). With
    `shared` (proven exact at load for up to that many sequences), runs of equal length from several slots
    share a call (`share_calls`)."""
    batch = DecodeBatch()
    decoding = [] if prefill_only else [i for i, s in enumerate(slots) if s.pending is not None]
    room = n_batch - len(decoding)
    alone = merge and len(slots) == 1
    runs = []
    for i, s in enumerate(slots):
        if s.pending is not None or s.pos >= len(s.target):
            continue
        end = call_end(s.pos, len(s.target), chunk, n_batch if alone else 0, s.stops, min_batch, spans)
        if end - s.pos > room:
            batch.waiting = True
            continue
        room -= end - s.pos
        runs.append(Run(i, s, end))
    for call in share_calls(runs, shared):
        items = []
        for run in call:
            items += [BatchItem(run.slot.target[p], p, run.slot.seq, p == run.end - 1)
                      for p in range(run.slot.pos, run.end)]
            batch.prefills.append((run.index, len(batch.items) + len(items) - 1))
        batch.add(items)
    samples = []
    for i in decoding:
        s = slots[i]
        batch.samples.append((i, len(batch.items) + len(samples)))
        samples.append(BatchItem(s.pending, s.pos, s.seq, True))
    batch.add(samples)
    return batch


@dataclass(frozen=True)
class Run:
    """A slot's prefill in this tick: its tokens from slot.pos to end."""

    index: int
    slot: Slot
    end: int

    @property
    def length(self) -> int:
        return self.end - self.slot.pos


def share_calls(runs: list[Run], shared: int) -> list[list[Run]]:
    """The runs grouped into llama.cpp calls: runs of equal length, two tokens at least, from up to `shared`
    sequences of consecutive ids share one, in ascending order; every other run is a call of its own. llama.cpp
    cuts a call of several sequences into micro-batches of equally many tokens of each, and puts sequences in
    one micro-batch only while each id follows the one before: runs of other lengths would be cut, sequences
    out of order would each get a micro-batch anyway, and a token alone takes another path. Calls come in
    the order of their first runs' sequences."""
    calls: list[list[Run]] = []
    filling: dict[int, list[Run]] = {}
    for run in sorted(runs, key=lambda r: r.slot.seq):
        may_share = shared > 1 and run.length > 1
        call = filling.get(run.length) if may_share else None
        if call is None or len(call) >= shared or call[-1].slot.seq + 1 != run.slot.seq:
            calls.append(call := [])
            if may_share:
                filling[run.length] = call
        call.append(run)
    return calls

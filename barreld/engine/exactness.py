"""How finely a loaded model's prefilled state can be reused, measured on its own context at load.

llama.cpp's kernels may compute a token's KV and logits differently by where its batch splits: measured on
these machines, SmolLM2 Q4_1 gives the same floats for any batches of two or more tokens; Gemma 3 Q4_K_M only
when batches start and end on multiples of 4 (its quantised kernels take rows in groups of 4), and a batch of
under 8 tokens gives other floats than a larger one; with flash attention, so does a batch under 64 tokens
(its CPU kernel takes its tiled path from 64 query rows, and each row's floats are its own there); and a
token decoded alone takes another path everywhere. So the probe does what a warm start does, on the real
context with the model's own K/V types and flash attention setting, for a grain G and a fewest batch B
(Memory.min_batch) at a time: a previous prompt ends inside a chunk, the next one keeps its first k tokens
(k a multiple of G, odd where it can be, chosen by the rules a warm start follows: at least B tokens to the
next chunk boundary, and for a memory that cannot be cut, a previous prompt whose last chunk held B) and
prefills the rest from k, once with k inside a chunk that the prompt fills and once with k in the prompt's
last chunk, the fewest tokens short of its end that B allows. Its state bytes and last logits must equal a
cold prefill's, split at the canonical chunk boundaries. The pair that loses least reuse and passes is the
verdict; none passing leaves the chunk rule. Then, at that pair, sixteen tokens decoded one at a time stand
in for a reply: equal again, generated tokens are reusable too (with a quantised K/V cache, small float
differences can round to the same bytes, so one token would prove little). Last, a cold prefill and those
warm starts again in calls of up to n_batch tokens that end on chunk boundaries, as a prefill with the
context to itself runs (`barreld.engine.plan`): equal, and such calls are allowed. With several sequences, runs
of equal length from each, at other depths and of other tokens, decoded in one call: where every sequence gets
the floats of its run decoded alone, prefills of several sequences share a call (`_Probe.shared`).

The verdict is remembered per library, CPU, model file and the context settings that change the floats
(K/V types, flash attention, swa_full, offloaded layers, streams; not the thread count, measured to change
nothing) in `reuse-grains.json` beside the decode checks, so a model costs its probe once: three to thirty
prefills of about 2.5 chunks (1 to 20 s on these 2 cores). On an SWA ring without swa_full every one of them
starts two windows plus a batch in, from a restored state, so the verdict speaks for a wrapped window, and
there the probe tries every point a grain allows in a chunk (`_Probe._points`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from barreld.engine.backend import Backend, BackendError, BatchItem, ContextSettings
from barreld.engine.memo import JsonMemo, cache_dir, verdict_key
from barreld.engine.memory import Memory
from barreld.engine.plan import call_end

log = logging.getLogger(__name__)

GRAINS = (1, 2, 4, 8, 16, 32, 64)  # each must divide the chunk and leave room in it
MIN_BATCHES = (2, 8, 64)  # the fewest tokens of a batch off a chunk boundary; tried with every grain
PROBE_VERSION = 11  # a verdict of another version of the probe is measured again (10 could share calls not proven)
GENERATED = 16  # tokens decoded one at a time in the reply test
SHARED_MAX = 4  # the most sequences the probe puts in one call, and so the most whose prefills share one
PROBE_SEQ = 0
PROBE_TEXT = (
    b"A river runs under the old stone bridge, past the garden where the letters were buried one morning in "
    b"winter. Nobody in the village could say who had written them, or why the silver box was left by the "
    b"window of the empty house at the end of the road. "
)


@dataclass(frozen=True)
class ExactReuse:
    """The verdict: reuse points are multiples of `grain` tokens (the chunk size: nothing finer proven) that
    leave `min_batch` tokens at least to the next chunk boundary, and `generated` says a token decoded alone
    gets the KV a prefill gives it (a reply is reusable as it is)."""

    grain: int
    generated: bool = False
    min_batch: int = 2
    merged: bool = False  # a lone prefill may put several whole chunks in one llama.cpp call
    spans: bool = False  # every call holds min_batch tokens at least (`plan.call_end`)
    shared: int = 0  # up to this many sequences' prefill runs of equal length may share a call (0: none)
    source: str = "chunk"  # probe, memo, chunk (not measured: the coarse rule), or forced (policy reuse_grain)
    probe_ms: float = 0.0

    def describe(self, chunk: int) -> str:
        if self.grain >= chunk:
            what = f"prefilled tokens at chunk boundaries ({chunk})"
        elif self.grain == 1:
            what = "any prefilled token"
        else:
            what = f"prefilled tokens at multiples of {self.grain}"
        if self.grain < chunk and self.spans:
            what += f" at least {self.min_batch} short of the prompt's end, every call holding {self.min_batch}"
        elif self.grain < chunk and self.min_batch > 2:
            what += f" at least {self.min_batch} short of a chunk boundary"
        what += ", generated tokens too" if self.generated else ""
        what += "; a lone prefill takes several chunks a call" if self.merged else ""
        return what + (f"; prefills of up to {self.shared} sequences share a call" if self.shared else "")

    def as_dict(self, chunk: int) -> dict[str, object]:
        return {**asdict(self), "rule": self.describe(chunk)}


def memo_path() -> Path:
    return cache_dir() / "reuse-grains.json"


class ReuseProbe:
    """The registry's reuse check: the verdict for a backend just opened on `path` with `settings`."""

    def __init__(self, memo: Path | None = None) -> None:
        self.memo = JsonMemo(memo or memo_path())

    def __call__(self, backend: Backend, memory: Memory, path: Path, settings: ContextSettings) -> ExactReuse:
        key = verdict_key(path, kind="reuse-grain", probe=PROBE_VERSION, chunk=memory.chunk, type_k=settings.type_k,
                          type_v=settings.type_v, flash_attn=settings.flash_attn, swa_full=memory.swa_full,
                          gpu_layers=backend.gpu_layers, n_seq_max=settings.n_seq_max, n_batch=settings.n_batch)
        kept = self.memo.get(key)
        if isinstance(kept, dict) and isinstance(kept.get("grain"), int) and memory.chunk % kept["grain"] == 0:
            return ExactReuse(kept["grain"], bool(kept.get("generated")), int(kept.get("min_batch", 2)),
                              bool(kept.get("merged")), bool(kept.get("spans")), int(kept.get("shared", 0)),
                              "memo", float(kept.get("probe_ms", 0)))
        verdict = measure(backend, memory)
        if verdict.source == "probe":
            self.memo.put(key, {**asdict(verdict), "model": str(path), "at": time.time()})
        log.info("%s: reuse grain %d, batches of %d tokens at least%s, generated tokens %s, %s, prefills of %d "
                 "sequences a call (probe %.0f ms)", path.name, verdict.grain, verdict.min_batch,
                 " in every call" if verdict.spans else "", "reusable" if verdict.generated else "not reusable",
                 "several chunks a call" if verdict.merged else "one chunk a call", max(1, verdict.shared),
                 verdict.probe_ms)
        return verdict


def measure(backend: Backend, memory: Memory) -> ExactReuse:
    """Probes on sequence 0 of an idle backend (and on up to SHARED_MAX for shared calls), which it leaves
    empty; any failure gives the chunk rule."""
    t0 = time.perf_counter()
    try:
        probe = _Probe(backend, memory)
        grain, min_batch, generated, merged, spans = probe.run()
        shared = probe.shared()
    except (BackendError, ValueError) as exc:
        log.warning("the reuse probe failed (%s); reuse stays at chunk boundaries", exc)
        grain, min_batch, generated, merged, spans, shared = memory.chunk, 2, False, False, False, 0
    finally:
        for seq in range(min(backend.n_seq_max, SHARED_MAX)):
            backend.seq_rm(seq, 0, -1)
    return ExactReuse(grain, generated, min_batch, merged, spans, shared, "probe",
                      round((time.perf_counter() - t0) * 1000.0, 1))


def candidates(chunk: int) -> list[tuple[int, int]]:
    """(grain, min_batch) pairs to try, the least reuse lost first: a grain loses up to grain - 1 tokens at
    every reuse point, a fewest batch B up to B - 1 where a point falls within B of a chunk boundary."""
    pairs = [(g, b) for g in GRAINS for b in MIN_BATCHES if chunk % g == 0 and 4 * g <= chunk and 2 * b <= chunk]
    return sorted(pairs, key=lambda p: ((p[0] - 1) / 2 + p[1] * p[1] / (2 * chunk), p))


class _Probe:
    def __init__(self, backend: Backend, memory: Memory) -> None:
        self.be, self.memory = backend, memory
        c = memory.chunk
        # An SWA ring is probed a window past the point where it first wraps: its warm starts restore a wrapped
        # window, and at the first wrap some points were exact on Gemma 3 that are not deeper in.
        self.base = -(-(2 * memory.window + backend.n_batch) // c) * c if memory.ring else 0
        self.end = self.base + 2 * c + c // 2 + 7  # crosses two chunk boundaries past base, ends inside a chunk
        if c < 8 or self.end + 8 > backend.n_ctx:
            raise ValueError(f"no room for a probe of {self.end} tokens in chunks of {c}")
        text = backend.tokenize(PROBE_TEXT)
        self.tokens = (text * (self.end // max(1, len(text)) + 1))[: self.end]
        self.head = b""  # the state of the first chunk past base, put back before each try
        self.cold: tuple[bytes, bytes] = (b"", b"")  # the state bytes and last logits of a cold prefill
        self.last_rows = 0  # rows in the last batch decoded

    def run(self) -> tuple[int, int, bool, bool, bool]:
        c = self.memory.chunk
        ref_logits = self._prefill(0, self.end)
        self.cold = cold = (bytes(self.be.state_get(PROBE_SEQ)), ref_logits.tobytes())
        self._clear()
        self._prefill(0, self.base + c)
        self.head = bytes(self.be.state_get(PROBE_SEQ))
        for grain, min_batch in candidates(c):
            points = self._points(grain, min_batch)
            exact = points and all(self._warm(k, cut, grain, min_batch) == cold for k, cut in points)
            if exact and (not self.memory.ring or self._fewest_tail(grain, min_batch)):
                merged = self._merged(points, grain, min_batch)
                return (grain, min_batch, self._generated(grain, min_batch), merged,
                        self._spans(grain, min_batch, merged))
        return c, 2, False, self._merged([(self.base + c, False)], c, 2), False

    def shared(self) -> int:
        """How many sequences may prefill in one call: as many as the context holds, up to SHARED_MAX, where
        each gets the state bytes and last logits of its run decoded alone, at another depth and of other
        tokens than the rest, in one micro-batch with them (ids 0, 1, ... in ascending order, as llama.cpp
        puts several sequences in one only while each id follows the one before, so every row but the first
        sequence's sits after others'); tried with runs of a whole chunk, of about half a chunk and of 7 tokens
        (under the tiled paths' 64 rows, and odd: kernels that take rows in groups of 4 count them from a
        call's first row), each with as many sequences as n_batch holds. llama.cpp cuts a call of several
        sequences into micro-batches of equally many tokens of each, so only runs of equal length can share
        one without being cut. 0 where any differs, or on a ring, whose window is put back in order after a
        call of one sequence only (`LlamaBackend.decode`)."""
        n, c = min(self.be.n_seq_max, SHARED_MAX), self.memory.chunk
        if n < 2 or self.memory.ring:
            return 0
        for length in sorted({c, c // 2 + 1, min(7, c)}, reverse=True):
            seqs = list(range(min(n, self.be.n_batch // length)))
            if len(seqs) < 2:
                continue
            tokens = [self.tokens[5 * s :] + self.tokens[: 5 * s] for s in seqs]
            alone = {s: self._together([s], tokens, length)[s] for s in seqs}
            if self._together(seqs, tokens, length) != alone:
                return 0
        return n

    def _together(self, seqs: list[int], tokens: list[list[int]], length: int) -> dict[int, tuple[bytes, bytes]]:
        """Each of `seqs` emptied and given a prefix of its own depth, then one call holding the next `length`
        tokens of each, in that order; each one's state bytes and last logits."""
        items = []
        for s in seqs:
            depth = 1 + 5 * s
            self.be.seq_rm(s, 0, -1)
            self.be.decode([BatchItem(tokens[s][p], p, s, False) for p in range(depth)])
            items += [BatchItem(tokens[s][p], p, s, p == depth + length - 1) for p in range(depth, depth + length)]
        self.be.decode(items)
        return {s: (bytes(self.be.state_get(s)), self.be.logits((i + 1) * length - 1).tobytes())
                for i, s in enumerate(seqs)}

    def _fewest_tail(self, grain: int, min_batch: int) -> bool:
        """On a ring, whose points above leave as many tokens as the probe's text has past them: prompts that
        end min_batch tokens past each point the pair allows in a chunk, warm from there, against the same
        prompts prefilled in the engine's chunks from the boundary before. Measured on Gemma 3: a last batch
        of under 8 tokens gives other floats at some points and depths and not at others, so one point proves
        little."""
        c, b = self.memory.chunk, self.base
        for k in range(b + c + -(-min_batch // grain) * grain, b + 2 * c - min_batch + 1, grain):
            self._restart()
            logits = self._prefill(b + c, k + min_batch)
            reference = (bytes(self.be.state_get(PROBE_SEQ)), logits.tobytes())
            self._restart()
            self._prefill(b + c, k)
            if self._finish(k, 0, k + min_batch) != reference:
                return False
        return True

    def _merged(self, points: list[tuple[int, bool]], grain: int, min_batch: int) -> bool:
        """Whether calls of up to n_batch tokens, ending on chunk boundaries, give the chunked floats: a cold
        prefill, and the warm starts just proven finished that way."""
        room = self.be.n_batch
        if room < 2 * self.memory.chunk:
            return False
        self._clear()
        logits = self._prefill(0, self.end, room)
        if (bytes(self.be.state_get(PROBE_SEQ)), logits.tobytes()) != self.cold:
            return False
        return all(self._warm(k, cut, grain, min_batch, room) == self.cold for k, cut in points)

    def _spans(self, grain: int, min_batch: int, merged: bool) -> bool:
        """Whether calls that each hold min_batch tokens at least, running on past chunk boundaries where they
        must (`plan.call_end`'s spans), give the chunked floats: a prompt whose last chunk is short of min_batch
        prefilled cold that way; warm, from a point short of min_batch tokens before a chunk boundary in a
        longer prompt cut back there, and from a state whose own last chunk was that short (it joined the call
        before it), kept whole; in one chunk a call, and in merged calls too where those are allowed. Tried for
        full attention (its states are cut, and warm starts fall anywhere) with a fewest batch over 2, where
        n_batch holds the longest such call."""
        c, b, memory = self.memory.chunk, self.base, self.memory
        if not memory.cuts_states or min_batch <= 2 or self.be.n_batch < c + 2 * min_batch:
            return False
        end = b + 2 * c + min_batch // 2
        # k this far before a chunk boundary, its first call holding about min_batch tokens in all; and a
        # state's own last chunk this short: the tightest cases the rules allow
        near = self._odd_multiple(grain, -(-min_batch // 2), min_batch - 1)
        short = self._odd_multiple(grain, 1, min_batch - 1)
        if not near or not short:
            return False
        rules = {"min_batch": min_batch, "spans": True}
        self._clear()
        logits = self._prefill(0, end, **rules)
        cold = (bytes(self.be.state_get(PROBE_SEQ)), logits.tobytes())
        for room in (0, self.be.n_batch) if merged else (0,):
            self._clear()
            if room and self._finish(0, room, end, **rules) != cold:
                return False
            self.be.state_set(PROBE_SEQ, memoryview(self.cold[0]))  # exact past the cut
            self.be.seq_rm(PROBE_SEQ, b + 2 * c - near, -1)
            if self._finish(b + 2 * c - near, room, end, **rules) != cold:
                return False
            self._clear()
            self._prefill(0, b + c + short, **rules)
            if self._finish(b + c + short, room, end, **rules) != cold:
                return False
        return True

    @staticmethod
    def _odd_multiple(grain: int, low: int, high: int) -> int:
        """The smallest odd multiple of the grain in [low, high] (any multiple where no odd one is); 0: none."""
        fits = [m for m in range(-(-low // grain), high // grain + 1) if m > 0]
        odd = [m for m in fits if m % 2]
        return min(odd or fits, default=0) * grain

    def _points(self, grain: int, min_batch: int) -> list[tuple[int, bool]]:
        """Where the warm starts keep their tokens, and whether each cuts a longer prompt back (a live
        sequence, or a full-attention state) or takes a state at its own length: each way the memory reuses.
        For each, a point in the second chunk and one in the third (where the prompt ends, but for chunks
        under 14 tokens), the latest odd multiple of the grain (any multiple where no odd one fits) that
        leaves min_batch tokens to prefill before the chunk's end, and for a state at its own length also
        past min_batch tokens of its chunk (the previous prompt ends there). Empty when the chunks leave no
        such point; but a state at its own length with 2 * min_batch at least the chunk needs no point where
        the prompt ends: its warm batches start min_batch into a chunk and hold min_batch at least, so none
        ends inside a chunk.

        On a ring, every point the pair allows in each of those chunks: a warm call's cells lie shifted from a
        cold call's by its start's distance from the chunk boundary, and whether that changes the floats does
        not follow the grain alone. Measured on Gemma 3 (AVX-512) a window or more past the first wrap: every
        multiple of 16 exact, and 120 tokens past a boundary, but no other odd multiple of 8, so that one point
        would have passed a grain of 8."""
        c, memory, b = self.memory.chunk, self.memory, self.base
        ways = [True] if memory.cuts_states else [False, *([True] if memory.cuts_live else [])]
        points = []
        for cut in ways:
            for start, end in ((b + c, b + 2 * c), (b + 2 * c, min(b + 3 * c, self.end))):
                fits = [m for m in range(1, (end - start) // grain) if end - start - m * grain >= min_batch
                        and (cut or m * grain >= min_batch)]
                if not fits and start > b + c and not cut and 2 * min_batch >= c:
                    continue
                if not fits:
                    return []
                odd = [m for m in fits if m % 2]
                tried = fits if memory.ring else [max(odd or fits)]
                points.extend((start + m * grain, cut) for m in tried)
        return points

    def _warm(self, k: int, cut: bool, grain: int, min_batch: int, room: int = 0) -> tuple[bytes, bytes]:
        """A previous prompt ends past k and is cut back to k (past the grain, with at least min_batch tokens
        in its last chunk), or ends at k; then a prompt keeps k tokens and prefills the rest."""
        self._restart()
        chunk_start = k // self.memory.chunk * self.memory.chunk
        previous = min(max(k + grain + 1, chunk_start + min_batch), self.end) if cut else k
        self._prefill(self.base + self.memory.chunk, previous)
        if cut:
            self.be.seq_rm(PROBE_SEQ, k, -1)
        return self._finish(k, room)

    def _generated(self, grain: int, min_batch: int) -> bool:
        """At the pair found: a prefill into the second chunk, tokens decoded one per batch as a reply's are,
        then the rest from a reuse point past them; False where the chunk leaves no room for that."""
        c, b = self.memory.chunk, self.base
        k = b + c + -(-min_batch // grain) * grain
        end = min(k + GENERATED, b + 2 * c - min_batch) // grain * grain
        if end <= k:
            return False
        self._restart()
        self._decode(b + c, k)
        for pos in range(k, end):
            self._decode(pos, pos + 1)
        return self._finish(end) == self.cold

    def _finish(self, pos: int, room: int = 0, end: int = 0, min_batch: int = 2,
                spans: bool = False) -> tuple[bytes, bytes]:
        logits = self._prefill(pos, end or self.end, room, min_batch, spans)
        return bytes(self.be.state_get(PROBE_SEQ)), logits.tobytes()

    def _prefill(self, pos: int, end: int, room: int = 0, min_batch: int = 2, spans: bool = False) -> np.ndarray:
        """From pos to end in the engine's chunks, a call each or, given room, as many as room holds (with
        `spans`, calls of min_batch tokens at least); the last logits."""
        while pos < end:
            stop = call_end(pos, end, self.memory.chunk, room, (), min_batch, spans)
            self._decode(pos, stop)
            pos = stop
        return self.be.logits(self.last_rows - 1)

    def _decode(self, start: int, end: int) -> None:
        self.be.decode([BatchItem(self.tokens[p], p, PROBE_SEQ, p == end - 1) for p in range(start, end)])
        self.last_rows = end - start

    def _restart(self) -> None:
        self._clear()
        self.be.state_set(PROBE_SEQ, memoryview(self.head))

    def _clear(self) -> None:
        self.be.seq_rm(PROBE_SEQ, 0, -1)

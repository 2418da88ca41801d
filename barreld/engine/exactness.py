"""How finely a loaded model's prefilled state can be reused, measured on its own context at load.

llama.cpp's kernels may compute a token's KV and logits differently by where its batch splits: measured on
these machines, SmolLM2 Q4_1 gives the same floats for any batches of two or more tokens; Gemma 3 Q4_K_M only
when batches start on multiples of 4 (its quantised kernels take rows in groups of 4), and a batch of a few
tokens (under 8) gives other floats than a larger one; with flash attention, so does a batch under 64 tokens
(its CPU kernel takes another path there); and a token decoded alone takes another path everywhere. So the
probe does what a warm start does, on the real context with the model's own K/V types and flash attention
setting: a previous prompt ends inside a chunk, the next one keeps its first k tokens (k a multiple of the
grain G tried) and prefills the rest from k, once with k inside a chunk that the prompt fills and once with k
a few tokens short of the prompt's end. Its state bytes and last logits must equal a cold prefill's, split at
the canonical chunk boundaries. The finest G that passes is the verdict; none passing leaves the chunk rule.
Then, at that grain, sixteen tokens decoded one at a time stand in for a reply: equal again, generated tokens
are reusable too (with a quantised K/V cache, small float differences can round to the same bytes, so one
token would prove little).

The verdict is remembered per library, CPU, model file and the context settings that change the floats
(K/V types, flash attention, swa_full, offloaded layers, streams; not the thread count, measured to change
nothing) in `reuse-grains.json` beside the decode checks, so a model costs its probe once: three to fifteen
prefills of about 2.5 chunks (1 to 12 s on these 2 cores).
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
from barreld.engine.plan import chunk_end
from barreld.names import MemoryKind

log = logging.getLogger(__name__)

GRAINS = (1, 2, 4, 8, 16, 32, 64)  # tried finest first; each must divide the chunk and leave room in it
PROBE_VERSION = 3  # a verdict of another version of the probe is measured again
GENERATED = 16  # tokens decoded one at a time in the reply test
PROBE_SEQ = 0
PROBE_TEXT = (
    b"A river runs under the old stone bridge, past the garden where the letters were buried one morning in "
    b"winter. Nobody in the village could say who had written them, or why the silver box was left by the "
    b"window of the empty house at the end of the road. "
)


@dataclass(frozen=True)
class ExactReuse:
    """The verdict: reuse points are multiples of `grain` tokens (the chunk size: nothing finer proven), and
    `generated` says a token decoded alone gets the KV a prefill gives it (a reply is reusable as it is)."""

    grain: int
    generated: bool = False
    source: str = "chunk"  # probe, memo, chunk (not measured: the coarse rule), or forced (policy reuse_grain)
    probe_ms: float = 0.0

    def describe(self, chunk: int) -> str:
        if self.grain >= chunk:
            what = f"prefilled tokens at chunk boundaries ({chunk})"
        elif self.grain == 1:
            what = "any prefilled token"
        else:
            what = f"prefilled tokens at multiples of {self.grain}"
        return what + (", generated tokens too" if self.generated else "")

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
                          gpu_layers=backend.gpu_layers, n_seq_max=settings.n_seq_max)
        kept = self.memo.get(key)
        if isinstance(kept, dict) and isinstance(kept.get("grain"), int) and memory.chunk % kept["grain"] == 0:
            return ExactReuse(kept["grain"], bool(kept.get("generated")), "memo", float(kept.get("probe_ms", 0)))
        verdict = measure(backend, memory)
        if verdict.source == "probe":
            self.memo.put(key, {**asdict(verdict), "model": str(path), "at": time.time()})
        log.info("%s: reuse grain %d, generated tokens %s (probe %.0f ms)", path.name, verdict.grain,
                 "reusable" if verdict.generated else "not reusable", verdict.probe_ms)
        return verdict


def measure(backend: Backend, memory: Memory) -> ExactReuse:
    """Probes on sequence 0 of an idle backend, which it leaves empty; any failure gives the chunk rule."""
    t0 = time.perf_counter()
    try:
        grain, generated = _Probe(backend, memory).run()
    except (BackendError, ValueError) as exc:
        log.warning("the reuse probe failed (%s); reuse stays at chunk boundaries", exc)
        grain, generated = memory.chunk, False
    finally:
        backend.seq_rm(PROBE_SEQ, 0, -1)
    return ExactReuse(grain, generated, "probe", round((time.perf_counter() - t0) * 1000.0, 1))


class _Probe:
    def __init__(self, backend: Backend, memory: Memory) -> None:
        self.be, self.memory = backend, memory
        c = memory.chunk
        self.length = 2 * c + c // 2 + 7  # crosses two chunk boundaries and ends inside a chunk
        if c < 8 or self.length + 8 > backend.n_ctx:
            raise ValueError(f"no room for a probe of {self.length} tokens in chunks of {c}")
        text = backend.tokenize(PROBE_TEXT)
        self.tokens = (text * (self.length // max(1, len(text)) + 1))[: self.length]
        self.head = b""  # the state of the first chunk, put back before each try
        self.last_rows = 0  # rows in the last batch decoded

    def run(self) -> tuple[int, bool]:
        c = self.memory.chunk
        ref_logits = self._prefill(0, self.length)
        cold = (bytes(self.be.state_get(PROBE_SEQ)), ref_logits.tobytes())
        self._clear()
        self._prefill(0, c)
        self.head = bytes(self.be.state_get(PROBE_SEQ))
        for grain in (g for g in GRAINS if c % g == 0 and 4 * g <= c):
            k = c + (c // 2 // grain | 1) * grain  # an odd multiple of the grain, inside the second chunk
            short = 2 * c + c // 2 // grain * grain  # a few tokens short of the end, inside the last chunk
            if self._warm(k, grain) == cold and self._warm(short, grain) == cold:
                return grain, self._generated(k) == cold
        return c, False

    def _warm(self, k: int, grain: int) -> tuple[bytes, bytes]:
        """A previous prompt ends past k, off the grain (a cut memory) or at k, then a prompt keeps k tokens
        and prefills the rest."""
        self._restart()
        cuts = self.memory.kind is MemoryKind.FULL
        previous = min(k + grain + 1, self.length) if cuts else k
        self._prefill(self.memory.chunk, previous)
        if cuts:
            self.be.seq_rm(PROBE_SEQ, k, -1)
        return self._finish(k)

    def _generated(self, k: int) -> tuple[bytes, bytes]:
        """At the grain found: a prefill to k, tokens decoded one per batch as a reply's are, then the rest."""
        self._restart()
        self._decode(self.memory.chunk, k)
        end = k + min(GENERATED, self.length - k - 2)
        for pos in range(k, end):
            self._decode(pos, pos + 1)
        return self._finish(end)

    def _finish(self, pos: int) -> tuple[bytes, bytes]:
        logits = self._prefill(pos, self.length)
        return bytes(self.be.state_get(PROBE_SEQ)), logits.tobytes()

    def _prefill(self, pos: int, end: int) -> np.ndarray:
        """From pos to end in the engine's chunks; the last logits."""
        while pos < end:
            stop = chunk_end(pos, end, self.memory.chunk)
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

"""Gemma 3's SWA ring without swa_full: are warm starts exact, with and without the window put back in order?

    python -m bench.ring [--tokens 2600] [--results bench/RESULTS.md]

Writes (or replaces) the section "ring" of the results file. Progress goes to stderr.

Why. Without swa_full, llama.cpp keeps a sliding-window model's window layers in a ring of window + n_ubatch
cells (1,024 here). Once a sequence outgrows it, its cells lie in another order than a restored state's, so a
warm start from a saved state gets other logits than the cold run it stands for. barreld's backend writes the
window out and reads it back (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) after every prefill call, which lays it out
as a restore does (barreld.engine.memory); this measures both ways, and what the ordering costs.

Method. Gemma 3 270M, barreld's backend with its defaults for it (flash attention off, n_batch 512, swa_full
off), `--tokens` random tokens. For each way (the ring as llama.cpp leaves it: the backend's ordering switched
off; ordered, as barreld runs) and each call size (128 tokens, barreld's chunk; 512, a prefill alone taking
four chunks a call): a cold prefill in calls ending on multiples of the call size, its last logits and 20
greedy tokens after them; then, for each warm point K, a prefill to K (ending there), its state saved, the
sequence given other work, the state restored, and the rest prefilled from K in the same calls the cold run
made: the largest difference of the last logits, and whether the 20 greedy tokens are the cold run's. Last,
the time one ordering takes at the longest prompt, against the time of the 128-token call it follows.
"""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np

from bench.harness import begin, progress
from bench.report import Table, bench_parser, show_and_put
from tests.support.sandbox_models import gemma_path

SECTION = "ring"
N_BATCH = 512
GREEDY = 20
POINTS = {128: [512, 1024, 1280, 1536, 2048, 2304, 1300, 2100], 512: [1024, 1536, 1600, 1664, 1568, 1544]}


class Runner:
    def __init__(self, backend, tokens: list[int], calls: int) -> None:
        self.be, self.tokens, self.calls = backend, tokens, calls

    def prefill(self, start: int, end: int) -> np.ndarray:
        from barreld.engine.backend import BatchItem

        pos = start
        while pos < end:
            stop = min(end, (pos // self.calls + 1) * self.calls)
            self.be.decode([BatchItem(self.tokens[i], i, 0, i == stop - 1) for i in range(pos, stop)])
            logits, pos = self.be.logits(stop - pos - 1), stop
        return logits

    def greedy(self, logits: np.ndarray) -> list[int]:
        from barreld.engine.backend import BatchItem

        out, pos = [], len(self.tokens)
        for _ in range(GREEDY):
            out.append(int(np.argmax(logits)))
            self.be.decode([BatchItem(out[-1], pos, 0, True)])
            logits, pos = self.be.logits(0), pos + 1
        return out

    def warm(self, k: int) -> tuple[np.ndarray, list[int]]:
        self.be.seq_rm(0, 0, -1)
        self._to(k)
        state = bytes(self.be.state_get(0))
        self.be.seq_rm(0, 0, -1)
        self.prefill(0, 700)
        self.be.state_set(0, memoryview(state))
        logits = self.prefill(k, len(self.tokens))
        return logits, self.greedy(logits)

    def _to(self, k: int) -> None:
        """A prefill that ends at k: the cold run's calls, then what is left past its last boundary in one."""
        from barreld.engine.backend import BatchItem

        boundary = k // self.calls * self.calls
        self.prefill(0, boundary)
        if boundary < k:
            self.be.decode([BatchItem(self.tokens[i], i, 0, False) for i in range(boundary, k)])


def measure(n: int) -> tuple[Table, Table]:
    from barreld.engine.openmp import set_wait_defaults

    set_wait_defaults(os.environ)
    from barreld.engine.backend import ContextSettings
    from barreld.engine.llama_backend import LlamaBackend

    rng = random.Random(1)
    tokens = [rng.randrange(1000, 30000) for _ in range(n)]
    be = LlamaBackend(gemma_path(), ContextSettings(n_ctx=4096, n_batch=N_BATCH, flash_attn=None))
    fa = "on" if be.flash_attn else "off"
    t = Table(f"Warm starts on Gemma 3's SWA ring (swa_full off, window {be.swa_window}, flash attention {fa}), "
              f"a prompt of {n:,} tokens", ["window", "calls of", "warm from K", "K past the ring", "max |logit diff|",
                                            f"{GREEDY} greedy tokens as cold"])
    try:
        for ordered in (False, True):
            be.ring = ordered
            for calls, points in POINTS.items():
                run = Runner(be, tokens, calls)
                be.seq_rm(0, 0, -1)
                cold = run.prefill(0, n)
                reply = run.greedy(cold)
                for k in points:
                    progress(f"{'ordered' if ordered else 'as llama.cpp leaves it'}, calls of {calls}, K = {k}")
                    logits, got = run.warm(k)
                    t.add("ordered" if ordered else "as llama.cpp leaves it", str(calls), f"{k:,}",
                          "yes" if k > 1024 else "no", f"{float(np.abs(logits - cold).max()):.3f}",
                          "yes" if got == reply else "no")
        be.ring = True
        run = Runner(be, tokens, 128)
        be.seq_rm(0, 0, -1)
        run.prefill(0, n - 128)
        c = Table("What the ordering costs", ["at", "one 128-token call, ms", "its ordering, ms", "share"])
        call, order = [], []
        be.ring = False  # ordered by hand below, to time it apart from the call
        for _ in range(5):
            t0 = time.perf_counter()
            run.prefill(n - 128, n)
            t1 = time.perf_counter()
            be._order_window(0)
            t2 = time.perf_counter()
            call.append(t1 - t0)
            order.append(t2 - t1)
            be.seq_rm(0, n - 128, -1)
        a, b = float(np.median(call)) * 1000, float(np.median(order)) * 1000
        c.add(f"{n - 128:,} tokens", f"{a:.1f}", f"{b:.2f}", f"{b / a:.1%}")
    finally:
        be.close()
    t.note = ("The ring holds 1,024 cells here (window 512 + n_ubatch 512). A K past it restores a wrapped window. "
              "Calls of 128: every prefill call ends on a multiple of 128; of 512: four chunks a call, as a prefill "
              "alone runs, and a warm start's first call ends on the next multiple of 512.")
    c.note = "Medians of 5. The ordering is one write and one read of the window's cells (15 layers x 512 cells)."
    return t, c


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = bench_parser("bench.ring", __doc__, SECTION)
    p.add_argument("--tokens", type=int, default=2600)
    args = p.parse_args(argv)
    m, t0 = begin()
    tables = measure(args.tokens)
    show_and_put(list(tables), args.results, SECTION, "Warm starts on a sliding-window ring", "bench.ring",
                 argv, t0, m["load"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The floor under bench.decode's figures: llama.cpp's decode alone, through barreld's own backend in a loop, with no
server, no worker and no front end: what is left of a barreld token once Python around the decode is taken away.

    python -m bench.decode_floor TOKENS [--flash-attn]

Prints one JSON object: tokens/s of one sequence and of four decoding together (one llama_decode per step holding
each sequence's next token, greedy by argmax), after the same prompt as bench.decode's. Run as a child process so
that its OpenMP threads are set up as barreld's are (barreld.engine.openmp) and its pool is the only one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def rate(backend: object, n_seq: int, tokens: int) -> float:
    """Tokens/s over `tokens` steps of `n_seq` sequences, each prefilled with the same prompt first."""
    import numpy as np

    from barreld.engine.backend import BatchItem

    prompt = backend.tokenize(b"Story 0: once upon a time, in a small village by the sea,")
    for seq in range(n_seq):
        backend.seq_rm(seq, 0, -1)
        backend.decode([BatchItem(t, i, seq, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    nxt = [int(np.argmax(backend.logits(len(prompt) - 1)))] * n_seq
    pos = len(prompt)
    t0 = time.perf_counter()
    for _ in range(tokens):
        backend.decode([BatchItem(nxt[s], pos, s, True) for s in range(n_seq)])
        nxt = [int(np.argmax(backend.logits(s))) for s in range(n_seq)]
        pos += 1
    return n_seq * tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("tokens", type=int)
    p.add_argument("--flash-attn", action="store_true")
    args = p.parse_args(argv)
    from barreld.engine.openmp import set_wait_defaults

    set_wait_defaults(os.environ)
    from barreld.engine.backend import ContextSettings
    from barreld.engine.llama_backend import LlamaBackend
    from bench.harness import model_path

    out = {}
    for n_seq in (1, 4):
        backend = LlamaBackend(model_path(), ContextSettings(n_ctx=4096, n_seq_max=n_seq, flash_attn=args.flash_attn))
        rate(backend, n_seq, 8)  # warm up
        out["one" if n_seq == 1 else "four"] = rate(backend, n_seq, args.tokens)
        backend.close()
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

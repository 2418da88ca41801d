"""The floor under bench.prefill's figures: a cold prefill through barreld's own backend in a loop, with no server,
no worker and no front end: what is left of barreld's prefill once Python around llama.cpp is taken away.

    python -m bench.prefill_floor MODEL PROMPT_FILE N_CTX [--swa-full] [--no-flash-attn]

Prints one JSON object: the prompt's tokens and tokens/s, the prompt prefilled in the calls barreld makes for a
prefill alone (as many whole chunks of n_batch / 4 as n_batch holds: `barreld.engine.plan.call_end`). Run as a
child process so that its OpenMP threads are set up as barreld's are (barreld.engine.openmp).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

N_BATCH = 512


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("prompt", type=Path)
    p.add_argument("n_ctx", type=int)
    p.add_argument("--swa-full", action="store_true")
    p.add_argument("--no-flash-attn", action="store_true")
    args = p.parse_args(argv)
    from barreld.engine.openmp import set_wait_defaults

    set_wait_defaults(os.environ)
    from barreld.engine.backend import BatchItem, ContextSettings
    from barreld.engine.llama_backend import LlamaBackend
    from barreld.engine.plan import call_end

    settings = ContextSettings(n_ctx=args.n_ctx, n_batch=N_BATCH, flash_attn=not args.no_flash_attn,
                               swa_full=args.swa_full)
    backend = LlamaBackend(args.model, settings)
    tokens = backend.tokenize(args.prompt.read_bytes())
    chunk = max(64, N_BATCH // 4)
    t0 = time.perf_counter()
    pos = 0
    while pos < len(tokens):
        end = call_end(pos, len(tokens), chunk, N_BATCH)
        backend.decode([BatchItem(tokens[i], i, 0, i == end - 1) for i in range(pos, end)])
        pos = end
    seconds = time.perf_counter() - t0
    backend.close()
    json.dump({"tokens": len(tokens), "rate": len(tokens) / seconds}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Flash attention in small micro-batches: a way to keep its decode speed without its 64-row rule, measured.

    python -m bench.ubatch [--tokens 8000] [--decode 200] [--results bench/RESULTS.md]

Writes (or replaces) the section "ubatch" of the results file. Progress goes to stderr.

Why. With flash attention, llama.cpp's CPU kernel takes its tiled path for a call of 64 query rows or more, and
those rows get other floats than the same rows computed under 64 at a time; so barreld's reuse probe
(barreld.engine.exactness) makes every warm batch hold 64 tokens at least (B 64), which costs a short chat's warm
turns more than flash attention's faster decode gains (since then, calls of 64 tokens at least and the logits a
row keeps after each prompt have made it barreld's default for SmolLM2). A micro-batch (n_ubatch)
under 64 rows would put every call on the other path, so that any batch of two or more tokens is exact again.

Method. The bundled SmolLM2, three settings, each in a child process of its own (its OpenMP threads set up as
barreld's, barreld.engine.openmp): flash attention off with n_ubatch = n_batch = 512, on with 512 (barreld's
default here), and on with 32. For each: the reuse probe's verdict on a 4,096-cell context (grain, fewest batch,
whether a generated token's KV is a prefill's), a cold prefill of bench.prefill's agent head cut to `--tokens` in
the calls barreld makes for a prefill alone (bench.prefill_floor's loop), and decode tokens/s of one sequence and
of four (bench.decode_floor's loop, `--decode` tokens). No server: this is llama.cpp through barreld's backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import begin, model_path, progress
from bench.report import Table, bench_parser, show_and_put

SECTION = "ubatch"
SETTINGS = [("flash attention off, n_ubatch 512", False, 512), ("flash attention on, n_ubatch 512", True, 512),
            ("flash attention on, n_ubatch 32", True, 32)]
N_BATCH = 512


def measure_one(flash_attn: bool, ubatch: int, prompt: Path, decode: int) -> dict:
    """In this process: the probe's verdict, the cold prefill's tokens/s and the decode rates."""
    from barreld.engine.openmp import set_wait_defaults

    set_wait_defaults(os.environ)
    from barreld.engine.backend import BatchItem, ContextSettings
    from barreld.engine.exactness import measure
    from barreld.engine.llama_backend import LlamaBackend
    from barreld.engine.plan import call_end
    from barreld.engine.registry import model_memory
    from bench.decode_floor import rate

    path = model_path()
    be = LlamaBackend(path, ContextSettings(n_ctx=4096, n_batch=N_BATCH, flash_attn=flash_attn, n_ubatch=ubatch))
    verdict = measure(be, model_memory(be, N_BATCH // 4))
    out: dict = {"grain": verdict.grain, "min_batch": verdict.min_batch, "generated": verdict.generated}
    rate(be, 1, 8)
    out["one"] = rate(be, 1, decode)
    be.close()
    be = LlamaBackend(path, ContextSettings(n_ctx=4096, n_seq_max=4, flash_attn=flash_attn, n_ubatch=ubatch))
    rate(be, 4, 8)
    out["four"] = rate(be, 4, decode)
    be.close()
    be = LlamaBackend(path, ContextSettings(n_ctx=8192, n_batch=N_BATCH, flash_attn=flash_attn, n_ubatch=ubatch))
    tokens = be.tokenize(prompt.read_bytes())
    t0, pos = time.perf_counter(), 0
    while pos < len(tokens):
        end = call_end(pos, len(tokens), N_BATCH // 4, N_BATCH, min_batch=verdict.min_batch, spans=verdict.spans)
        be.decode([BatchItem(tokens[i], i, 0, i == end - 1) for i in range(pos, end)])
        pos = end
    out["prefill"] = len(tokens) / (time.perf_counter() - t0)
    out["tokens"] = len(tokens)
    be.close()
    return out


def measure_all(tokens: int, decode: int) -> list[tuple[str, dict]]:
    from bench.prefill import Model, prompt_of

    prompt, _ = prompt_of(Model("smollm2", model_path(), 8192, False), tokens)
    results = []
    with tempfile.TemporaryDirectory() as work:
        text = Path(work) / "prompt.txt"
        text.write_text(prompt)
        for label, flash_attn, ubatch in SETTINGS:
            progress(f"{label}: probe, decode, cold prefill of {tokens} tokens")
            child = subprocess.run([sys.executable, "-m", "bench.ubatch", "--child", str(int(flash_attn)), str(ubatch),
                                    str(text), str(decode)], capture_output=True, text=True, check=True)
            results.append((label, json.loads(child.stdout.strip().splitlines()[-1])))
    return results


def table(results: list[tuple[str, dict]]) -> Table:
    base = results[0][1]
    tb = Table("Flash attention in micro-batches of 32 rows, SmolLM2: exactness, cold prefill, decode",
               ["setting", "reuse probe: grain, fewest batch", "generated tokens reusable", "cold prefill tokens/s",
                "vs default", "decode, one stream", "vs default", "decode, four streams", "vs default"])
    for label, r in results:
        tb.add(label, f"{r['grain']}, {r['min_batch']}", "yes" if r["generated"] else "no", f"{r['prefill']:.1f}",
               f"{r['prefill'] / base['prefill']:.2f}x", f"{r['one']:.1f}", f"{r['one'] / base['one']:.2f}x",
               f"{r['four']:.1f}", f"{r['four'] / base['four']:.2f}x")
    tb.note = (f"One run each; cold prefill of {results[0][1]['tokens']:,} tokens of bench.prefill's agent head. "
               "The first row is barreld's default for SmolLM2 (no sliding window); ratios are over it. A fewest "
               "batch of 2 means any warm batch of two tokens or more is exact; 64, that a warm start prefills 64 "
               "tokens at least.")
    return tb


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        flash_attn, ubatch, prompt, decode = argv[1:]
        print(json.dumps(measure_one(bool(int(flash_attn)), int(ubatch), Path(prompt), int(decode))))
        return 0
    p = bench_parser("bench.ubatch", __doc__, SECTION)
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--decode", type=int, default=200)
    args = p.parse_args(argv)
    m, t0 = begin()
    tb = table(measure_all(args.tokens, args.decode))
    heading = "Flash attention in small micro-batches"
    show_and_put(tb, args.results, SECTION, heading, "bench.ubatch", argv, t0, m["load"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

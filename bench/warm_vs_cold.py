"""Cold and warm time to first token on one ~1,500-token prompt: each Barrel tier, and in the same run
llama-cpp-python's own LlamaRAMCache and LlamaDiskCache on the same prompt.

    python -m bench.warm_vs_cold [--tokens 1500] [--reps 5] [--cold 2] [--out bench/warm_vs_cold.md]

Prints a table and the ratios against the targets (warm at most 1/50 of cold from ram, at most 1/30 from
disk with the page cache warm; Barrel's warm start at least 10x faster than llama-cpp-python's caches) and
writes the same as Markdown to --out. Methods: see bench/ttft.py (Barrel) and bench/llama_ref.py
(llama-cpp-python). Warm figures are medians of --reps runs (after one uncounted warm run per system);
cold figures medians of --cold prompts. All systems get the same prompts, round-robin.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from barreld.names import TIER_NAMES
from bench.harness import Tokenizer, machine, progress
from bench.llama_ref import CACHES, METHODS, LlamaSystem
from bench.report import Table, frac, ms, times, verdict
from bench.ttft import BarrelSystem, Results, compare, prompts_for

TARGETS = {"ram": 50, "disk": 30}  # warm at most 1/N of cold
LLAMA_TARGET = 10.0  # Barrel's warm start at least this many times faster than llama-cpp-python's
PAIRS = (("ram", "LlamaRAMCache"), ("disk", "LlamaDiskCache"))
WARM = BarrelSystem.WARM
DROPPED = BarrelSystem.DROPPED


def run(tokens: int, reps: int, n_cold: int) -> Results:
    prompts = prompts_for(Tokenizer(), tokens, n_cold, seed="wvc")
    with contextlib.ExitStack() as stack:
        progress("starting one barreld per tier")
        systems = [stack.enter_context(BarrelSystem(t, drop_variant=True)) for t in TIER_NAMES]
        systems += [stack.enter_context(LlamaSystem(c)) for c in CACHES]
        progress(f"{tokens}-token prompts: {n_cold} cold each, then {reps} warm runs, round-robin over "
                 f"{len(systems)} systems")
        return compare(systems, {tokens: prompts}, reps)


def best_llama(r: Results, cache: str, n: int, what: str = "ttft_ms") -> float:
    """The faster of llama-cpp-python's two warm methods: the comparison most generous to it."""
    return min(r.warm_ms(cache, m, n, what) for m in METHODS)


def tables(r: Results, n: int) -> list[Table]:
    main = Table(
        f"Time to first token, {r.prompt_tokens(n)}-token prompt (medians; client-side wall time unless noted)",
        ["", "cold", "warm", "warm, daemon's ttft", "restore", "re-evaluate last tokens", "warm / cold", "target",
         ""],
    )
    for tier in TIER_NAMES:
        name = f"Barrel {tier}"
        cold = r.cold_ms(name, n)
        for variant in (WARM, DROPPED):
            if not r.warm[(name, variant, n)]:
                continue
            warm = r.warm_ms(name, variant, n)
            target = TARGETS.get(tier) if variant == WARM else None
            main.add(
                name + (f" ({variant})" if tier == "disk" else ""),
                ms(cold), ms(warm), ms(r.warm_ms(name, variant, n, "daemon_ttft_ms")),
                ms(r.warm_ms(name, variant, n, "restore_ms")), ms(r.warm_ms(name, variant, n, "prefill_ms")),
                frac(warm, cold),
                f"≤ 1/{target}" if target else "", verdict(warm / cold <= 1 / target) if target else "",
            )
    for cache in CACHES:
        cold = r.cold_ms(cache, n)
        for method, label in (("fresh", "fresh Llama"), ("same", "same Llama")):
            warm = r.warm_ms(cache, method, n)
            main.add(f"{cache}, {label}", ms(cold), ms(warm), "", "", "", frac(warm, cold), "", "")
        call_cold = r.cold_ms(cache, n, "call_ms")
        call_warm = best_llama(r, cache, n, "call_ms")
        main.add(f"{cache}, whole call", ms(call_cold), ms(call_warm), "", "", "", frac(call_warm, call_cold), "",
                 "")
    main.note = (
        "Barrel: cold = a never-seen prompt (path miss); warm = the same prompt again after an unrelated request "
        "took the only sequence (path exact, restored from the tier). llama-cpp-python: time to the first "
        "streamed chunk of `llm(prompt, max_tokens=1, stream=True)`; 'fresh Llama' = a new instance on the same "
        "cache, 'same Llama' = the first instance after an unrelated prompt; 'whole call' = the return of the "
        "call (the faster warm method), which comes only after llama-cpp-python has written the state back to "
        "its cache. Barrel's warm start restores the checkpoint; 're-evaluate last tokens' is the daemon's prefill "
        "time, zero when the checkpoint holds the logits of the prompt's last position (a finish checkpoint keeps "
        "them), else the decode of the prompt's last two tokens (a one-token batch is not bit-identical to a "
        "batched prefill)."
    )
    vs = Table(
        "Barrel's warm start against llama-cpp-python's (how many times faster; target ≥ 10x)",
        ["Barrel tier", "vs", "llama warm TTFT", "Barrel warm TTFT", "faster (TTFT)", "",
         "faster (whole call)", ""],
    )
    for tier, cache in PAIRS:
        b = r.warm_ms(f"Barrel {tier}", WARM, n)
        lt, lc = best_llama(r, cache, n), best_llama(r, cache, n, "call_ms")
        vs.add(tier, cache, ms(lt), ms(b), times(lt, b), verdict(lt / b >= LLAMA_TARGET), times(lc, b),
               verdict(lc / b >= LLAMA_TARGET))
    vs.note = (
        "llama-cpp-python's figure is the faster of its two warm methods. 'TTFT' compares first streamed "
        "token with first streamed token; 'whole call' compares Barrel's first token with the return of "
        "llama-cpp-python's `llm(prompt, max_tokens=1)`, which includes its synchronous cache write."
    )
    return [main, vs]


def summary(r: Results, n: int) -> dict:
    out: dict[str, float] = {"prompt_tokens": r.prompt_tokens(n)}
    for tier in TIER_NAMES:
        name = f"Barrel {tier}"
        out[f"{tier}_cold_ms"] = r.cold_ms(name, n)
        out[f"{tier}_warm_ms"] = r.warm_ms(name, WARM, n)
        out[f"{tier}_warm_over_cold"] = out[f"{tier}_warm_ms"] / out[f"{tier}_cold_ms"]
    for cache in CACHES:
        out[f"{cache}_cold_ms"] = r.cold_ms(cache, n)
        out[f"{cache}_warm_ttft_ms"] = best_llama(r, cache, n)
        out[f"{cache}_warm_call_ms"] = best_llama(r, cache, n, "call_ms")
    for tier, cache in PAIRS:
        out[f"{tier}_vs_{cache}_ttft_x"] = out[f"{cache}_warm_ttft_ms"] / out[f"{tier}_warm_ms"]
        out[f"{tier}_vs_{cache}_call_x"] = out[f"{cache}_warm_call_ms"] / out[f"{tier}_warm_ms"]
    return out


def markdown(r: Results, n: int, m: dict, elapsed: float, argv: list[str]) -> str:
    lines = [
        "# Warm versus cold time to first token",
        "",
        "Generated by `python -m bench.warm_vs_cold " + " ".join(argv) + "`; do not edit by hand.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram']} RAM; {m['os']}; Python {m['python']}, "
        f"llama-cpp-python {m['llama-cpp-python']}, Barrel {m['barrel-kv']}; model {m['model']}; {m['date']}; "
        f"load average at start {m['load']}; run took {elapsed / 60:.1f} min. Absolute times are for this "
        "machine (shared with other jobs while it ran); the ratios were measured in the same run.",
        "",
    ]
    for t in tables(r, n):
        lines += [t.markdown()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1500, help="prompt length in tokens (default 1500)")
    p.add_argument("--reps", type=int, default=5, help="warm runs per cache; the median is reported (default 5)")
    p.add_argument("--cold", type=int, default=2, help="cold prompts per cache (default 2)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "warm_vs_cold.md",
                   help="Markdown report (default bench/warm_vs_cold.md); '-' for none")
    p.add_argument("--json", type=Path, default=None, help="also write the summary ratios as JSON here")
    args = p.parse_args(argv)
    m = machine()
    t0 = time.monotonic()
    r = run(args.tokens, args.reps, args.cold)
    elapsed = time.monotonic() - t0
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 150)
    for t in tables(r, args.tokens):
        console.print(t.rich())
        console.print()
    s = summary(r, args.tokens)
    console.print(f"[bold]{m['cpu']}, {m['cores']} cores[/bold]: ran in {elapsed:.0f} s")
    if str(args.out) != "-":
        args.out.write_text(markdown(r, args.tokens, m, elapsed, argv))
        progress(f"wrote {args.out}")
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "summary": s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

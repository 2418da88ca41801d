"""The agent trace on one model of each memory kind, warm against cold, with the reuse rules in force.

    python -m bench.memory_kinds [--agents 2] [--steps quick|full] [--results bench/RESULTS.md]

Writes (or replaces) the section "Memory kinds" of RESULTS.md, leaving the rest as it is.

Method. Each model runs the agent trace of section 3 (agents share one daemon, n_seq_max 1, and a
900-token system prompt, taking turns; 'append' extends the last prompt, 'insert' changes the history after
the task, 'drop' removes old exchanges), on two daemons side by side: a warm one (policy: min_tokens 256,
cold_min_tokens 256, boundary_align_tokens 256, disk tier) and a cold one that never saves and is flushed
with an unrelated prompt before every request, so each of its replies is a cold prefill. Every prompt goes
to both, warm first; the replies that build the history are the warm daemon's, and each is compared with
the cold daemon's byte for byte (greedy). Reuse ratio is restored over prompt tokens; TTFT is client-side
wall time to the first token, over the Unix socket. Models: SmolLM2-135M Q4_1 (full attention), Gemma 3
270M Q4_K_M (sliding window 512; swa_full on, the default, and off), and the tests' tiny random-weight
Mamba (recurrent) and LFM2 (hybrid). All use n_ctx 4096, n_batch 512 (prefill chunk 128) and one thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from barrelctl.client import Completion
from bench.harness import Tokenizer, machine, median, model_path, progress
from bench.report import Table, ms, pct, put_section, times
from bench.traces import FULL_STEPS, QUICK_STEPS, Agent, agent_system, reply_text
from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import gemma_path, tiny_hybrid_path, tiny_recurrent_path

SECTION = "memory_kinds"
WARM = "[policy]\nmin_tokens = 256\ncold_min_tokens = 256\nboundary_align_tokens = 256\n"
COLD = '[policy]\nmin_tokens = "infinity"\n'
MODELS: dict[str, tuple[str, Callable[[], Path], str]] = {  # name: (memory, path, extra [[models]] lines)
    "smollm2": ("full", model_path, ""),
    "gemma": ("swa", gemma_path, "swa_full = true\n"),
    "gemma-no-swa-full": ("swa", gemma_path, "swa_full = false\n"),
    "mamba": ("recurrent", tiny_recurrent_path, ""),
    "lfm2": ("hybrid", tiny_hybrid_path, ""),
}


@dataclass
class Pair:
    op: str
    warm: Completion
    cold: Completion


@dataclass
class Trace:
    memory: str
    pairs: list[Pair] = field(default_factory=list)
    refused: int = 0

    def reuse(self) -> float:
        return sum(p.warm.restored for p in self.pairs) / sum(p.warm.prompt_tokens for p in self.pairs)

    def identical(self) -> int:
        return sum(p.warm.text == p.cold.text for p in self.pairs)


def daemon(policy: str, name: str) -> Sandbox:
    memory, path, extra = MODELS[name]
    box = Sandbox.new(
        f'{policy}\n[[models]]\nname = "{name}"\npath = "{path()}"\nn_threads = 1\n{extra}', label="bench"
    )
    box.start_daemon("--log-level", "warning", timeout=300)
    box.wait_models({name})
    return box


def ask(box: Sandbox, name: str, prompt: str) -> Completion:
    with box.client() as c:
        return c.complete(prompt.encode(), model=name, max_tokens=24, timeout=900).result()


def run(name: str, tok: Tokenizer, agents: int, steps: tuple[str, ...]) -> Trace:
    trace = Trace(MODELS[name][0])
    system = agent_system(tok)
    crowd = [Agent(chr(ord("A") + i), tok, system) for i in range(agents)]
    warm, cold = daemon(WARM, name), daemon(COLD, name)
    try:
        for op in steps:
            for a in crowd:
                prompt = a.step(op)
                w = ask(warm, name, prompt)
                ask(cold, name, f"~{len(trace.pairs)} unrelated")
                trace.pairs.append(Pair(op, w, ask(cold, name, prompt)))
                a.answered(reply_text(w.text))
                progress(
                    f"  {name} {op:<6} {w.route} {w.restored}/{w.prompt_tokens}: {ms(w.client_ttft_ms)}, "
                    f"cold {ms(trace.pairs[-1].cold.client_ttft_ms)}"
                )
        with warm.client() as c:
            trace.refused = c.cache_stats().counters["reuse_refused"]
    finally:
        warm.close()
        cold.close()
    return trace


def table(traces: dict[str, Trace]) -> Table:
    t = Table(
        "Agent trace per memory kind: reuse ratio and time to first token, warm vs cold",
        [
            "model",
            "memory",
            "requests",
            "prompt tokens",
            "reuse ratio",
            "median TTFT warm",
            "cold",
            "faster",
            "sum TTFT warm",
            "cold",
            "reuse_refused",
            "replies identical",
            "paths",
        ],
    )
    for name, tr in traces.items():
        warm = [p.warm.client_ttft_ms for p in tr.pairs]
        cold = [p.cold.client_ttft_ms for p in tr.pairs]
        routes: dict[str, int] = {}
        for p in tr.pairs:
            routes[p.warm.route] = routes.get(p.warm.route, 0) + 1
        t.add(
            name,
            tr.memory,
            len(tr.pairs),
            sum(p.warm.prompt_tokens for p in tr.pairs),
            pct(tr.reuse()),
            ms(median(warm)),
            ms(median(cold)),
            times(median(cold), median(warm)),
            ms(sum(warm)),
            ms(sum(cold)),
            tr.refused,
            f"{tr.identical()}/{len(tr.pairs)}",
            ", ".join(f"{k} {v}" for k, v in sorted(routes.items())),
        )
    return t


def section(
    traces: dict[str, Trace], m: dict, argv: list[str], elapsed: float, agents: int, steps: tuple[str, ...]
) -> str:
    command = " ".join(["python -m bench.memory_kinds", *argv])
    head = [
        "## Memory kinds",
        "",
        f"Generated by `{command}` on {m['date']}, in {elapsed / 60:.1f} min (load average at start: "
        f"{m['load']}); the machine is described at the top. {agents} agents, steps {', '.join(steps)}. "
        "What a Gemma, Mamba or hybrid user can expect, with the rules that keep every warm reply the cold one.",
        "",
    ]
    method = (__doc__ or "").split("Method. ", 1)[1].replace("\n", " ").strip()
    return "\n".join([*head, table(traces).markdown(), "Method: " + method, ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.memory_kinds", description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--steps", choices=("quick", "full"), default="quick")
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md")
    args = p.parse_args(argv)
    steps = QUICK_STEPS if args.steps == "quick" else FULL_STEPS
    m, tok, t0 = machine(), Tokenizer(), time.monotonic()
    traces = {}
    for name in args.models:
        progress(f"{name}: the agent trace on a warm and a cold daemon")
        traces[name] = run(name, tok, args.agents, steps)
    put_section(args.results, SECTION, section(traces, m, argv, time.monotonic() - t0, args.agents, steps))
    from rich.console import Console

    Console(width=220).print(table(traces).rich())
    progress(f"wrote the section '{SECTION}' of {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

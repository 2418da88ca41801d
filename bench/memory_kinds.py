"""The agent trace on one model of each memory kind, warm against cold, with the reuse rules in force.

    python -m bench.memory_kinds [--agents 2] [--steps quick|full] [--rounds 9] [--results bench/RESULTS.md]

Writes (or replaces) the section "Memory kinds" of RESULTS.md, leaving the rest as it is.

Method. Each model runs the agent trace of section 3 (agents share one daemon, n_seq_max 1, and a
900-token system prompt, taking turns; 'append' extends the last prompt, 'insert' changes the history after
the task, 'drop' removes old exchanges), on two daemons side by side: a warm one (policy: min_tokens 256,
cold_min_tokens 256, boundary_align_tokens 256, disk tier) and a cold one that never saves and is flushed
with an unrelated prompt before every request, so each of its replies is a cold prefill. Every prompt goes
to both, warm first; the replies that build the history are the warm daemon's, and each is compared with
the cold daemon's byte for byte (greedy). Prompts are sent as messages with a ChatML template, as an agent's
client sends them, so the daemon knows where each message ends. Halfway through the trace the warm daemon is
restarted (SIGTERM, then started again): the next request has nothing live and must restore from disk.
Reuse ratio is restored over prompt tokens; TTFT is client-side wall time to the first token, over the Unix
socket. Stored bytes are the disk tier's once the trace's saves have landed, per distinct prompt token (the
nodes of the trie of every prompt's token ids), against one state per token: the bytes of the state llama.cpp
writes for a prompt of one token (one cell in every attention layer, and a whole recurrent state), which is
what keeping a state at every token would take at the least. Snapshot cost: the model thread's time taking
boundary snapshots (`snapshot_ns`) over the warm daemon's prefill time; and, on fresh daemons, the median
daemon-side prefill time of an agent's first prompt (a new head each round, so each is a miss that takes a
snapshot at the end of the system prompt) with boundary snapshots, against a daemon that saves nothing,
in alternation (--rounds, 9). Models: SmolLM2-135M Q4_1 (full attention), Gemma 3 270M Q4_K_M (sliding window
512; swa_full on, and off as by default), and the tests' tiny random-weight Mamba (recurrent) and LFM2
(hybrid). All use n_ctx 4096, n_batch 512 (prefill chunk 128) and one thread.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from barrelctl.client import Completion
from barreld.engine import chat
from bench.blocks import Trie, settled_bytes
from bench.harness import Tokenizer, machine, median, model_path, progress
from bench.report import Table, ms, pct, put_section, times
from bench.traces import FULL_STEPS, QUICK_STEPS, Agent, Message, agent_system, chatml, reply_text
from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import gemma_path, tiny_hybrid_path, tiny_recurrent_path

SECTION = "memory_kinds"
WARM = "[policy]\nmin_tokens = 256\ncold_min_tokens = 256\nboundary_align_tokens = 256\n"
COLD = '[policy]\nmin_tokens = "infinity"\n'
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # traces.chatml, as a template
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
    restart_at: int = 0  # the first request after the restart
    prefill_with: float = 0.0  # overhead(): median prefill ms of a miss with boundary snapshots
    prefill_without: float = 0.0  # and on a daemon that saves nothing
    overhead_snapshots: int = 0
    snapshots: int = 0
    snapshot_ms: float = 0.0
    stored: int = 0  # disk tier bytes after the trace
    distinct: int = 0
    state_per_token: int = 0

    def stored_ratio(self) -> float:
        return self.stored / self.distinct / self.state_per_token

    def prefill_ms(self) -> float:
        return sum(p.warm.timings_ms["prefill"] for p in self.pairs)

    def reuse(self) -> float:
        return sum(p.warm.restored for p in self.pairs) / sum(p.warm.prompt_tokens for p in self.pairs)

    def identical(self) -> int:
        return sum(p.warm.text == p.cold.text for p in self.pairs)


def daemon(policy: str, name: str) -> Sandbox:
    box = Sandbox.new(f"{policy}{model_config(name)}", label="bench")
    start(box, name)
    return box


def model_config(name: str) -> str:
    _, path, extra = MODELS[name]
    return f'\n[[models]]\nname = "{name}"\npath = "{path()}"\nn_threads = 1\n{extra}'


def start(box: Sandbox, name: str) -> subprocess.Popen:
    p = box.start_daemon("--log-level", "warning", timeout=300)
    box.wait_models({name})
    return p


def ask(box: Sandbox, name: str, messages: list[Message]) -> Completion:
    with box.client() as c:
        return c.complete(b"", model=name, messages=[chat.Message(r, t) for r, t in messages], chat_template=CHATML,
                          max_tokens=24, timeout=900).result()


def run(name: str, tok: Tokenizer, agents: int, steps: tuple[str, ...]) -> Trace:
    trace = Trace(MODELS[name][0])
    system = agent_system(tok)
    crowd = [Agent(chr(ord("A") + i), tok, system) for i in range(agents)]
    own = ModelFacts(name)
    warm, cold = daemon(WARM, name), daemon(COLD, name)
    proc = warm.procs[-1]
    try:
        for i, op in enumerate(steps):
            if i == len(steps) // 2:
                proc.send_signal(signal.SIGTERM)
                proc.wait(300)
                proc = start(warm, name)
                trace.restart_at = len(trace.pairs)
            for a in crowd:
                a.step(op)
                own.trie.add(own.tokens(chatml(a.history)))
                w = ask(warm, name, a.history)
                ask(cold, name, [("user", f"~{len(trace.pairs)} unrelated")])
                trace.pairs.append(Pair(op, w, ask(cold, name, a.history)))
                a.answered(reply_text(w.text))
                progress(
                    f"  {name} {op:<6} {w.route} {w.restored}/{w.prompt_tokens}: {ms(w.client_ttft_ms)}, "
                    f"cold {ms(trace.pairs[-1].cold.client_ttft_ms)}"
                )
        with warm.client() as c:
            counters = c.cache_stats().counters
            trace.refused = counters["reuse_refused"]
            trace.snapshots, trace.snapshot_ms = counters["boundary_snapshots"], counters["snapshot_ns"] / 1e6
            trace.stored = settled_bytes(c)
        trace.distinct, trace.state_per_token = own.trie.nodes, own.state_per_token
    finally:
        own.close()
        warm.close()
        cold.close()
    return trace


def overhead(name: str, tok: Tokenizer, rounds: int) -> tuple[float, float, int]:
    """Median daemon-side prefill time of an agent's first prompt (a system prompt and a task: a miss),
    on a daemon that takes boundary snapshots and on one that saves nothing, in alternation; and the
    snapshots taken."""
    with_snapshots, without = daemon(WARM, name), daemon(COLD, name)
    times: dict[str, list[float]] = {"with": [], "without": []}
    try:
        for i in range(rounds):
            agent = Agent("A", tok, f"Session {i}. " + agent_system(tok))  # each round a new head: a miss
            agent.step("start")
            for side, box in (("with", with_snapshots), ("without", without))[:: 1 if i % 2 else -1]:
                c = ask(box, name, agent.history)
                assert c.route == "miss", c.route
                times[side].append(c.timings_ms["prefill"])
        with with_snapshots.client() as c:
            taken = c.cache_stats().counters["boundary_snapshots"]
    finally:
        with_snapshots.close()
        without.close()
    return median(times["with"]), median(times["without"]), taken


class ModelFacts:
    """The model's own tokenizer and the bytes of its one-token state, read in this process."""

    def __init__(self, name: str) -> None:
        from barreld.engine.backend import BatchItem, ContextSettings
        from barreld.engine.llama_backend import LlamaBackend

        _, path, extra = MODELS[name]
        self.backend = LlamaBackend(path(), ContextSettings(n_ctx=512, n_threads=1, swa_full="true" in extra))
        first = self.backend.tokenize(b"Hello")[0]
        self.backend.decode([BatchItem(first, 0, 0, True)])
        self.state_per_token = len(self.backend.state_get(0))
        self.trie = Trie()

    def tokens(self, prompt: str) -> list[int]:
        return self.backend.tokenize(prompt.encode())

    def close(self) -> None:
        self.backend.close()


def table(traces: dict[str, Trace]) -> Table:
    t = Table(
        "Agent trace per memory kind: reuse ratio and time to first token, warm vs cold",
        ["model", "memory", "requests", "prompt tokens", "reuse ratio", "x smollm2", "median TTFT warm", "cold",
         "faster", "sum TTFT warm", "cold", "reuse_refused", "replies identical", "paths", "after the restart"],
    )
    base = traces["smollm2"].reuse() if "smollm2" in traces else None
    for name, tr in traces.items():
        warm = [p.warm.client_ttft_ms for p in tr.pairs]
        cold = [p.cold.client_ttft_ms for p in tr.pairs]
        routes: dict[str, int] = {}
        for p in tr.pairs:
            routes[p.warm.route] = routes.get(p.warm.route, 0) + 1
        after = tr.pairs[tr.restart_at].warm
        t.add(
            name,
            tr.memory,
            len(tr.pairs),
            sum(p.warm.prompt_tokens for p in tr.pairs),
            pct(tr.reuse()),
            "" if not base else f"{tr.reuse() / base:.2f}",
            ms(median(warm)),
            ms(median(cold)),
            times(median(cold), median(warm)),
            ms(sum(warm)),
            ms(sum(cold)),
            tr.refused,
            f"{tr.identical()}/{len(tr.pairs)}",
            ", ".join(f"{k} {v}" for k, v in sorted(routes.items())),
            f"{after.route} {after.restored}/{after.prompt_tokens} ({after.tier or '-'})",
        )
    return t


def storage(traces: dict[str, Trace]) -> Table:
    t = Table(
        "Stored bytes per distinct prompt token, and what the boundary snapshots cost",
        ["model", "distinct tokens", "stored (disk)", "per distinct token", "one state per token", "x one state",
         "snapshots", "snapshot time / prefill time", "miss prefill with snapshots / saving nothing"],
    )
    for name, tr in traces.items():
        ab = (f"{tr.prefill_with / tr.prefill_without:.3f} ({ms(tr.prefill_with)} / {ms(tr.prefill_without)}, "
              f"{tr.overhead_snapshots} snapshots)" if tr.prefill_without else "-")
        t.add(
            name,
            tr.distinct,
            f"{tr.stored / 1e6:.1f} MB",
            f"{tr.stored / tr.distinct / 1e3:.1f} KB",
            f"{tr.state_per_token / 1e3:.1f} KB",
            f"{tr.stored_ratio():.2f}",
            tr.snapshots,
            f"{100 * tr.snapshot_ms / tr.prefill_ms():.2f}%" if tr.prefill_ms() else "-",
            ab,
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
    return "\n".join([*head, table(traces).markdown(), storage(traces).markdown(), "Method: " + method, ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.memory_kinds", description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--steps", choices=("quick", "full"), default="quick")
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rounds", type=int, default=9, help="rounds of the snapshot cost's A/B (0: none)")
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md")
    args = p.parse_args(argv)
    steps = QUICK_STEPS if args.steps == "quick" else FULL_STEPS
    m, tok, t0 = machine(), Tokenizer(), time.monotonic()
    traces = {}
    for name in args.models:
        progress(f"{name}: the agent trace on a warm and a cold daemon")
        traces[name] = run(name, tok, args.agents, steps)
        if MODELS[name][0] != "full" and args.rounds:
            progress(f"{name}: a cold prefill with boundary snapshots and with no saves, {args.rounds} rounds")
            tr = traces[name]
            tr.prefill_with, tr.prefill_without, tr.overhead_snapshots = overhead(name, tok, args.rounds)
    put_section(args.results, SECTION, section(traces, m, argv, time.monotonic() - t0, args.agents, steps))
    from rich.console import Console

    Console(width=220).print(table(traces).rich())
    Console(width=220).print(storage(traces).rich())
    progress(f"wrote the section '{SECTION}' of {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prompts that arrive together: four cold prompts sent at once to four sequences, against llama-server -np 4.

    python -m bench.shared_prefill [--rounds 5] [--tokens 1000] [--results bench/RESULTS.md]

Writes (or replaces) the section "shared_prefill" of the results file. Progress goes to stderr.

Method. The bundled SmolLM2 on three servers, same llama.cpp (llama-server is bench.llama_server's build), every
core each, n_ctx 4096 a sequence, n_batch 512, loopback HTTP, `/v1/completions` streamed, greedy, one token a
reply. Each round four prompts of about `--tokens` tokens of random prose (new ones each round, so nothing is
cached; llama-server also gets `cache_prompt: false`) go to a server at once, and the figure is all their
tokens over the time from the first request to the last first token. Servers: barreld as it is (four
sequences; runs of equal length from several sequences share a llama.cpp call where the load-time probe proves
each gets the floats it gets alone, as it does for SmolLM2), barreld with `reuse_grain = 128` (the probe not
run, nothing proven: each sequence's chunk in a call of its own, as every prefill ran before calls were
shared), and llama-server with `-np 4` (its scheduler puts every slot's prompt in one batch). The order rotates
each round, every barreld let go quiet first; a ratio is the median of each round's own ratio to llama-server.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import tempfile
import time
from pathlib import Path

from bench.decode import quiet
from bench.harness import MODEL, Daemon, Tokenizer, begin, median, progress, sse_events
from bench.http import HTTP_CONFIG, http_port
from bench.llama_server import LlamaServer, build
from bench.report import Table, bench_parser, ratio, show_and_put

SECTION = "shared_prefill"
SHARED = "barreld (prefills of equal length share a call)"
APART = "barreld, reuse_grain = 128 (nothing proven: a call each)"
LLAMA = "llama-server -np 4"


def first_tokens(port: int, prompts: list[str], extra: dict[str, object]) -> float:
    """Seconds from sending the prompts at once to the last of their first tokens."""

    def first(prompt: str) -> float:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True, **extra}
        stamps = [time.perf_counter() for _ in sse_events(port, "/v1/completions", body, f"port {port}")]
        if not stamps:
            raise RuntimeError(f"port {port} streamed no token")
        return stamps[0]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return max(pool.map(first, prompts)) - t0


def measure(rounds: int, tokens: int) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    """(tokens/s per server and round, seconds per server and round, prompt tokens a round)."""
    tok, binary = Tokenizer(), build()
    rates: dict[str, list[float]] = {SHARED: [], APART: [], LLAMA: []}
    seconds: dict[str, list[float]] = {name: [] for name in rates}
    with tempfile.TemporaryDirectory(prefix="barrel-bench-shared-") as work, \
            Daemon("shared", config=HTTP_CONFIG, n_seq_max=4) as shared, \
            Daemon("apart", config=HTTP_CONFIG, n_seq_max=4, policy={"reuse_grain": "128"}) as apart:
        server = LlamaServer(Path(work) / "np4", binary, slots=4)
        server.workdir.mkdir()
        server.start()
        try:
            ports = {SHARED: http_port(shared), APART: http_port(apart), LLAMA: server.port}
            extra = {SHARED: {}, APART: {}, LLAMA: {"cache_prompt": False}}
            for name, port in ports.items():
                first_tokens(port, [f"warm up {i}" for i in range(4)], extra[name])
            order, total = list(ports), 0
            for r in range(rounds):
                progress(f"round {r + 1}/{rounds}")
                prompts = [tok.text(tokens, f"shared-{r}-{i}") for i in range(4)]
                total = sum(tok.count(p) for p in prompts)
                for name in order[r % 3 :] + order[: r % 3]:
                    quiet([shared.proc.pid, apart.proc.pid])
                    took = first_tokens(ports[name], prompts, extra[name])
                    seconds[name].append(took)
                    rates[name].append(total / took)
        finally:
            server.stop()
    return rates, seconds, total


def table(rates: dict[str, list[float]], seconds: dict[str, list[float]], total: int) -> Table:
    t = Table(f"Four cold prompts at once, SmolLM2, {total} tokens in all",
              ["server", "prompt tokens/s in all", "vs llama-server", "to the last first token"])
    for name, got in rates.items():
        per_round = median([a / b for a, b in zip(got, rates[LLAMA], strict=True)])
        t.add(name, f"{median(got):.0f}", ratio(per_round, 1.0), f"{median(seconds[name]) * 1000:.0f} ms")
    t.note = (f"Medians of {len(rates[LLAMA])} rounds, the order rotating; a ratio is the median of each round's "
              "own ratio. Each prompt is random prose, new every round, so every prefill is cold.")
    return t


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = bench_parser("bench.shared_prefill", __doc__, SECTION)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=1000)
    args = p.parse_args(argv)
    m, t0 = begin()
    rates, seconds, total = measure(args.rounds, args.tokens)
    show_and_put(table(rates, seconds, total), args.results, SECTION, "Prompts that arrive together",
                 "bench.shared_prefill", argv, t0, m["load"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

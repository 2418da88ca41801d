"""Decode speed against llama-server, side by side in one run, and what OpenMP's wait policy does to it.

    python -m bench.decode [--rounds 7] [--tokens 200] [--results bench/RESULTS.md]

Writes (or replaces) the section "decode" of the results file. Progress goes to stderr.

Method. Three servers of the bundled SmolLM2, same llama.cpp (llama-server is bench.llama_server's build), every
core each, loopback HTTP, `/v1/completions` streamed, greedy, `ignore_eos` so every reply is `--tokens` long:
barreld as it is (its OpenMP defaults, barreld.engine.openmp: llama.cpp's threads spin about 0.1 ms at a barrier,
then sleep), barreld with `OMP_WAIT_POLICY=passive` set as an operator would (its threads then wait as libgomp
throttles them, sleeping at nearly every barrier), and llama-server (libgomp's own wait, with bench.harness's
GOMP_SPINCOUNT). One stream: each server in turn answers one request, `--rounds` times, the order rotating; tokens/s
is the reply's tokens over the time from its first token to its last. Four streams: servers with four sequences
(`n_seq_max 4`; llama-server `-np 4`) answer four requests sent at once, tokens/s is all their tokens over the wall
time from the first request to the last token. Before each measurement every barreld is let go quiet (it settles its
replies while idle, which would slow whichever server came next). Each round then measures the floor, what the
decode alone gives without any server (bench.decode_floor, a child process: barreld's backend in a loop, greedy by
argmax), with flash attention on, as barreld runs SmolLM2 by default (full attention) and llama-server resolves its
`auto` here, and off. A barreld row over its floor row is the part of a token that Python around the decode costs
(the worker, sampling, the HTTP framing). Then each barreld's CPU time over 3 s of idling. Rates are medians over
the rounds; a ratio is the median of each round's ratio to llama-server's figure of the same round, which the
machine's drift (a fifth over minutes here) moves far less than a ratio of medians taken minutes apart.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import MODEL, Daemon, begin, median, progress, sse_events
from bench.http import HTTP_CONFIG, http_port
from bench.llama_server import LlamaServer, build
from bench.report import Table, bench_parser, ratio, show_and_put

SECTION = "decode"
PASSIVE, DEFAULT = "barreld, OMP_WAIT_POLICY=passive", "barreld (default: spin 0.1 ms, then sleep)"
LLAMA = "llama-server"
FLOORS = {"llama.cpp alone, barreld's backend in a loop (flash attention on: barreld's default here, as "
          "llama-server resolves auto)": ["--flash-attn"],
          "llama.cpp alone, the same with flash attention off": []}


@dataclass
class Side:
    name: str
    port: int
    pid: int | None = None
    one: list[float] = field(default_factory=list)  # tokens/s of one stream, per round
    four: list[float] = field(default_factory=list)  # tokens/s of four streams together, per round
    idle_cpu_s: float = float("nan")


def one_stream(port: int, tokens: int, seed: int) -> tuple[float, float, float]:
    """(request sent, first token, last token) of one greedy reply of `tokens` tokens, perf_counter times."""
    body = {"model": MODEL, "prompt": f"Story {seed}: once upon a time, in a small village by the sea,",
            "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    for _ in sse_events(port, "/v1/completions", body, f"port {port}"):
        last = time.perf_counter()
        first = first or last
    return t0, first or t0, last or t0


def rate_one(port: int, tokens: int, seed: int) -> float:
    _, first, last = one_stream(port, tokens, seed)
    return (tokens - 1) / (last - first)


def rate_four(port: int, tokens: int, seed: int) -> float:
    with cf.ThreadPoolExecutor(4) as pool:
        spans = list(pool.map(lambda i: one_stream(port, tokens, seed * 10 + i), range(4)))
    return 4 * tokens / (max(s[2] for s in spans) - min(s[0] for s in spans))


def floor(tokens: int, flags: list[str]) -> tuple[float, float]:
    """(one stream, four streams) tokens/s of bench.decode_floor, in a child process of its own."""
    out = subprocess.run([sys.executable, "-m", "bench.decode_floor", str(tokens), *flags], capture_output=True,
                         text=True, timeout=600, check=True)
    got = json.loads(out.stdout)
    return got["one"], got["four"]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quiet(pids: list[int], timeout: float = 60.0) -> None:
    """Until none of the daemons works (a barreld settles its replies while idle, which would slow the next
    server measured on these shared cores): under 10 ms of CPU each in 0.3 s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = [cpu_seconds(p) for p in pids]
        time.sleep(0.3)
        if all(cpu_seconds(p) - b < 0.01 for p, b in zip(pids, before, strict=True)):
            return


def measure(rounds: int, tokens: int) -> dict[str, Side]:
    binary = build()
    passive = {"OMP_WAIT_POLICY": "passive"}
    with tempfile.TemporaryDirectory(prefix="barrel-bench-decode-") as work, \
            Daemon("decode", config=HTTP_CONFIG) as default1, \
            Daemon("decode-omp", config=HTTP_CONFIG, env=passive) as passive1, \
            Daemon("decode-4", config=HTTP_CONFIG, n_seq_max=4) as default4, \
            Daemon("decode-omp-4", config=HTTP_CONFIG, n_seq_max=4, env=passive) as passive4:
        ls1, ls4 = LlamaServer(Path(work) / "np1", binary), LlamaServer(Path(work) / "np4", binary, slots=4)
        for server in (ls1, ls4):
            server.workdir.mkdir()
            server.start()
        try:
            ones = {DEFAULT: default1, PASSIVE: passive1}
            sides = {name: Side(name, http_port(d), d.proc.pid) for name, d in ones.items()}
            sides[LLAMA] = Side(LLAMA, ls1.port)
            fours = {DEFAULT: http_port(default4), PASSIVE: http_port(passive4), LLAMA: ls4.port}
            for port in [s.port for s in sides.values()] + list(fours.values()):
                rate_one(port, 8, 0)  # warm up
            order = list(sides)
            pids = [d.proc.pid for d in (default1, passive1, default4, passive4)]
            for name in FLOORS:
                sides[name] = Side(name, 0)
            for r in range(rounds):
                progress(f"round {r + 1}/{rounds}")
                for name in order[r % 3:] + order[: r % 3]:
                    quiet(pids)
                    sides[name].one.append(rate_one(sides[name].port, tokens, r))
                    quiet(pids)
                    sides[name].four.append(rate_four(fours[name], tokens, r))
                for name, flags in FLOORS.items():
                    quiet(pids)
                    one, four = floor(tokens, flags)
                    sides[name].one.append(one)
                    sides[name].four.append(four)
            for name in (DEFAULT, PASSIVE):
                time.sleep(2.0)
                before = cpu_seconds(sides[name].pid)
                time.sleep(3.0)
                sides[name].idle_cpu_s = cpu_seconds(sides[name].pid) - before
        finally:
            ls1.stop()
            ls4.stop()
    return sides


def per_round(rates: list[float], llama: list[float]) -> str:
    """The median over rounds of rates[r] / llama[r], as '0.97x'."""
    return ratio(median([a / b for a, b in zip(rates, llama, strict=True)]), 1.0)


def table(sides: dict[str, Side], tokens: int) -> Table:
    ls = sides[LLAMA]
    t = Table(f"Decode, SmolLM2, {tokens} tokens a reply",
              ["server", "one stream, tokens/s", "vs llama-server", "four streams, tokens/s in all", "vs llama-server",
               "CPU over 3 s idle"])
    for s in sides.values():
        idle = "-" if s.pid is None else f"{s.idle_cpu_s:.2f} s"
        t.add(s.name, f"{median(s.one):.1f}", per_round(s.one, ls.one), f"{median(s.four):.1f}",
              per_round(s.four, ls.four), idle)
    t.note = (f"Medians of {len(ls.one)} rounds; a ratio is the median of each round's own ratio, its figures "
              "measured back to back, since this machine's speed drifts by a fifth over minutes. One stream: a "
              "reply's tokens over its first-to-last-token time. Four streams: four requests at once on four "
              "sequences (llama-server -np 4), all tokens over the wall time, the prompts' prefills included. "
              "OpenMP's wait policy changes no float, only when its threads sleep. barreld's default spins "
              "briefly: libgomp's own throttles to 100 spins once a process has two thread pools (the thread "
              "that loaded the model keeps one), and every barrier of a decode then sleeps; unbounded spinning "
              "(OMP_WAIT_POLICY=active alone) starves other busy processes on few cores.")
    return t


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = bench_parser("bench.decode", __doc__, SECTION)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args(argv)
    m, t0 = begin()
    sides = measure(args.rounds, args.tokens)
    tb = table(sides, args.tokens)
    show_and_put(tb, args.results, SECTION, "Decode against llama-server", "bench.decode", argv, t0, m["load"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

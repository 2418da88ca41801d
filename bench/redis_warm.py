"""A 1,500-token warm start from Redis over loopback, against a cold prefill and against the local disk tier, in
the same run: two hosts (two barrelds with their own data dirs) and one private redis-server.

    python -m bench.redis_warm [--tokens 1500] [--reps 5] [--write-results]

Each repetition sends a fresh prompt to host A (a cold prefill; A saves it and its writer pool mirrors it to
Redis), then to host B (which has never seen it: a warm start from Redis, promoted into B's disk tier), then
to host A again (a warm start from A's own disk tier, page cache warm). Before each warm request the host
serves a short unrelated prompt, so its one live sequence holds nothing of the prompt. Time to first token
is the daemon's (`timings_ms.ttft`); bytes are B's Redis reads for its warm request and A's Redis writes for
its mirror, from `cache stats`. With --write-results the table goes into bench/RESULTS.md as its `redis_warm`
section, leaving the rest of the file alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from barreld.names import SAVE_REASONS
from bench.harness import Daemon, Tokenizer, machine, median, progress
from bench.report import Table, frac, ms, put_section, verdict
from tests.support.redis_sandbox import RedisServer

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
TARGET = 20  # warm from Redis at most 1/TARGET of cold


def redis_stats(d: Daemon) -> dict:
    return json.loads(d.client.cache_stats(timeout=30).redis_json)


def mirrored(d: Daemon, timeout: float = 120) -> dict:
    """A's Redis stats once every checkpoint it published has gone to Redis (or failed to)."""
    deadline = time.monotonic() + timeout
    while True:
        counters = d.counters()
        published = sum(counters[f"saves_{reason}"] for reason in SAVE_REASONS)
        r = redis_stats(d)
        if r["mirrors"] + r["mirrors_present"] + r["mirrors_failed"] + r["mirrors_dropped"] >= published:
            return r
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: host A's mirrors did not finish: {r}")
        time.sleep(0.05)


def run(tokens: int, reps: int) -> dict[str, list[float]]:
    tok = Tokenizer()
    prompts = [tok.text(tokens, f"redis-warm-{i}") for i in range(reps)]
    out: dict[str, list[float]] = {k: [] for k in ("cold", "redis", "disk", "read", "written", "tokens")}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer.start())
        config = f'[tiers.redis]\nurl = "{server.url()}"\ntimeout_ms = 5000\n'
        progress("starting hosts A and B")
        a = stack.enter_context(Daemon("A", config=config))
        b = stack.enter_context(Daemon("B", config=config))
        for i, prompt in enumerate(prompts):
            progress(f"prompt {i + 1}/{reps}: cold on A, warm from Redis on B, warm from disk on A")
            written = redis_stats(a)["bytes_written"]
            cold = a.complete(prompt)
            a.wait_stored(cold.key)  # the finish save is async; its mirror follows it on the writer pool
            out["written"].append(mirrored(a)["bytes_written"] - written)
            b.flush_live(i)
            read = redis_stats(b)["bytes_read"]
            warm = b.complete(prompt)
            out["read"].append(redis_stats(b)["bytes_read"] - read)
            a.flush_live(i)
            local = a.complete(prompt)
            if (cold.route, warm.tier, local.tier) != ("miss", "redis", "disk"):
                raise SystemExit(f"bench: unexpected routes: cold {cold.route}, B {warm.tier}, A {local.tier}")
            if warm.text != cold.text or local.text != cold.text:
                raise SystemExit("bench: a warm reply differs from the cold one")
            for name, c in (("cold", cold), ("redis", warm), ("disk", local)):
                out[name].append(c.timings_ms["ttft"])
            out["tokens"].append(cold.prompt_tokens)
    return out


def table(r: dict[str, list[float]], reps: int) -> Table:
    m = machine()
    cold = median(r["cold"])
    t = Table(f"Warm start from Redis, {int(median(r['tokens']))}-token prompt, time to first token "
              f"(daemon's; medians of {reps})",
              ["", "ttft", "/ cold", "target", "", "bytes over the network per request"],
              note=f"{m['cpu']}, {m['cores']} cores, load average {os.getloadavg()[0]:.1f} at the end of the run; "
                   "redis-server on 127.0.0.1 (no persistence), two barrelds on the same machine.")
    t.add("cold prefill (host A)", ms(cold), "1", "", "", "-")
    t.add("warm from Redis (host B's first request)", ms(median(r["redis"])), frac(median(r["redis"]), cold),
          f"<= 1/{TARGET}", verdict(median(r["redis"]) * TARGET <= cold),
          f"{median(r['read']) / 1e6:.1f} MB read by B; {median(r['written']) / 1e6:.1f} MB written by A's mirror")
    t.add("warm from local disk (host A again)", ms(median(r["disk"])), frac(median(r["disk"]), cold), "", "", "0")
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_warm", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--write-results", action="store_true", help=f"write the table into {RESULTS.name}")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    t = table(run(args.tokens, args.reps), args.reps)
    text = "## 7. Several hosts: a warm start from Redis\n\n" + t.markdown() + (
        "\n\nRedis holds rows of blocks (block_tokens 128, the default): B's first request for a prompt it lacks "
        "entirely reads about one state, a host that holds part of it reads only the rest, and a mirror sends only "
        "the blocks Redis lacks; section 9 (`python -m bench.redis_blocks`) measures the bytes per request.\n")
    print(text)
    if args.write_results:
        put_section(RESULTS, "redis_warm", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

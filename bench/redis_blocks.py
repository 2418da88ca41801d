"""Blocks in Redis against whole states: bytes to and from Redis per request on the agent trace, sent
round-robin to two hosts, and the delay from a reply to its finish checkpoint being readable by other hosts.

For each block_tokens (0: whole states; 128: blocks, the default), a private redis-server and two hosts (two
barrelds with their own data dirs; disk tier, stride 256). The agent trace of section 8 (2 agents x start,
append, append, insert, append, drop: 12 prompts, the agents taking turns) goes to host (i // 2) % 2 for
request i, so that each agent's steps alternate between the hosts, as a plain load balancer would send them;
after each request both hosts' mirrors are awaited. Bytes come from `cache stats`: read
by the host that served, written by both. For a remote hit, the bytes of the tokens the local tiers lacked are
(tokens restored - tokens of the blocks read from the local tiers) x one state's bytes per token; bytes
written are set against the distinct prompt tokens (the trie of every prompt) x one state's bytes per token.

Mirror delay: a fresh ~2,000-token prompt goes to host A; from the moment its reply returns, Redis is polled
(every 2 ms) until its finish row is there: the async save's publish, then the mirror behind it.

    python -m bench.redis_blocks [--delays 5] [--write-results]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.blocks import AGENT_STEPS, STATE_BYTES_PER_TOKEN, STRIDE, Trie, agent_prompts, drive  # noqa: E402
from bench.harness import Daemon, Tokenizer, machine, median, progress  # noqa: E402
from bench.redis_warm import mirrored, redis_stats  # noqa: E402
from bench.report import Table, put_section, verdict  # noqa: E402
from bench.traces import reply_text  # noqa: E402
from tests.support.redis_sandbox import RedisServer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "redis_blocks"
CONFIGS = (0, 128)
TARGET = 1.25


def hosts(stack: contextlib.ExitStack, block_tokens: int) -> tuple[RedisServer, Daemon, Daemon]:
    server = stack.enter_context(RedisServer.start())
    config = (f'[tiers.redis]\nurl = "{server.url()}"\ntimeout_ms = 5000\n'
              f"\n[cache]\nblock_tokens = {block_tokens}\n")
    pair = [stack.enter_context(Daemon(f"{name}-{block_tokens}", policy={"boundary_align_tokens": STRIDE},
                                       config=config)) for name in ("A", "B")]
    return server, pair[0], pair[1]


def trace(tok: Tokenizer, block_tokens: int) -> dict:
    """The agent trace round-robin over two hosts: per request, bytes read and written, and for a remote hit
    the tokens the local tiers lacked."""
    rows: list[dict] = []
    trie = Trie()
    with contextlib.ExitStack() as stack:
        _, a, b = hosts(stack, block_tokens)

        def serve(prompt: str) -> str:
            c, row = request((a, b), len(rows) // 2 % 2, prompt, block_tokens)
            rows.append({**row, "distinct": trie.nodes})
            progress(f"  block_tokens {block_tokens}, request {len(rows):2d} on host {'AB'[(len(rows) - 1) // 2 % 2]}: "
                     f"{c.prompt_tokens} tokens, {c.route} ({c.tier}), read {row['read'] / 1e6:.1f} MB, "
                     f"written {row['written'] / 1e6:.1f} MB")
            return reply_text(c.text)

        drive(agent_prompts(tok, 2, AGENT_STEPS), tok, trie, serve)
    return {"block_tokens": block_tokens, "rows": rows}


def request(pair: tuple[Daemon, Daemon], i: int, prompt: str, block_tokens: int):
    """Host i serves the prompt; once both hosts' mirrors are done: the reply and its Redis traffic."""
    before = [redis_stats(h) for h in pair]
    c = pair[i].complete(prompt, max_tokens=24)
    pair[i].wait_stored(c.key)
    after = [mirrored(h) for h in pair]
    served, was = after[i], before[i]
    local = (served["blocks_local"] - was["blocks_local"]) * block_tokens
    return c, {"tokens": c.prompt_tokens, "route": c.route, "tier": c.tier, "restored": c.restored,
               "read": served["bytes_read"] - was["bytes_read"],
               "written": sum(x["bytes_written"] - y["bytes_written"] for x, y in zip(after, before, strict=True)),
               "lacked": max(c.restored - local, 0) if c.tier == "redis" else 0}


def delays(tok: Tokenizer, block_tokens: int, n: int) -> list[float]:
    """Seconds from each reply of a ~2,000-token prompt to its finish row being readable in Redis."""
    out = []
    with contextlib.ExitStack() as stack:
        server, a, _ = hosts(stack, block_tokens)
        admin = stack.enter_context(server.admin())
        for i in range(n):
            c = a.complete(tok.text(2000, f"mirror-delay-{block_tokens}-{i}"), max_tokens=8)
            done = time.monotonic()
            while not admin.exists(f"barrel:{{{c.key}}}:row:{c.key}"):
                if time.monotonic() - done > 60:
                    raise SystemExit("bench: a finish row never reached Redis")
                time.sleep(0.002)
            out.append(time.monotonic() - done)
            progress(f"  block_tokens {block_tokens}: {c.prompt_tokens} tokens, visible after {out[-1] * 1000:.0f} ms")
    return out


def tables(runs: list[dict], waits: dict[int, list[float]]) -> list[Table]:
    m = machine()
    bytes_t = Table("Agent trace round-robin over two hosts: bytes to and from Redis",
                    ["values", "requests", "remote hits", "read per remote hit", "x the tokens lacked", "target",
                     "", "written per request", "written per distinct token", "x one state", "target", ""],
                    note=f"{m['cpu']}, {m['cores']} cores, load average {os.getloadavg()[0]:.1f} at the end; "
                         f"one state = {STATE_BYTES_PER_TOKEN:,} bytes per token (SmolLM2).")
    for r in runs:
        rows = r["rows"]
        hits = [x for x in rows if x["tier"] == "redis"]
        read = sum(x["read"] for x in hits)
        lacked = sum(x["lacked"] for x in hits) * STATE_BYTES_PER_TOKEN
        written = sum(x["written"] for x in rows)
        per_token = written / rows[-1]["distinct"] / STATE_BYTES_PER_TOKEN
        ratio = read / lacked if lacked else float("nan")
        bytes_t.add("whole states" if r["block_tokens"] == 0 else f"blocks of {r['block_tokens']}", str(len(rows)),
                     str(len(hits)), f"{read / max(len(hits), 1) / 1e6:.1f} MB", f"{ratio:.2f}", f"<= {TARGET}",
                     verdict(ratio <= TARGET), f"{written / len(rows) / 1e6:.1f} MB",
                     f"{written / rows[-1]['distinct'] / 1e3:.1f} KB", f"{per_token:.2f}", f"<= {TARGET}",
                     verdict(per_token <= TARGET))
    wait_t = Table("Mirror delay: a reply of a ~2,000-token prompt to its finish row readable in Redis (loopback)",
                   ["values", "median", "max", "target", ""])
    for b, xs in waits.items():
        wait_t.add("whole states" if b == 0 else f"blocks of {b}", f"{median(xs) * 1000:.0f} ms",
                   f"{max(xs) * 1000:.0f} ms", "<= 1 s", verdict(max(xs) <= 1.0))
    return [bytes_t, wait_t]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_blocks", description=__doc__.split("\n\n")[0])
    p.add_argument("--delays", type=int, default=5, help="2,000-token replies timed per setting")
    p.add_argument("--write-results", action="store_true", help=f"write the tables into {RESULTS.name}")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    tok = Tokenizer()
    start = time.monotonic()
    runs = [trace(tok, b) for b in CONFIGS]
    waits = {b: delays(tok, b, args.delays) for b in CONFIGS}
    text = "## 9. Blocks in Redis: bytes per request and the mirror delay\n\n" + "\n\n".join(
        t.markdown() for t in tables(runs, waits)) + (
        f"\n\nRun by `python -m bench.redis_blocks` in {(time.monotonic() - start) / 60:.1f} min. Per request: "
        + "; ".join(f"B={r['block_tokens']}: " + ", ".join(
            f"{x['route']}/{x['tier'] or '-'} {x['read'] / 1e6:.1f}r {x['written'] / 1e6:.1f}w" for x in r["rows"])
            for r in runs) + " (MB read by the serving host, written by both).\n")
    print(text)
    if args.write_results:
        put_section(RESULTS, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

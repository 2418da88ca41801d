"""Concurrent requests: stream gaps while a long prompt prefills, and aggregate throughput.

Run from the repository root: `python -m bench.concurrency` (about three minutes on two cores).

1. Three clients stream tokens while a fourth sends a ~3,000-token prompt. The longest gap between two
   tokens of the streaming clients is measured with prefill chunking on (the default,
   max(64, n_batch // 4)) and with `prefill_chunk_size = infinity`.
2. Aggregate generated tokens per second of four concurrent clients against one client alone.
Ratios are measured in the same run; absolute times depend on this machine.
"""

from __future__ import annotations

import random
import threading
import time

from rich.console import Console
from rich.table import Table

from barrelctl.client import Client, ReplyToken
from tests.support.sandbox import Sandbox

console = Console()
WORDS = "river stone garden window letter morning silver the of and to in a is that for it as was".split()


def text(seed: int, words: int) -> bytes:
    r = random.Random(seed)
    return (f"{seed}: " + " ".join(r.choice(WORDS) for _ in range(words))).encode()


def stream(client: Client, prompt: bytes, max_tokens: int, stamps: list[float]) -> None:
    for ev in client.complete(prompt, max_tokens=max_tokens):
        if isinstance(ev, ReplyToken):
            stamps.append(time.perf_counter())


def longest_gap(chunk: str) -> tuple[float, float]:
    """(longest inter-token gap of the streamers while the long prompt prefilled, that prefill's seconds)."""
    config = (
        f'[policy]\nmin_tokens = "infinity"\nprefill_chunk_size = "{chunk}"\n'
        '\n[[models]]\nname = "smollm2"\nn_seq_max = 4\n'
    )
    with Sandbox.new(config, label="bench") as w:
        w.start_daemon()
        client = w.client()
        stamps: list[list[float]] = [[] for _ in range(3)]
        streamers = [threading.Thread(target=stream, args=(client, text(i, 20), 400, stamps[i])) for i in range(3)]
        for t in streamers:
            t.start()
        while min(len(s) for s in stamps) < 5:
            time.sleep(0.01)
        t0 = time.perf_counter()
        long_stamps: list[float] = []
        stream(client, text(99, 2300), 1, long_stamps)
        t1 = long_stamps[0]
        for t in streamers:
            t.join()
        gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if t0 <= b and a <= t1]
        return max(gaps), t1 - t0


def throughput(clients: int, tokens: int = 64) -> float:
    config = f'[policy]\nmin_tokens = "infinity"\n\n[[models]]\nname = "smollm2"\nn_seq_max = {clients}\n'
    with Sandbox.new(config, label="bench") as w:
        w.start_daemon()
        client = w.client()
        stamps: list[list[float]] = [[] for _ in range(clients)]
        threads = [
            threading.Thread(target=stream, args=(client, text(50 + i, 30), tokens, stamps[i])) for i in range(clients)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(len(s) for s in stamps) / (time.perf_counter() - t0)


def main() -> None:
    with console.status("stream gaps with chunked prefill…"):
        gap_on, pre_on = longest_gap("auto")
    with console.status("stream gaps with prefill_chunk_size = infinity…"):
        gap_off, pre_off = longest_gap("infinity")
    with console.status("throughput, 1 client…"):
        one = throughput(1)
    with console.status("throughput, 4 clients…"):
        four = throughput(4)
    t = Table(title="Concurrent requests (n_seq_max 4, n_batch 512, SmolLM2-135M Q4_1, 2 cores)")
    for col in ("measure", "value"):
        t.add_column(col)
    t.add_row("longest stream gap, chunked prefill (128 tokens/tick)", f"{gap_on * 1000:.0f} ms")
    t.add_row("longest stream gap, prefill_chunk_size = infinity", f"{gap_off * 1000:.0f} ms")
    t.add_row("gap ratio chunked / unchunked (target <= 0.2)", f"{gap_on / gap_off:.3f}")
    t.add_row("3,000-token prefill alongside streams: chunked / unchunked", f"{pre_on:.1f} s / {pre_off:.1f} s")
    t.add_row("aggregate tokens/s, 1 client", f"{one:.1f}")
    t.add_row("aggregate tokens/s, 4 clients", f"{four:.1f}")
    t.add_row("4 clients / 1 client (target >= 2)", f"{four / one:.2f}x")
    console.print(t)


if __name__ == "__main__":
    main()

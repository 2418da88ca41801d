"""Put and get of one object through RedisStore, over loopback to a private redis-server, next to the plain
redis client's SET and GET of the same bytes (what the header, checksum and verification add).

    python -m bench.redis_roundtrip [--sizes 1M,35M] [--reps 9]

Each repetition writes a fresh key with fresh random bytes, then reads it back; figures are medians in
milliseconds, with the fastest and slowest beside them. 35 MB is one whole-state checkpoint of the bundled
model at about 1,500 tokens. Run on a quiet machine: a busy one moves these times a lot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

from barreld.cache.remote.redis import RedisStore
from barreld.cache.remote.settings import RedisSettings
from barreld.sizes import format_size, parse_size
from bench.harness import machine, progress
from bench.report import Table
from tests.support.redis_sandbox import RedisServer


def timed(reps: int, op: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        op()
        out.append((time.perf_counter() - start) * 1000)
    return out


def cell(ms: list[float]) -> str:
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}–{max(ms):.1f})"


def measure(server: RedisServer, size: int, reps: int) -> list[list[float]]:
    """[store put, store get, client SET, client GET] times of `reps` fresh objects of `size` bytes."""
    store = RedisStore(RedisSettings(server.url(), timeout_ms=10_000))
    client = server.admin()
    payload = os.urandom(size)
    keys = [os.urandom(32) for _ in range(reps)]
    it = iter(keys)
    put = timed(reps, lambda: store.put("block", next(it), payload))
    it = iter(keys)
    get = timed(reps, lambda: store.get_many("block", [next(it)]))
    assert store.stats()["hits"] == reps, store.stats()
    it = iter(keys)
    raw_set = timed(reps, lambda: client.set(next(it), payload))
    it = iter(keys)
    raw_get = timed(reps, lambda: client.get(next(it)))
    store.close()
    client.flushall()
    return [put, get, raw_set, raw_get]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_roundtrip", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,35M", help="comma-separated SIZEs (default 1M,35M)")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    m = machine()
    table = Table(f"RedisStore over loopback, ms: median (min–max) of {args.reps}",
                  ["object", "store put", "store get", "client SET", "client GET"],
                  note=f"{m['cpu']}, {m['cores']} cores; redis-server on 127.0.0.1, no persistence.")
    with RedisServer.start() as server:
        for size in (parse_size(s) for s in args.sizes.split(",")):
            progress(f"{format_size(size)} x {args.reps}")
            table.add(format_size(size), *(cell(t) for t in measure(server, size, args.reps)))
    print(table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

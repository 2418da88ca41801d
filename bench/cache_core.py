"""Bench the cache core on a realistic checkpoint (35 MB of KV state: ~1,500 tokens of SmolLM2).

For each tier it prints save throughput (sync: checksum, write, fdatasync, publish, index) next to a
plain write+fdatasync of the same bytes into the same directory, and verified-restore throughput (read
into one buffer, xxh3_128 over every byte, decode, recompute the key) next to a plain `open().read()` of
the very same file. Each pair is interleaved so both sides see the same page cache and memory state.
Acceptance: a verified restore from the page cache reaches at least 0.5x the plain read.

On a VM whose guest memory is backed lazily, writes into never-touched pages run several times slower
than into recycled ones; the plain-write column shows which case a run hit.

    python -m bench.cache_core [--size-mb 35] [--repeat 9] [--data-dir DIR] [--json]

The disk tier lives in --data-dir (default: a temp dir under $TMPDIR, so put that on the disk you
mean to measure); ram_file under /dev/shm. Everything it creates is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from barreld.cache import (
    CacheStore,
    Checkpoint,
    CtxParams,
    KeyScheme,
    TierConfig,
    encoded_size,
)
from barreld.names import TIER_NAMES

SCHEME = KeyScheme(b"\x07" * 32, "Q4_1", CtxParams(1, 1, 1, False, 10000.0, 1.0, True, False).encode())
N_TOKENS = 1500
N_VOCAB = 49152


def plain_write(path: Path, data: bytes) -> float:
    """What a save is up against: the same bytes, written and fdatasync'd, no checksum, no index."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def plain_read(path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        f.read()
    return time.perf_counter() - t0


def mb_per_s(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e6


def timed_restore(store: CacheStore, key: bytes) -> float:
    t0 = time.perf_counter()
    hit = store.lookup(key)
    assert hit is not None
    with store.restore(hit) as ckpt:
        elapsed = time.perf_counter() - t0
        assert ckpt is not None and len(ckpt.state) > 0
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=35.0, help="KV state size in MB (10^6 bytes)")
    ap.add_argument("--repeat", type=int, default=9, help="saves and restores per tier (median reported)")
    ap.add_argument("--data-dir", type=Path, default=None, help="where the disk tier goes")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    args = ap.parse_args()

    state = os.urandom(int(args.size_mb * 1e6))
    logits = os.urandom(N_VOCAB * 4)
    tokens = list(range(N_TOKENS))
    work = Path(tempfile.mkdtemp(prefix="barrel-bench-", dir=args.data_dir))
    shm = Path(tempfile.mkdtemp(prefix="barrel-bench-", dir="/dev/shm"))
    quota = (args.repeat + 2) * (len(state) + (1 << 20))
    store = CacheStore(
        work / "data",
        {name: TierConfig(quota, shm / "rf" if name == "ram_file" else None) for name in TIER_NAMES},
    ).open()
    results = {}
    try:
        for tier in TIER_NAMES:
            saves, writes, keys = [], [], []
            for i in range(args.repeat):
                rendered = f"{tier} {i}".encode()
                ckpt = Checkpoint.build(SCHEME, "bench", rendered, tokens, "cold", state, logits)
                t0 = time.perf_counter()
                assert store.save(ckpt, tier, sync=True).status == "published"
                saves.append(time.perf_counter() - t0)
                keys.append(ckpt.key)
                location = store.dump(tier=tier)[0]["location"]
                if location is not None:  # kept, like the saves, so both land on equally fresh memory
                    writes.append(plain_write(Path(location).parent / f"plain-{i}", state))
            size = encoded_size(ckpt)
            restores, reads = [], []
            timed_restore(store, keys[0])  # warm up: first touch of the allocator's pages
            for _ in range(args.repeat):
                restores.append(timed_restore(store, keys[0]))
                if location is not None:
                    reads.append(plain_read(location))
            results[tier] = {
                "file_bytes": size,
                "save_MBps": round(mb_per_s(size, saves), 1),
                "plain_write_MBps": round(mb_per_s(len(state), writes), 1) if writes else None,
                "restore_MBps": round(mb_per_s(size, restores), 1),
                "plain_read_MBps": round(mb_per_s(size, reads), 1) if reads else None,
                "restore_ms": round(statistics.median(restores) * 1e3, 2),
                "save_ms": round(statistics.median(saves) * 1e3, 2),
            }
            if reads:
                results[tier]["restore_vs_read"] = round(mb_per_s(size, restores) / mb_per_s(size, reads), 2)
        counters = store.stats()["counters"]
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    ok = all(r.get("restore_vs_read", 1.0) >= 0.5 for r in results.values())
    if args.json:
        doc = {"tiers": results, "pass": ok, "corrupt_files": counters["corrupt_files"]}
        print(json.dumps(doc, indent=2))
    else:
        print(
            f"checkpoint: {args.size_mb:g} MB state + {N_TOKENS} tokens + {N_VOCAB} logits; median of "
            f"{args.repeat}; disk tier under {work.parent}"
        )
        print(
            f"{'tier':9} {'file MB':>8} {'save MB/s':>10} {'save ms':>8} {'plain write MB/s':>17} "
            f"{'restore MB/s':>13} {'restore ms':>10} {'plain read MB/s':>16} {'restore/read':>13}"
        )
        for tier, r in results.items():
            plain = "-" if r["plain_read_MBps"] is None else f"{r['plain_read_MBps']:.0f}"
            write = "-" if r["plain_write_MBps"] is None else f"{r['plain_write_MBps']:.0f}"
            ratio = "-" if "restore_vs_read" not in r else f"{r['restore_vs_read']:.2f}x"
            print(
                f"{tier:9} {r['file_bytes'] / 1e6:8.1f} {r['save_MBps']:10.0f} {r['save_ms']:8.1f} "
                f"{write:>17} {r['restore_MBps']:13.0f} {r['restore_ms']:10.2f} {plain:>16} {ratio:>13}"
            )
        print("verified restore >= 0.5x plain read (page cache):", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

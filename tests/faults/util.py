"""Helpers shared by the fault tests: the client of the real daemon, quick readiness, cache probes.

The tests call the daemon in-process through barrelctl's client (a barrelctl process costs ~0.5 s of
interpreter start-up, too much for hundreds of calls) and run barrelctl where the operator's surface
itself is under test.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import time
from pathlib import Path

from barrelctl.client import Client, Completion
from barreld.rpc import barrel_pb2 as pb
from tests.support.sandbox import Sandbox

# Checkpoints as chains of 128-token blocks (the prefill chunk at n_batch 512), shared between the rows of
# one prompt and its continuations.
BLOCKS = """
[cache]
block_tokens = 128
"""
# Small gates so ~300-token prompts save: cold at 256 tokens, continued every 8 generated, finish.
POLICY = """
[policy]
min_tokens = 128
cold_min_tokens = 128
boundary_trim_tokens = 16
boundary_align_tokens = 128
continued_interval = 8
""" + BLOCKS
# One checkpoint per prompt (its finish save): no cold or continued saves beside it.
ONE_SAVE_POLICY = """
[policy]
min_tokens = 128
cold_min_tokens = 1000000
continued_interval = "infinity"
boundary_align_tokens = 128
"""
NO_SAVES = '\n[policy]\nmin_tokens = "infinity"\n'
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there would their we him been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may then do "
    "river stone garden window letter morning silver harbour lantern meadow"
).split()


def model_config(n_seq_max: int = 1, tier: str = "disk") -> str:
    """Load the bundled model at start, so the first request does not pay for it."""
    return f'\n[[models]]\nname = "smollm2"\ntier = "{tier}"\nn_seq_max = {n_seq_max}\n'


def configure(w: Sandbox, text: str, ram_file_quota: str | None = None) -> None:
    """Sandbox.write_config, with a quota in the [tiers.ram_file] table it opens (TOML allows one)."""
    quota = f'quota = "{ram_file_quota}"\n' if ram_file_quota else ""
    w.write_config(quota + text)


def doc(i: int, n_words: int) -> bytes:
    """A deterministic prompt of about n_words tokens that shares no head with another i."""
    r = random.Random(i)
    return (f"Document {i}: " + " ".join(r.choice(WORDS) for _ in range(n_words))).encode()


def start(w: Sandbox, *args: str, module: str = "barreld", timeout: float = 90, pin: bool = True) -> subprocess.Popen:
    """Start barreld (or `python -m tests.faultd` with its hook flags in `args`) and wait until it answers.

    `pin` keeps the daemon on one CPU (its threads, created later, inherit that): llama.cpp runs one thread
    per usable core and its spinning barriers crawl when other processes hold those cores, as on a shared
    2-core test machine (a 2-token warm-up decode measured 5-8 s instead of 15 ms).
    """
    proc = w.start_daemon(*args, wait=False, module=module)
    if pin:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, {max(os.sched_getaffinity(0))})
    w.wait_ready(proc, timeout)
    return proc


def stop(w: Sandbox, proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM and wait for the clean exit the contract promises."""
    assert w.stop(proc, timeout) == 0


def complete(c: Client, prompt: bytes, max_tokens: int = 8, timeout: float = 300, **kw) -> Completion:
    return c.complete(prompt, max_tokens=max_tokens, timeout=timeout, **kw).result()


def counters(c: Client) -> dict[str, int]:
    return dict(c.cache_stats(timeout=30).counters)


def rows(c: Client) -> list[pb.CacheRow]:
    return c.cache_dump(timeout=30)


def verify(c: Client) -> tuple[int, list[str]]:
    result = c.cache_verify(timeout=120)
    return result.checked, list(result.bad)


def tier_roots(w: Sandbox) -> dict[str, Path]:
    return {"disk": w.data_dir / "kvc", "ram_file": w.shm}


def temp_files(*roots: Path) -> list[Path]:
    """FileTier's temp names (barreld/cache/tiers.py: `.tmp-<pid>-<hex>`)."""
    return [p for root in roots if root.exists() for p in root.iterdir() if p.name.startswith(".tmp-")]


def kvc_files(root: Path) -> dict[str, Path]:
    """Published checkpoint files by key."""
    return {p.stem: p for p in root.glob("*.kvc")} if root.exists() else {}


def wait_for(pred, timeout: float = 30, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def assert_consistent(w: Sandbox, s: Client, roots: dict[str, Path] | None = None) -> list[pb.CacheRow]:
    """A quiet cache agrees with its files: verify finds nothing bad, every row is available, unreferenced,
    and its file is where it says with its size; every published file has a row; no temp file is left."""
    checked, bad = verify(s)
    assert bad == [], f"cache verify found bad rows: {bad}"
    got = rows(s)
    assert checked == len(got)
    for r in got:
        assert r.status == "available", (r.key, r.status)
        assert r.refcount == 0, (r.key, r.refcount)
        if r.tier != "ram":
            assert Path(r.location).stat().st_size == r.size, r.key
    roots = roots or tier_roots(w)
    for tier, root in roots.items():
        indexed = {r.key for r in got if r.tier == tier}
        assert set(kvc_files(root)) == indexed, f"{tier}: files without rows or rows without files"
        blocks = len(list(root.glob("*.kvb"))) if root.exists() else 0
        named = [r.blocks for r in got if r.tier == tier]
        assert (blocks > 0) == any(named) and max(named, default=0) <= blocks <= sum(named), (tier, blocks, named)
    assert temp_files(*roots.values()) == []
    return got

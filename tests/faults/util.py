"""Helpers shared by the fault tests: a gRPC client of the real daemon, quick readiness, cache probes.

The tests talk gRPC directly (a barrelctl process costs ~0.5 s of interpreter start-up, too much for
hundreds of calls) and use barrelctl where the operator's surface itself is under test.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from barreld.rpc import barrel_pb2 as pb
from barreld.rpc import barrel_pb2_grpc as pb_grpc
from tests.conftest import World

# Small gates so ~300-token prompts save: cold at 256 tokens, continued every 8 generated, finish.
POLICY = """
[policy]
min_tokens = 128
cold_min_tokens = 128
boundary_trim_tokens = 16
boundary_align_tokens = 128
continued_interval = 8
"""
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


def configure(w: World, text: str, ram_file_quota: str | None = None) -> None:
    """World.write_config, with a quota in the [tiers.ram_file] table it opens (TOML allows one)."""
    quota = f'quota = "{ram_file_quota}"\n' if ram_file_quota else ""
    w.write_config(quota + text)


def doc(i: int, n_words: int) -> bytes:
    """A deterministic prompt of about n_words tokens that shares no head with another i."""
    r = random.Random(i)
    return (f"Document {i}: " + " ".join(r.choice(WORDS) for _ in range(n_words))).encode()


def stub(w: World) -> pb_grpc.BarrelStub:
    return pb_grpc.BarrelStub(grpc.insecure_channel(f"unix:{w.socket}"))


def start(w: World, *, env: dict[str, str] | None = None, timeout: float = 90, pin: bool = True) -> subprocess.Popen:
    """Start barreld and wait until it answers a status RPC (faster than polling with barrelctl).

    Each poll uses a fresh channel: a channel that failed to connect waits out a reconnect backoff.
    `pin` keeps the daemon on one CPU (its threads, created later, inherit that): llama.cpp runs one thread
    per usable core and its spinning barriers crawl when other processes hold those cores, as on a shared
    2-core test machine (a 2-token warm-up decode measured 5-8 s instead of 15 ms).
    """
    proc = w.start_daemon(wait=False, env=env)
    if pin:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(proc.pid, {max(os.sched_getaffinity(0))})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"barreld exited with {proc.returncode}:\n{w.log_text()[-4000:]}")
        if w.socket.exists():
            with grpc.insecure_channel(f"unix:{w.socket}") as ch:
                try:
                    if pb_grpc.BarrelStub(ch).DaemonStatus(pb.DaemonStatusRequest(), timeout=2).pid == proc.pid:
                        return proc
                except grpc.RpcError:
                    pass
        time.sleep(0.05)
    raise AssertionError(f"barreld not ready after {timeout}s:\n{w.log_text()[-4000:]}")


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM and wait for the clean exit the contract promises."""
    proc.terminate()
    assert proc.wait(timeout) == 0


@dataclass
class Reply:
    text: bytes
    key: str
    prompt_key: str
    path: str
    restored: int
    tier: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def complete(s: pb_grpc.BarrelStub, prompt: bytes, max_tokens: int = 8, timeout: float = 300, **kw) -> Reply:
    done = None
    for ev in s.Complete(pb.CompleteRequest(prompt=prompt, max_tokens=max_tokens, **kw), timeout=timeout):
        if ev.WhichOneof("event") == "done":
            done = ev.done
    assert done is not None, "the stream ended without a Done event"
    return Reply(
        done.text,
        done.key,
        done.prompt_key,
        done.cache.path,
        done.cache.restored_tokens,
        done.cache.tier,
        done.finish_reason,
        done.prompt_tokens,
        done.completion_tokens,
    )


def counters(s: pb_grpc.BarrelStub) -> dict[str, int]:
    return dict(s.CacheStats(pb.CacheStatsRequest(), timeout=30).counters)


def rows(s: pb_grpc.BarrelStub) -> list[pb.CacheRow]:
    return list(s.CacheDump(pb.CacheDumpRequest(), timeout=30).rows)


def verify(s: pb_grpc.BarrelStub) -> tuple[int, list[str]]:
    result = [
        ev.result for ev in s.CacheVerify(pb.CacheVerifyRequest(), timeout=120) if ev.WhichOneof("event") == "result"
    ]
    assert len(result) == 1
    return result[0].checked, list(result[0].bad)


def tier_roots(w: World) -> dict[str, Path]:
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


def assert_consistent(w: World, s: pb_grpc.BarrelStub, roots: dict[str, Path] | None = None) -> list[pb.CacheRow]:
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
    assert temp_files(*roots.values()) == []
    return got

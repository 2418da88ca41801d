"""A separate process for the crash and restart tests. Run as a script:

child.py loop  DATA RF_ROOT SEED         save forever (async and sync, every tier, whole states and chains of
                                        blocks sharing prefixes), gc, evict, restore;
                                        prints "open", then "pub <tier> <key hex>" per acknowledged sync
                                        save and "gc" before each gc. The parent SIGKILLs it.
child.py save  DATA RF_ROOT close|exit   save one checkpoint per tier, print "<tier> <key hex>", then
                                        close the store, or exit without closing it.
child.py hold  DATA RF_ROOT              open the store, print "open", keep it open until stdin closes.
child.py gcdie DATA RF_ROOT N            save N checkpoints to disk, print "gc", run a gc and SIGKILL
                                        itself right after the gc deletes its first file.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path

from barreld.cache import CacheStore, Checkpoint, CtxParams, KeyScheme, TierConfig, stateformat
from barreld.names import MEMORY_TIERS, TIER_NAMES
from tests.cache import synthstate

SCHEME = KeyScheme(b"\x42" * 32, "Q8_0", CtxParams(1, 1, 1, True, 10000.0, 1.0, True, False).encode())
DISK_QUOTA = 1 << 20
RAM_FILE_QUOTA = 48 << 10
DISK_SAVES_PER_LIFE = 60  # at most ~210 KB: a life never fills the disk tier the parent keeps under 40%
BLOCK_TOKENS = 8
LAYERS = (synthstate.Layer(1, 16, 1, 16),)


def open_store(data: str, rf_root: str) -> CacheStore:
    return CacheStore(
        Path(data),
        {
            "ram": TierConfig(64 << 10),
            "ram_file": TierConfig(RAM_FILE_QUOTA, Path(rf_root)),
            "disk": TierConfig(DISK_QUOTA),
        },
        writers=2,
        queue_size=4,
        block_tokens=BLOCK_TOKENS,
    ).open()


def checkpoint(rendered: bytes, state: bytes) -> Checkpoint:
    return Checkpoint.build(
        SCHEME,
        "crash-model",
        rendered,
        list(range(len(rendered))),
        "cold",
        state,
        logits=bytes(8),
        prefixes=[(SCHEME.key(rendered[:-1]), len(rendered) - 1)],
    )


def chained(rendered: bytes, rng: random.Random) -> Checkpoint:
    """A checkpoint stored as blocks: its KV depends on the position only and its tokens share a prefix with
    many others (they differ from a random point on), so rows share some blocks and not others."""
    n = rng.randrange(BLOCK_TOKENS, 60)
    fork = rng.randrange(0, n)
    tokens = list(range(fork)) + [rng.randrange(3) for _ in range(n - fork)]
    kv = synthstate.Kv("attention", 1, False, 0, LAYERS, tuple(range(n)), 5)
    state = synthstate.build(0, [kv]).data
    ckpt = Checkpoint.build(SCHEME, "crash-model", rendered, tokens, "cold", state, logits=bytes(8),
                            prefixes=[(SCHEME.key(rendered[:-1]), n - 1)])
    ckpt.layout = stateformat.parse(state, stateformat.StateSpec.for_memory("full")).shape
    return ckpt


def loop(data: str, rf_root: str, seed: int) -> None:
    store = open_store(data, rf_root)
    print("open", flush=True)
    rng = random.Random(seed)
    disk_saves = 0
    for i in range(1, 1 << 30):
        tiers = TIER_NAMES if disk_saves < DISK_SAVES_PER_LIFE else MEMORY_TIERS
        tier = rng.choice(tiers)
        rendered = f"{seed}:{i}".encode()
        if rng.random() < 0.5:
            ckpt = chained(rendered, rng)
        else:
            ckpt = checkpoint(rendered, rng.randbytes(rng.randrange(64, 3000)))
        r = rng.random()
        if r < 0.03:
            print("gc", flush=True)
            store.gc()
        elif r < 0.08:
            store.evict_bytes(rng.randrange(1, 8000), ["ram_file"])
        elif r < 0.15:
            hit = store.lookup(SCHEME.key(f"{seed}:{rng.randrange(1, i + 1)}".encode()))
            if hit is not None:
                with store.restore(hit) as got:
                    assert got is not None
        else:
            disk_saves += tier == "disk"
            if r < 0.5:
                store.save(ckpt, tier)
            elif store.save(ckpt, tier, sync=True, timeout=30).status == "published":
                print(f"pub {tier} {ckpt.key.hex()}", flush=True)


def save_each(data: str, rf_root: str, how: str) -> None:
    store = open_store(data, rf_root)
    for tier in TIER_NAMES:
        ckpt = checkpoint(f"restart {tier}".encode(), tier.encode() * 1000)
        assert store.save(ckpt, tier, sync=True, timeout=30).status == "published"
        print(tier, ckpt.key.hex(), flush=True)
    if how == "close":
        store.close()
    else:
        os._exit(0)  # no close: no writer flush, no LMDB close, ram rows left behind in the index


def hold(data: str, rf_root: str) -> None:
    store = open_store(data, rf_root)
    print("open", flush=True)
    sys.stdin.read()
    store.close()


def gc_die(data: str, rf_root: str, n: int) -> None:
    store = open_store(data, rf_root)
    for i in range(n):
        ckpt = checkpoint(f"doomed {i}".encode(), bytes(100))
        assert store.save(ckpt, "disk", sync=True, timeout=30).status == "published"
    disk = store.tier("disk")
    delete = disk.delete

    def delete_then_die(location: str) -> None:
        delete(location)
        os.kill(os.getpid(), signal.SIGKILL)

    disk.delete = delete_then_die  # type: ignore[method-assign]
    print("gc", flush=True)
    store.gc()


if __name__ == "__main__":
    mode, data, rf_root, *rest = sys.argv[1:]
    if mode == "loop":
        loop(data, rf_root, int(rest[0]))
    elif mode == "save":
        save_each(data, rf_root, rest[0])
    elif mode == "gcdie":
        gc_die(data, rf_root, int(rest[0]))
    else:
        hold(data, rf_root)

"""Hosts for the remote tier's tests: cache stores (separate data dirs) on one test Redis, and the waits a test
needs around the mirror that runs on the writer pool."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from barreld.cache import CacheStore, Checkpoint, TierConfig
from barreld.cache.remote.redis import RedisStore
from barreld.cache.remote.settings import RedisSettings
from barreld.cache.remote.tier import RemoteTier
from tests.support.redis_sandbox import RedisServer

MiB = 1 << 20
Host = Callable[..., CacheStore]


@pytest.fixture
def host(tmp_path: Path, shm_root: Path, redis_server: RedisServer) -> Iterator[Host]:
    """Opens a cache store named `name` (its own data dir and ram_file root) on the test's Redis."""
    opened: list[CacheStore] = []

    def make(name: str, url: str | None = None, block_tokens: int = 0, **settings: object) -> CacheStore:
        """`block_tokens` 0 mirrors whole states; more, rows of blocks."""
        remote = RemoteTier(RedisStore(RedisSettings(url or redis_server.url(), **settings),  # type: ignore[arg-type]
                                       backoff_s=(0.05, 0.2)))
        tiers = {"ram": TierConfig(8 * MiB), "ram_file": TierConfig(8 * MiB, shm_root / name),
                 "disk": TierConfig(8 * MiB)}
        store = CacheStore(tmp_path / name, tiers, block_tokens=block_tokens, remote=remote).open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def mirrored(store: CacheStore) -> int:
    s = store.remote.stats()
    return s["mirrors"] + s["mirrors_failed"] + s["mirrors_present"]


def publish(store: CacheStore, ckpt: Checkpoint, tier: str = "disk", prefixes: tuple = ()) -> None:
    """Save, and wait for the mirror behind it: the writer pool runs it after the publish."""
    before = mirrored(store)
    assert store.save(ckpt, tier, prefixes, sync=True).status == "published"
    deadline = time.monotonic() + 10
    while mirrored(store) == before:
        assert time.monotonic() < deadline, "the mirror never ran"
        time.sleep(0.01)


def restored(store: CacheStore, key: bytes, promote_to: str | None = "disk") -> Checkpoint | None:
    """Probe the remote for `key` and restore what it finds; the checkpoint's bytes are copied out."""
    [hit] = store.lookup_remote([key])
    if hit is None:
        return None
    with store.restore(hit, promote_to=promote_to) as ckpt:
        if ckpt is None:
            return None
        return Checkpoint(**{**ckpt.__dict__, "state": bytes(ckpt.state), "logits": bytes(ckpt.logits or b"")})

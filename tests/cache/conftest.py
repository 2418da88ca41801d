"""Fixtures for the cache core tests: private /dev/shm roots and small stores."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from barreld.cache import CacheStore, Checkpoint, CtxParams, KeyScheme, TierConfig
from tests.cache.remote_hosts import host  # noqa: F401  (a fixture: cache stores as hosts on the test's Redis)

SCHEME = KeyScheme(
    fingerprint=bytes(range(32)),
    quant="Q4_1",
    ctx_params=CtxParams(1, 1, 1, False, 10000.0, 1.0, True, False).encode(),
)


def flip_byte(path: str, at: int) -> None:
    """Damages a file in place: one bit of the byte at `at` flipped."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def make_ckpt(
    rendered: bytes,
    state_len: int = 1000,
    *,
    reason: str = "cold",
    prefixes: tuple[tuple[bytes, int], ...] = (),
    logits: bool = True,
) -> Checkpoint:
    """A checkpoint of `rendered` with a deterministic state derived from the prompt."""
    seed = int.from_bytes(SCHEME.key(rendered)[:4], "little")
    period = bytes((seed + i * 7) & 0xFF for i in range(256))  # the sequence repeats every 256 bytes
    state = (period * (state_len // 256 + 1))[:state_len]
    tokens = list(range(1, max(2, len(rendered)) + 1))
    return Checkpoint.build(
        SCHEME,
        "test-model",
        rendered,
        tokens,
        reason,
        state,
        logits=b"\x00\x00\x80\x3f" * 4 if logits else None,
        prefixes=prefixes,
    )


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A private directory under /dev/shm, removed after the test."""
    path = Path(tempfile.mkdtemp(prefix=f"barrel-test-{os.getpid()}-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store_factory(tmp_path: Path, shm_root: Path) -> Iterator[Callable[..., CacheStore]]:
    """Open stores on this test's data dir; every store opened here is closed afterwards."""
    opened: list[CacheStore] = []

    def make(ram: int = 1 << 20, ram_file: int = 1 << 20, disk: int = 1 << 20, **kw: int) -> CacheStore:
        store = CacheStore(
            tmp_path / "data",
            {
                "ram": TierConfig(ram),
                "ram_file": TierConfig(ram_file, shm_root / "rf"),
                "disk": TierConfig(disk),
            },
            **kw,
        ).open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(store_factory: Callable[..., CacheStore]) -> CacheStore:
    return store_factory()

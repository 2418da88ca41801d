"""The engine in-process over FakeBackend and a real CacheStore (LMDB and tier files in a temp dir)."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from barreld.cache import CacheStore, SaveOutcome, TierConfig
from barreld.cache.index import Reservation
from barreld.engine.backend import BatchItem, ContextSettings
from barreld.engine.policy import Policy
from barreld.engine.registry import LoadedModel, LoadOptions, ModelRegistry, ReuseCheck
from barreld.engine.request import CompletionParams, Done, Failed, Request, Started, Token
from barreld.engine.sampling import SamplingParams
from tests.fakes.backend import EOG, FakeBackend, write_gguf

POLICY = Policy(
    min_tokens=8,
    cold_min_tokens=16,
    cold_max_tokens="infinity",
    continued_interval="infinity",
    boundary_trim_tokens=2,
    boundary_align_tokens=16,
    session_resume_wait_ms=5000,
    evict_save_timeout_ms=5000,
    prefill_chunk_size=8,
    settle_tokens=0,  # settling races the next request: the tests that are about it turn it on
    snapshot_gap_tokens=16,
)
CHUNK = 8
OPTIONS = {"n_ctx": 256, "n_batch": 64, "flash_attn": False}  # the fake's flash attention splits every batch
EVENT_TIMEOUT = 10.0
PLAIN = b"xzqkjv0123456789#%&"
"""Bytes that start and end no multi-byte piece: text made of them is one token per byte."""

WORDS = b"the cat and a dog to world hello is on in it at the er ing ab cd abc tion".split()


def plain(n_tokens: int, seed: int) -> bytes:
    """A prompt of exactly n_tokens tokens (BOS and n_tokens - 1 single-byte ones)."""
    r = random.Random(seed)
    return bytes(r.choice(PLAIN) for _ in range(n_tokens - 1))


def prose(n_words: int, seed: int) -> bytes:
    """Text rich in multi-byte pieces, ending on a byte no piece ends with."""
    r = random.Random(seed)
    return b" ".join(r.choice(WORDS) for _ in range(n_words)) + b"!"


@dataclass
class Reply:
    started: Started | None = None
    streamed: bytes = b""
    streamed_logprobs: tuple = ()  # the Token events' entries, in order
    done: Done | None = None
    error: Exception | None = None

    @property
    def text(self) -> bytes:
        assert self.done is not None, f"request failed: {self.error!r}"
        return self.done.text

    @property
    def route(self) -> str:
        assert self.started is not None, f"request failed: {self.error!r}"
        return self.started.cache.route.value


def collect(req: Request) -> Reply:
    """Every event of a request up to Done or Failed; a silent worker fails the test, never hangs it."""
    reply = Reply()
    while True:
        ev = req.events.get(timeout=EVENT_TIMEOUT)
        if isinstance(ev, Started):
            reply.started = ev
        elif isinstance(ev, Token):
            reply.streamed += ev.text
            reply.streamed_logprobs += ev.logprobs
        elif isinstance(ev, Done):
            reply.done = ev
            return reply
        elif isinstance(ev, Failed):
            reply.error = ev.error
            return reply


def completion(prompt: bytes, params: dict[str, object]) -> CompletionParams:
    """CompletionParams from keywords, the sampler's among them (temperature=, seed=, top_k=, ...)."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    sampling = SamplingParams(**{k: v for k, v in params.items() if k in names})
    return CompletionParams(prompt, sampling=sampling, **{k: v for k, v in params.items() if k not in names})


class Engine:
    """A registry over FakeBackend and one store; `cold` answers from a fresh registry with no store, and
    `restarted` is another registry on the same store and model file."""

    def __init__(self, root: Path, store: CacheStore, max_queue: int = 4, model_file: Path | None = None,
                 reuse_probe: ReuseCheck | None = None) -> None:
        self.root = root
        self.store = store
        self.model_file = model_file or write_gguf(root / "fake.gguf")
        self.reuse_probe = reuse_probe
        self.registry = ModelRegistry(store, POLICY, max_queue=max_queue, backend_factory=FakeBackend,
                                      reuse_probe=reuse_probe)
        self.options: dict[str, dict] = {}
        self.restarts: list[Engine] = []

    def load(self, name: str = "m", **opts: object) -> LoadedModel:
        self.options[name] = {**OPTIONS, **opts}
        return self.registry.load(name, LoadOptions(path=self.model_file, **self.options[name]))

    def backend(self, name: str = "m") -> FakeBackend:
        backend = self.registry.get(name).worker.backend
        assert isinstance(backend, FakeBackend)
        return backend

    def submit(self, prompt: bytes, name: str = "m", **params: object) -> Request:
        params.setdefault("max_tokens", 12)
        return self.registry.get(name).worker.submit(completion(prompt, params))

    def run(self, prompt: bytes, name: str = "m", **params: object) -> Reply:
        return collect(self.submit(prompt, name, **params))

    def cold(self, prompt: bytes, name: str = "m", **params: object) -> Reply:
        """The reply a cold prefill gives: a new registry, no store, no live sequence, and this engine's reuse
        probe (whose verdict decides how a lone prefill groups its chunks into calls)."""
        other = ModelRegistry(None, POLICY, backend_factory=FakeBackend, reuse_probe=self.reuse_probe)
        try:
            other.load(name, LoadOptions(path=self.model_file, **self.options[name]))
            params.setdefault("max_tokens", 12)
            return collect(other.get(name).worker.submit(completion(prompt, params)))
        finally:
            other.close()

    def wait_settled(self, name: str = "m") -> None:
        """Until the model's idle sequences hold their replies as prefilled tokens (settled while idle)."""
        worker = self.registry.get(name).worker
        wait_until(lambda: not worker.settling)

    def restarted(self, settle: bool = True) -> Engine:
        """Another registry on the same store and model file, by default once every save so far is
        published: no live sequences, every checkpoint kept, as after a restart."""
        assert isinstance(self.store, WatchedStore)
        if settle:
            self.store.settle()
        other = Engine(self.root, self.store, model_file=self.model_file, reuse_probe=self.reuse_probe)
        self.restarts.append(other)
        for name, opts in self.options.items():
            other.load(name, **opts)
        return other

    def rows(self, reason: str | None = None) -> list[dict]:
        """The store's rows once every save so far is published, oldest first."""
        assert isinstance(self.store, WatchedStore)
        self.store.settle()
        rows = [r for r in self.store.dump() if reason is None or r["save_reason"] == reason]
        return sorted(rows, key=lambda r: r["created"])

    def counter(self, name: str) -> int:
        return self.store.counters.snapshot()[name]

    def close(self) -> None:
        for other in self.restarts:
            other.close()
        self.registry.close()


class WatchedStore(CacheStore):
    """A real store that keeps its async saves' futures, so a test can wait for them, and can hold its
    writers before they publish, so a save stays in flight while a test looks."""

    def __init__(self, root: Path, block_tokens: int = 0) -> None:
        super().__init__(
            root / "data",
            {
                "ram": TierConfig(64 << 20),
                "ram_file": TierConfig(64 << 20, root / "ram_file"),
                "disk": TierConfig(64 << 20, root / "disk"),
            },
            block_tokens=block_tokens,
        )
        self.futures: list[Future] = []
        self.publishing = threading.Event()
        self.publishing.set()

    def save(self, *args: Any, **kwargs: Any) -> SaveOutcome:
        outcome = super().save(*args, **kwargs)
        if outcome.future is not None:
            self.futures.append(outcome.future)
        return outcome

    def open(self) -> WatchedStore:
        super().open()
        reserve = self.index.reserve

        def held(*args: Any, **kwargs: Any) -> Reservation:  # the writer's first step
            if not self.publishing.wait(EVENT_TIMEOUT):
                raise AssertionError("publishing held too long; a test forgot to set it")
            return reserve(*args, **kwargs)

        self.index.reserve = held  # type: ignore[method-assign]
        return self

    def settle(self) -> None:
        for fut in list(self.futures):
            fut.result(EVENT_TIMEOUT)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[WatchedStore]:
    s = WatchedStore(tmp_path).open()
    yield s
    s.publishing.set()
    s.close()


@pytest.fixture
def engine(tmp_path: Path, store: CacheStore) -> Iterator[Engine]:
    e = Engine(tmp_path, store)
    e.load()
    yield e
    e.close()


def greedy(
    model_file: Path, tokens: list[int], max_tokens: int = 12, n_ctx: int = OPTIONS["n_ctx"]
) -> tuple[list[int], bytes]:
    """The tokens and text a cold prefill of exactly these tokens generates at temperature 0, computed on a
    bare backend with the engine's chunk boundaries: the reference the engine's replies are held to."""
    be = FakeBackend(model_file, ContextSettings(n_ctx=n_ctx, n_batch=n_ctx))
    for start in range(0, len(tokens), CHUNK):
        end = min(start + CHUNK, len(tokens))
        be.decode([BatchItem(tokens[i], i, 0, i == end - 1) for i in range(start, end)])
    logits, out = be.logits(end - start - 1), []
    logits[sorted(EOG)] = -np.inf  # a reply has at least one token
    while True:
        out.append(int(np.argmax(logits)))
        if be.is_eog(out[-1]) or len(out) == max_tokens or len(tokens) + len(out) >= n_ctx:
            return out, b"".join(be.piece(t) for t in out if not be.is_eog(t))
        be.decode([BatchItem(out[-1], len(tokens) + len(out) - 1, 0, True)])
        logits = be.logits(0)


def wait_until(check: Callable[[], bool], timeout: float = EVENT_TIMEOUT) -> None:
    """Polls `check` until it is true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)

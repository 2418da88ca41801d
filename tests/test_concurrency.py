"""Several sequences in one context: concurrent clients, a bounded queue, warm turns with n_seq_max=2."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.sandbox import Sandbox
from tests.test_cache_paths import POLICY, complete, counters, doc

pytestmark = pytest.mark.model


def with_model(n_seq_max: int, extra: str = "") -> str:
    # Flash attention off: with it a decode batch of four rows takes other kernels than a batch of one, and four
    # concurrent greedy replies part from the sequential ones sooner (2 of 4 kept their first two words here).
    return POLICY + extra + f'\n[[models]]\nname = "smollm2"\nn_seq_max = {n_seq_max}\nflash_attn = false\n'


def model_state(w: Sandbox) -> dict:
    return w.ctl("--json", "models").json()["models"][0]


def wait_idle(w: Sandbox, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = model_state(w)
        if (m["running"], m["queued"]) == (0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_four_clients_at_once_get_the_replies_they_would_get_alone() -> None:
    """Batches mixing sequences take other kernel paths than one sequence alone, so replies
    may drift after a while; they must start as the sequential replies do and be complete."""
    prompts = [doc(700 + i, 300) for i in range(4)]
    with Sandbox.new(with_model(1)) as w:
        w.start_daemon()
        alone = [complete(w, p) for p in prompts]
    with Sandbox.new(with_model(4)) as w:
        w.start_daemon()
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: complete(w, p), prompts))
        for t in together:
            assert t["finish_reason"] == "length" and t["tokens"]["completion"] == 12
            assert t["cache"]["path"] == "miss" and t["text"].strip().isprintable()
        same_start = sum(a["text"].split()[:2] == t["text"].split()[:2] for a, t in zip(alone, together, strict=True))
        assert same_start >= 3
        c = counters(w)
        assert c["misses"] == 4 and c["saves_finish"] == 4
        assert len({r["key"] for r in w.ctl("--json", "cache", "dump").json()["rows"]}) >= 4
        assert model_state(w)["live"] == 4
        # Each prompt again, all at once: each is served warm from its own live sequence.
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda p: complete(w, p), prompts))
        assert [a["cache"]["path"] for a in again] == ["live"] * 4
        assert all(a["cache"]["restored_tokens"] > 0 and a["tokens"]["completion"] == 12 for a in again)
        assert sum(a["text"].split()[:2] == t["text"].split()[:2] for a, t in zip(again, together, strict=True)) >= 3


def test_queue_bound_answers_resource_exhausted() -> None:
    with Sandbox.new(with_model(1, "\n[daemon]\nmax_queue = 1\n")) as w:
        w.start_daemon()
        long = [w.ctl_popen("complete", doc(800 + i, 200), "--max-tokens", "400") for i in range(2)]
        time.sleep(1.5)   # one running, one queued
        r = w.ctl("complete", "one too many", "--max-tokens", "2")
        assert r.rc == 1, r.err
        assert "queued" in r.err and len(r.err.strip().splitlines()) == 1
        for p in long:
            p.kill()
        m = wait_idle(w)
        assert (m["running"], m["queued"]) == (0, 0)


def test_two_sequences_three_conversations_every_later_turn_is_warm() -> None:
    with Sandbox.new(with_model(2)) as w:
        w.start_daemon()
        history = {c: doc(900 + c, 560) for c in range(3)}
        paths = []
        for turn in range(3):
            for c in range(3):
                got = complete(w, history[c])
                if turn > 0:
                    paths.append(got["cache"]["path"])
                    assert got["cache"]["restored_tokens"] > 0
                history[c] += got["text"] + f" Turn {turn} question for conversation {c}?"
        assert set(paths) <= {"live", "exact", "resume", "longest_prefix"}
        assert "live" in paths or counters(w)["saves_evict"] + counters(w)["saves_finish"] > 0
        assert len(paths) == 6


def test_disconnects_while_queued_and_mid_stream_free_their_places(world: Sandbox) -> None:
    world.write_config(with_model(1))
    world.start_daemon()
    client = world.client()
    running = client.complete(doc(1000, 200).encode(), max_tokens=2000)
    next(iter(running))                                    # started: it holds the only sequence
    queued = client.complete(doc(1001, 200).encode(), max_tokens=2000)
    deadline = time.monotonic() + 10
    while model_state(world)["queued"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert model_state(world)["queued"] == 1
    queued.cancel()
    running.cancel()
    m = wait_idle(world)
    assert (m["running"], m["queued"]) == (0, 0)
    log = world.log_text()
    assert "cancelled by its client while queued" in log and "cancelled by its client after" in log
    assert json.loads(world.ctl("--json", "complete", "after", "--max-tokens", "2").out)["tokens"]["completion"] >= 1

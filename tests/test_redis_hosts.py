"""Two real barreld processes (two hosts: separate data dirs) and one real redis-server, with the real model.

Host B's first request for a prompt host A served is a warm restore from tier "redis", and replies as a
cold prefill does at temperature 0 (a third daemon, saving nothing, is the cold reference). Then Redis
fails in every way it can; every reply still equals the cold one, both daemons keep serving, and no local
row is lost. The daemons are shared by the module's tests and the prompts kept short (~400 tokens).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from barreld.names import SAVE_REASONS
from tests.support.redis_sandbox import ClusterSandbox, RedisServer
from tests.support.sandbox import Sandbox
from tests.test_cache_paths import NO_SAVES, POLICY, complete, doc

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer.start() as server:
        yield server


def host(redis: RedisServer | ClusterSandbox, label: str) -> Sandbox:
    box = Sandbox.new(POLICY + f'\n[tiers.redis]\nurl = "{redis.url()}"\ntimeout_ms = 300\n', label=label)
    box.start_daemon()
    return box


@contextlib.contextmanager
def two_hosts(server: RedisServer | ClusterSandbox) -> Iterator[tuple[Sandbox, Sandbox]]:
    """Hosts A and B (two daemons, two data dirs) on one Redis server or cluster."""
    a, b = host(server, "host-a"), host(server, "host-b")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def cold_host() -> Iterator[Sandbox]:
    """A daemon that saves nothing: every reply a cold prefill."""
    with Sandbox.new(NO_SAVES, label="cold") as w:
        w.start_daemon()
        yield w


@pytest.fixture(scope="module")
def hosts(redis: RedisServer) -> Iterator[tuple[Sandbox, Sandbox]]:
    with two_hosts(redis) as pair:
        yield pair


@pytest.fixture(scope="module")
def cold() -> Iterator[Sandbox]:
    with cold_host() as w:
        yield w


def remote(w: Sandbox) -> dict:
    stats = w.ctl("--json", "cache", "stats").json()
    return {**stats["redis"], "published": sum(stats["counters"][f"saves_{r}"] for r in SAVE_REASONS)}


def settle(w: Sandbox, reply: dict) -> dict:
    """Until the reply's finish checkpoint is published (an async save), and every checkpoint the host
    published has been mirrored (or its mirror failed or was dropped)."""
    deadline = time.monotonic() + 60
    while True:
        r = remote(w)
        done = r["mirrors"] + r["mirrors_present"] + r["mirrors_failed"] + r["mirrors_dropped"] >= r["published"]
        if done and reply["key"] in local_rows(w):
            return r
        assert time.monotonic() < deadline, r
        time.sleep(0.1)


def served(w: Sandbox, cold: Sandbox, prompt: str) -> dict:
    """`prompt`'s reply on w, asserted equal to the cold reference's."""
    complete(w, "Zebras flush the context.", "--max-tokens", "2")  # nothing live shares a head with the prompt
    got = complete(w, prompt)
    assert got["text"] == reference(cold, prompt)["text"], got["cache"]
    return got


_REFERENCES: dict[tuple[str, str], dict] = {}


def reference(cold: Sandbox, prompt: str) -> dict:
    """The cold daemon's reply to `prompt`, asked once: a cold prefill at temperature 0 replies the same every
    time, and the hosts ask for most prompts twice."""
    key = (str(cold.base), prompt)
    if key not in _REFERENCES:
        complete(cold, "Zebras flush the context.", "--max-tokens", "2")
        ref = _REFERENCES[key] = complete(cold, prompt)
        assert ref["cache"]["path"] == "miss"
    return _REFERENCES[key]


def local_rows(w: Sandbox) -> set[str]:
    return {r["key"] for r in w.ctl("--json", "cache", "dump").json()["rows"]}


def test_host_b_warm_starts_from_host_a_through_redis(hosts: tuple[Sandbox, Sandbox], cold: Sandbox) -> None:
    warm_starts(*hosts, cold)


def warm_starts(a: Sandbox, b: Sandbox, cold: Sandbox) -> None:
    """Host B's first request for A's prompt restores it from Redis (exact), and for A's prompt extended
    (longest prefix); every reply equals the cold one."""
    prompt = doc(1, 330)
    reply = served(a, cold, prompt)
    assert reply["cache"]["path"] == "miss"
    settle(a, reply)
    first = served(b, cold, prompt)
    assert first["cache"]["tier"] == "redis" and first["cache"]["path"] == "exact", first["cache"]
    assert first["cache"]["restored_tokens"] > 256
    settle(b, first)  # the promotion (and B's finish save) are B's own checkpoints now
    again = served(b, cold, prompt)
    assert again["cache"]["tier"] != "redis" and again["cache"]["restored_tokens"] > 256

    head = doc(2, 330)
    settle(a, served(a, cold, head))
    extended = served(b, cold, head + " and then, far from the river, a letter came in the morning")
    assert extended["cache"]["tier"] == "redis" and extended["cache"]["path"] == "longest_prefix", extended["cache"]

    r = remote(b)
    assert r["reachable"] and r["hits"] == 2 and r["bytes_read"] > 1 << 20 and r["rtt_ms"] is not None
    dump = b.ctl("--json", "cache", "dump", "--tier", "redis").json()["rows"]
    assert dump and all(row["tier"] == "redis" for row in dump)
    table = b.ctl("cache", "stats")
    assert table.rc == 0 and "reachable" in table.out and "yes" in table.out


def test_a_short_prefix_of_a_long_row_restores_from_its_first_blocks_alone(
    hosts: tuple[Sandbox, Sandbox], cold: Sandbox
) -> None:
    """A's row holds 4 whole blocks; B's prompt shares only its first 256 tokens: B fetches the 2 blocks that
    cover them (no tail, no logits, no later block), and replies as cold."""
    a, b = hosts
    words = doc(3, 500)
    settle(a, served(a, cold, words))
    before = remote(b)
    # a tail of more than 64 tokens after the shared part: with flash attention (min_batch 64, spans) a warm
    # start leaves that many to the prompt's end
    got = served(b, cold, " ".join(words.split()[:280]) + " and then, far from the river, a letter came. " + doc(9, 80))
    assert (got["cache"]["path"], got["cache"]["tier"], got["cache"]["restored_tokens"]) == (
        "longest_prefix", "redis", 256), got["cache"]
    assert remote(b)["blocks_fetched"] - before["blocks_fetched"] == 2


@pytest.mark.faults
def test_every_redis_fault_is_a_cold_reply_and_no_local_row_is_lost(
    hosts: tuple[Sandbox, Sandbox], cold: Sandbox, redis: RedisServer
) -> None:
    a, b = hosts
    admin = redis.admin

    def shared(i: int) -> tuple[str, dict]:
        prompt = doc(10 + i, 330)
        settle(a, served(a, cold, prompt))
        return prompt, remote(b)

    # A value overwritten with other bytes: a corrupt miss on B.
    prompt, before = shared(0)
    for name in admin().keys("barrel:*:ckpt:*"):
        admin().set(name, b"\0" * admin().strlen(name))
    assert served(b, cold, prompt)["cache"]["path"] == "miss"
    assert remote(b)["misses"]["corrupt"] > before["misses"]["corrupt"]

    # FLUSHALL: every key vanished.
    prompt, before = shared(1)
    admin().flushall()
    assert served(b, cold, prompt)["cache"]["path"] == "miss"

    # A paused server beyond timeout_ms: B waits out one timeout, then serves cold.
    prompt, before = shared(2)
    redis.pause()
    try:
        assert served(b, cold, prompt)["cache"]["path"] == "miss"
    finally:
        redis.resume()
    assert remote(b)["errors"]["timeout"] > before["errors"]["timeout"]

    # Killed mid-run: both daemons keep serving and count the errors; warm restores resume when it is back.
    rows_a, rows_b = local_rows(a), local_rows(b)
    redis.kill()
    for i, w in enumerate((a, b)):
        assert served(w, cold, doc(20 + i, 330))["cache"]["path"] == "miss"
    assert remote(a)["errors"]["refused"] + remote(a)["errors"]["connection"] > 0
    assert not remote(b)["reachable"]
    redis.restart()
    deadline = time.monotonic() + 30
    while not remote(b)["reachable"] or not remote(a)["reachable"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    prompt, _ = shared(3)
    assert served(b, cold, prompt)["cache"]["tier"] == "redis"

    # A tiny maxmemory with allkeys-lru while A writes: whatever B finds is right, the rest is a miss.
    admin().config_set("maxmemory-policy", "allkeys-lru")
    admin().config_set("maxmemory", int(admin().info("memory")["used_memory"]) + (40 << 20))
    for i in range(4, 6):
        prompt, _ = shared(i)
        assert served(b, cold, prompt)["cache"]["path"] in ("exact", "miss", "longest_prefix")
    assert local_rows(a) >= rows_a and local_rows(b) >= rows_b
    for w in (a, b):
        assert w.ctl("--json", "cache", "verify").json()["bad"] == []

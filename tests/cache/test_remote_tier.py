"""The remote tier over a real redis-server: two cache stores (two hosts: separate data dirs) share one Redis.

Mirror on the writer pool, probe in one round trip, fetch and verify, promote into the local tier; and each
way Redis can fail or lie is a counted miss, never an exception, never a wrong checkpoint, never a lost
local row.
"""

from __future__ import annotations

import time

import pytest

from barreld.cache.remote.redis import ROW_KIND, Ref
from barreld.cache.remote.tier import ALIAS_KIND, CKPT_KIND
from tests.cache.conftest import SCHEME, make_ckpt
from tests.cache.remote_hosts import Host, publish, restored
from tests.support.redis_sandbox import RedisServer


def test_host_b_restores_host_a_checkpoint_and_promotes_it(host: Host) -> None:
    a, b = host("a"), host("b")
    ckpt = make_ckpt(b"a prompt that host A prefilled", 50_000)
    publish(a, ckpt)
    assert b.lookup(ckpt.key) is None
    got = restored(b, ckpt.key)
    assert got is not None and got.state == bytes(ckpt.state) and list(got.tokens) == list(ckpt.tokens)
    b.pending(ckpt.key).result(10)  # the promotion: an ordinary async save into the model's tier
    hit = b.lookup(ckpt.key)
    assert hit is not None and hit.tier == "disk"
    stats = b.stats()["redis"]
    assert stats["hits"] == 1 and stats["reachable"] and stats["bytes_read"] > 50_000
    assert a.stats()["redis"]["bytes_written"] > 50_000
    assert a.check() == [] and b.check() == []


def test_a_prefix_alias_finds_the_row_in_the_same_round_trip(host: Host, redis_server: RedisServer) -> None:
    a, b = host("a"), host("b")
    prefix = SCHEME.key(b"a shared head")
    ckpt = make_ckpt(b"a shared head, then a long tail", 10_000, prefixes=((prefix, 5),))
    publish(a, ckpt)
    trips = b.remote.store.stats()["round_trips"]
    hits = b.lookup_remote([SCHEME.key(b"never seen"), prefix, SCHEME.key(b"nor this")])
    assert b.remote.store.stats()["round_trips"] == trips + 1
    assert hits[0] is None and hits[2] is None
    assert hits[1] is not None and (hits[1].row_key, hits[1].n_tokens, hits[1].tier) == (ckpt.key, 5, "redis")
    with b.restore(hits[1]) as got:
        assert got is not None and got.key == ckpt.key
    # Parts and row share the row's hash slot; the alias lives under its own key, which a reader knows.
    names = {n for n in redis_server.admin().keys("barrel:*")}
    assert b.remote.store.name(Ref(ALIAS_KIND, prefix)) in names
    assert b.remote.store.name(Ref(CKPT_KIND, ckpt.key, ckpt.key)) in names


def test_a_row_already_in_redis_is_not_sent_again(host: Host) -> None:
    a, b = host("a"), host("b")
    ckpt = make_ckpt(b"written once", 20_000)
    publish(a, ckpt)
    restored(b, ckpt.key)
    b.pending(ckpt.key).result(10)
    deadline = time.monotonic() + 10
    while b.remote.stats()["mirrors_present"] == 0:  # B's promotion published, and its mirror found it there
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert b.remote.stats()["bytes_written"] == 0


def test_a_read_only_host_reads_but_never_writes(host: Host, redis_server: RedisServer) -> None:
    reader = host("r", write=False)
    assert reader.save(make_ckpt(b"local only", 5000), "disk", sync=True).status == "published"
    reader.close()  # drains the writer pool: no mirror was queued
    assert redis_server.admin().dbsize() == 0
    a, b = host("a"), host("b", write=False)
    ckpt = make_ckpt(b"from a writer", 5000)
    publish(a, ckpt)
    assert restored(b, ckpt.key) is not None


def test_a_key_flushed_between_probe_and_fetch_is_a_miss(host: Host, redis_server: RedisServer) -> None:
    a, b = host("a"), host("b")
    ckpt = make_ckpt(b"flushed away", 5000)
    publish(a, ckpt)
    [hit] = b.lookup_remote([ckpt.key])
    assert hit is not None
    redis_server.admin().flushall()
    with b.restore(hit, promote_to="disk") as got:
        assert got is None
    assert b.stats()["redis"]["misses"]["missing"] == 1
    assert b.lookup(ckpt.key) is None and a.lookup(ckpt.key) is not None  # A's own row is untouched


@pytest.mark.parametrize("damage", ["overwritten", "truncated", "row_overwritten"])
def test_damaged_values_are_misses_and_are_removed(host: Host, redis_server: RedisServer, damage: str) -> None:
    a, b = host("a"), host("b")
    ckpt = make_ckpt(b"damaged in redis", 5000)
    publish(a, ckpt)
    admin = redis_server.admin()
    part = b.remote.store.name(Ref(CKPT_KIND, ckpt.key, ckpt.key))
    row = b.remote.store.name(Ref(ROW_KIND, ckpt.key))
    if damage == "overwritten":
        admin.set(part, b"x" * admin.strlen(part))
    elif damage == "truncated":
        admin.set(part, admin.get(part)[:-100])
    else:
        admin.set(row, b"other bytes")
    assert restored(b, ckpt.key) is None
    assert b.stats()["redis"]["misses"]["corrupt"] + b.stats()["redis"]["misses"]["absent"] >= 1
    assert not admin.exists(part if damage != "row_overwritten" else row)  # deleted: a writer may replace it
    publish(a, make_ckpt(b"another", 5000))  # A still writes, and still holds its own row
    assert a.lookup(ckpt.key) is not None


def test_a_killed_server_is_a_fast_miss_and_restores_resume_when_it_is_back(
    host: Host, redis_server: RedisServer
) -> None:
    a, b = host("a", timeout_ms=300), host("b", timeout_ms=300)
    ckpt = make_ckpt(b"before the crash", 5000)
    publish(a, ckpt)
    redis_server.kill()
    start = time.monotonic()
    for _ in range(20):
        assert b.lookup_remote([ckpt.key]) == [None]
    assert time.monotonic() - start < 2  # the backoff refuses at once instead of waiting out each timeout
    stats = b.stats()["redis"]
    assert stats["misses"]["unreachable"] == 20 and stats["errors"]["refused"] >= 1 and not stats["reachable"]
    later = make_ckpt(b"written while redis is away", 5000)
    assert a.save(later, "disk", sync=True).status == "published"  # the local publish does not wait for Redis
    redis_server.restart()  # empty, on the same port
    deadline = time.monotonic() + 10
    while not all(host.stats()["redis"]["reachable"] for host in (a, b)):  # each host's backoff passes on its own
        assert time.monotonic() < deadline
        time.sleep(0.05)
    publish(a, make_ckpt(b"after the restart", 5000))
    assert restored(b, make_ckpt(b"after the restart", 5000).key) is not None
    assert a.lookup(ckpt.key) is not None and a.lookup(later.key) is not None


def test_a_paused_server_times_out_into_a_miss(host: Host, redis_server: RedisServer) -> None:
    a, b = host("a"), host("b", timeout_ms=200)
    ckpt = make_ckpt(b"paused", 5000)
    publish(a, ckpt)
    redis_server.pause()
    try:
        start = time.monotonic()
        assert b.lookup_remote([ckpt.key]) == [None]
        assert time.monotonic() - start < 2
    finally:
        redis_server.resume()
    assert b.stats()["redis"]["errors"]["timeout"] >= 1


def test_tiny_maxmemory_with_lru_evicts_while_barrel_writes(host: Host, redis_server: RedisServer) -> None:
    admin = redis_server.admin()
    admin.config_set("maxmemory-policy", "allkeys-lru")
    admin.config_set("maxmemory-samples", 10)  # near-true LRU: the newest rows keep all their parts
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + 600_000)
    a, b = host("a"), host("b")
    ckpts = [make_ckpt(b"evicted or not %d" % i, 60_000) for i in range(20)]
    for c in ckpts:
        publish(a, c)
    served = 0
    for c in ckpts:
        got = restored(b, c.key, promote_to=None)
        if got is not None:
            assert got.state == bytes(c.state)
            served += 1
    assert 0 < served < len(ckpts)  # Redis evicted some: each of those a miss, never a wrong state
    assert all(a.lookup(c.key) is not None for c in ckpts) and a.check() == []


def test_evict_takes_the_least_recently_used_row_first(host: Host, redis_server: RedisServer) -> None:
    """Redis's idle clock decides the order; reading the rows to list them must not reset it first."""
    a = host("a")
    ckpts = [make_ckpt(b"lru row %d" % i, 10_000) for i in range(3)]
    for c in ckpts:
        publish(a, c)
    time.sleep(2.2)  # Redis keeps idle time in whole seconds
    redis_server.admin().get(a.remote.store.name(Ref(ROW_KIND, ckpts[0].key)))  # the oldest row, read again
    assert a.remote.evict(1)[0] == 1
    left = {r["key"] for r in a.remote.dump()}
    assert left == {ckpts[0].key.hex(), ckpts[2].key.hex()}  # the second row was the least recently used


def test_dump_evict_and_gc_act_on_barrels_keys_only(host: Host, redis_server: RedisServer) -> None:
    a = host("a")
    admin = redis_server.admin()
    admin.set("not-barrel", b"kept")
    ckpts = [make_ckpt(b"row %d" % i, 10_000, prefixes=((SCHEME.key(b"row"), 1),)) for i in range(4)]
    for c in ckpts:
        publish(a, c)
    rows = a.remote.dump()
    assert {r["key"] for r in rows} == {c.key.hex() for c in ckpts}
    assert all(r["tier"] == "redis" and r["size"] > 10_000 and r["tokens"] == len(c.tokens) for r, c in
               zip(sorted(rows, key=lambda r: r["key"]), sorted(ckpts, key=lambda c: c.key.hex()), strict=True))
    assert a.remote.dump({SCHEME.fingerprint: "local-name"})[0]["model"] == "local-name"
    assert a.remote.dump({bytes(32): "other"}) == []
    evicted, freed = a.remote.evict(1)
    assert evicted == 1 and freed > 10_000 and len(a.remote.dump()) == 3
    assert a.remote.gc() == 3
    assert admin.keys("*") == [b"not-barrel"]
    assert all(a.lookup(c.key) is not None for c in ckpts)  # the local rows stay

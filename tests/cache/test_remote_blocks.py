"""Blocks in Redis: a remote row names content-addressed blocks as a local row does. A mirror sends only the
blocks Redis lacks, a restore fetches only those the local tiers lack, and a block that is gone or damaged
is a miss (a cold prefill), never a wrong state."""

from __future__ import annotations

import pytest

from barreld.cache.remote.redis import HEADER, ROW_KIND, Ref
from barreld.cache.remote.tier import BLOCK_KIND
from barreld.service.metrics import Metrics
from tests.cache.conftest import SCHEME
from tests.cache.remote_hosts import Host, publish, restored
from tests.cache.test_blocks import B, ckpt, state
from tests.support.redis_sandbox import RedisServer


def block_names(redis_server: RedisServer) -> list[bytes]:
    return sorted(redis_server.admin().keys(b"barrel:{*}:" + BLOCK_KIND.encode() + b":*"))


def test_a_shared_head_is_sent_once_and_each_host_fetches_only_what_it_lacks(
    host: Host, redis_server: RedisServer
) -> None:
    a, b = host("a", block_tokens=B), host("b", block_tokens=B)
    first, second = ckpt(64, 5), ckpt(80, 0)  # 4 and 5 blocks, the first 3 shared
    publish(a, first)
    publish(a, second)
    sent = a.remote.stats()
    block_value = redis_server.admin().strlen(block_names(redis_server)[0])
    assert (sent["blocks_written"], sent["blocks_skipped"]) == (4 + 2, 3)
    assert sent["bytes_skipped"] == 3 * (block_value - HEADER.size)
    assert len(block_names(redis_server)) == 6
    got = restored(b, first.key)
    assert got is not None and got.state == bytes(first.state)
    b.pending(first.key).result(10)  # promoted: B's disk tier now holds the first 4 blocks
    read_before = b.remote.stats()["bytes_read"]
    got = restored(b, second.key)
    assert got is not None and got.state == bytes(second.state)
    stats = b.remote.stats()
    assert (stats["blocks_local"], stats["blocks_fetched"]) == (3, 4 + 2)
    # Only the second row's description, its own file and its last two blocks crossed the network.
    assert 2 * block_value < stats["bytes_read"] - read_before < 3 * block_value
    if (promotion := b.pending(second.key)) is not None:
        promotion.result(10)  # the audit is for quiet moments: let the second promotion land first
    assert a.check() == [] and b.check() == []


def test_a_prefix_alias_fetches_only_the_blocks_that_cover_the_prefix(host: Host) -> None:
    a, b = host("a", block_tokens=B), host("b", block_tokens=B)
    c = ckpt(70, 6)  # 4 blocks of 16 and a tail of 6
    head = SCHEME.key(bytes(c.rendered[:40]))
    publish(a, c, prefixes=((head, 20),))
    [hit] = b.lookup_remote([head])
    assert hit is not None and (hit.row_key, hit.n_tokens) == (c.key, 20)
    with b.restore(hit, promote_to="disk") as got:
        # Blocks 0 and 1 cover the 20 tokens: their cells are the state of the first 32 tokens.
        assert got is not None and bytes(got.state) == state(2 * B)
        assert got.frontier_tokens == 2 * B and got.logits is None and got.key == c.key
    assert b.remote.stats()["blocks_fetched"] == 2
    assert b.pending(c.key) is None and b.lookup(c.key) is None  # a prefix's state is not promoted as the row
    assert restored(b, c.key).state == bytes(c.state)  # the whole row, exactly


@pytest.mark.parametrize("damage", ["evicted", "overwritten"])
def test_a_block_gone_or_damaged_is_a_miss_and_the_row_is_dropped(
    host: Host, redis_server: RedisServer, damage: str
) -> None:
    a, b = host("a", block_tokens=B), host("b", block_tokens=B)
    c = ckpt(64, 5)
    publish(a, c)
    admin = redis_server.admin()
    victim = block_names(redis_server)[0]
    if damage == "evicted":
        admin.delete(victim)
    else:
        admin.set(victim, admin.get(victim)[:-1] + b"\x00")
    assert restored(b, c.key) is None
    misses = b.stats()["redis"]["misses"]
    assert misses["missing" if damage == "evicted" else "corrupt"] == 1
    assert not admin.exists(b.remote.store.name(Ref(ROW_KIND, c.key)))  # no host probes it again
    assert not admin.exists(victim)  # a damaged block is deleted, so the next mirror writes it again
    assert a.lookup(c.key) is not None and b.lookup(c.key) is None and a.check() == []


def test_evict_keeps_blocks_another_row_names_and_gc_removes_them_all(
    host: Host, redis_server: RedisServer
) -> None:
    a, b = host("a", block_tokens=B), host("b", block_tokens=B)
    old, new = ckpt(64, 5), ckpt(80, 0)
    publish(a, old)
    publish(a, new)
    evicted, freed = a.remote.evict(1)
    assert evicted == 1 and freed > 0  # the least recently used row, with only its own last block
    assert len(block_names(redis_server)) == 5
    got = restored(b, new.key, promote_to=None)  # no promotion: B mirrors nothing back
    assert got is not None and got.state == bytes(new.state)
    assert a.remote.evict(float("inf"))[0] == 1 and block_names(redis_server) == []
    publish(a, ckpt(48, 0))
    assert a.remote.gc() == 1 and redis_server.admin().keys("*") == []


def test_metrics_show_blocks_written_skipped_and_errors_by_node(host: Host, redis_server: RedisServer) -> None:
    a = host("a", block_tokens=B)
    publish(a, ckpt(64, 5))
    publish(a, ckpt(80, 0))
    redis_server.kill()
    assert a.lookup_remote([SCHEME.key(b"anything")]) == [None]
    text = Metrics(a, lambda: []).render().decode()
    assert 'barrel_redis_blocks_total{outcome="written"} 6.0' in text
    assert 'barrel_redis_blocks_total{outcome="skipped"} 3.0' in text
    skipped = a.stats()["redis"]["bytes_skipped"]
    assert skipped > 0 and f"barrel_redis_bytes_skipped_total {float(skipped)!r}" in text
    node = a.remote.store.settings.address
    assert f'barrel_redis_errors_total{{kind="refused",node="{node}"}}' in text

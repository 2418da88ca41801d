"""The remote tier on a real Redis Cluster (3 primaries, started by the tests): hosts share rows of blocks
across its nodes, and a killed node, a failover and a slot migration during traffic are misses or hits
with the right bytes, never an exception, never a lost local row."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from barreld.cache import CacheStore, Checkpoint
from barreld.cache.remote.redis import ROW_KIND, Ref
from barreld.cache.remote.tier import BLOCK_KIND, CKPT_KIND
from tests.cache.conftest import SCHEME
from tests.cache.remote_hosts import Host, publish, restored
from tests.cache.test_blocks import B, ckpt
from tests.support.redis_sandbox import ClusterSandbox


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterSandbox]:
    with ClusterSandbox.start(primaries=3) as c:
        yield c


@pytest.fixture
def on_cluster(host: Host, cluster: ClusterSandbox) -> Iterator[Host]:
    """Hosts on the module's cluster, emptied before each test."""
    with cluster.admin() as admin:
        admin.flushall(target_nodes=admin.PRIMARIES)
    yield lambda name, **kw: host(name, cluster.url(), block_tokens=B, **kw)


@pytest.fixture
def replicated(host: Host) -> Iterator[tuple[Host, ClusterSandbox]]:
    """A cluster of 3 primaries with a replica each, for the tests that kill or fail over a primary."""
    with ClusterSandbox.start(primaries=3, replicas=1) as c:
        yield (lambda name, **kw: host(name, c.url(), block_tokens=B, timeout_ms=300, **kw)), c


def same_or_miss(store: CacheStore, c: Checkpoint) -> bool:
    """Restores c on `store`: the exact bytes (True) or a miss (False); anything else fails the test."""
    got = restored(store, c.key, promote_to=None)
    assert got is None or got.state == bytes(c.state)
    return got is not None


def test_hosts_share_rows_of_blocks_spread_over_the_nodes(on_cluster: Host, cluster: ClusterSandbox) -> None:
    a, b = on_cluster("a"), on_cluster("b")
    first, second = ckpt(64, 5), ckpt(80, 0)
    head = SCHEME.key(bytes(second.rendered[:40]))
    publish(a, second, prefixes=((head, 20),))
    publish(a, first)
    assert a.remote.stats()["blocks_skipped"] == 3
    assert same_or_miss(b, first) and same_or_miss(b, second)
    [hit] = b.lookup_remote([head])
    assert hit is not None and hit.n_tokens == 20 and hit.row_key == second.key
    store = a.remote.store
    blocks = store.scan(BLOCK_KIND)
    assert blocks is not None and len(blocks) == 6
    homes = {cluster.primary_of(store.name(Ref(BLOCK_KIND, o.key))).port for o in blocks}
    assert len(homes) > 1  # keyed by content, each under its own hash tag: spread over the primaries
    row_home = cluster.primary_of(store.name(Ref(ROW_KIND, second.key)))
    assert cluster.primary_of(store.name(Ref(CKPT_KIND, second.key, second.key))) is row_home  # one slot
    assert a.stats()["redis"]["node_errors"] == {} and b.check() == []
    assert {r["key"] for r in a.remote.dump()} == {first.key.hex(), second.key.hex()}  # SCAN over every primary
    assert a.remote.evict(1)[0] == 1 and len(a.remote.dump()) == 1
    assert a.remote.gc() == 1 and store.scan() == []


def warm_again(a: CacheStore, b: CacheStore, first: int = 48) -> Checkpoint:
    """Until a fresh row that A publishes restores on B (the client has found the cluster's new shape):
    every try before that is a miss, never an exception."""
    deadline = time.monotonic() + 30
    for n in range(first, first + 1000):
        c = ckpt(n, 3)
        publish(a, c)
        if same_or_miss(b, c):
            return c
        assert time.monotonic() < deadline, b.stats()["redis"]
        time.sleep(0.2)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("fault", ["kill", "failover"])
def test_a_lost_or_failed_over_primary_is_a_miss_until_the_cluster_settles(
    replicated: tuple[Host, ClusterSandbox], fault: str
) -> None:
    """A primary killed (its replica takes over after the node timeout) or handed over by CLUSTER FAILOVER
    while hosts read and write: each request a miss or the same bytes, then warm again; no local row lost."""
    make, cluster = replicated
    a, b = make("a"), make("b")
    first = ckpt(64, 5)
    publish(a, first)
    primary = cluster.primary_of(a.remote.store.name(Ref(ROW_KIND, first.key)))
    if fault == "kill":
        primary.kill()
    else:
        with cluster.replica_of(primary).admin() as replica:
            replica.execute_command("CLUSTER", "FAILOVER")
    same_or_miss(b, first)
    cluster.wait_ok()
    warm_again(a, b)
    same_or_miss(b, first)  # replicated before the fault, or a miss: never other bytes
    if fault == "kill":
        assert b.stats()["redis"]["node_errors"]  # counted by node
    assert a.lookup(first.key) is not None and a.check() == [] and b.check() == []


def test_a_slot_migration_during_traffic_is_followed(on_cluster: Host, cluster: ClusterSandbox) -> None:
    a, b = on_cluster("a"), on_cluster("b")
    first = ckpt(64, 5)
    publish(a, first)
    row = a.remote.store.name(Ref(ROW_KIND, first.key))
    target = cluster.migrate_slot_of(row, lambda: same_or_miss(b, first))  # the row moved, its part not yet: ASK
    assert same_or_miss(b, first)  # MOVED: the client asks the new owner
    assert cluster.primary_of(row) is target
    assert a.lookup(first.key) is not None and b.check() == []

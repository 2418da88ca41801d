"""Two real barreld processes on a real Redis Cluster (3 primaries, a replica each), with the real model: host B
warm-starts from host A's prompts through the cluster; a conversation that a round-robin spreads over both
hosts is warm on every turn after the first; a slot migration, a failover and a killed primary are warm or
cold replies, never errors, on both hosts, and lose no local row."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.support.redis_sandbox import ClusterSandbox
from tests.support.sandbox import Sandbox
from tests.test_cache_paths import CHUNK, complete, doc
from tests.test_redis_hosts import cold_host, local_rows, served, settle, two_hosts, warm_starts

pytestmark = [pytest.mark.model, pytest.mark.slow]
TURNS = 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterSandbox]:
    with ClusterSandbox.start(primaries=3, replicas=1) as c:  # the replicas: for CLUSTER FAILOVER
        yield c


@pytest.fixture(scope="module")
def pair(cluster: ClusterSandbox) -> Iterator[tuple[Sandbox, Sandbox]]:
    with two_hosts(cluster) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def reference() -> Iterator[Sandbox]:
    """The reply a single host gives: a host that saves nothing, so every reply is a cold prefill."""
    with cold_host() as w:
        yield w


def visible(cluster: ClusterSandbox, key: str) -> float:
    """Seconds until the row `key` can be read from the cluster (a reply's finish save, mirrored)."""
    start = time.monotonic()
    name = f"barrel:{{{key}}}:row:{key}"
    with cluster.admin() as admin:
        while not admin.exists(name):
            assert time.monotonic() - start < 60, f"row {key} never reached Redis"
            time.sleep(0.01)
    return time.monotonic() - start


def test_host_b_warm_starts_from_host_a_through_a_cluster(pair: tuple[Sandbox, Sandbox], reference: Sandbox) -> None:
    warm_starts(*pair, reference)


def test_a_conversation_alternating_hosts_is_warm_on_every_turn_after_the_first(
    pair: tuple[Sandbox, Sandbox], reference: Sandbox, cluster: ClusterSandbox
) -> None:
    """A round-robin load balancer: turn k goes to host k % 2. Each turn's prompt is the last prompt, its
    reply and a new message, sent with the last reply's key as its parent (as the CLI's --parent-key); its
    reply equals the single host's, and it restores the last turn's finish checkpoint, which the other host
    mirrored, up to a chunk boundary. The mirror delays are printed (bench/ measures them)."""
    prompt, parent, delays, paths, previous = doc(40, 200), [], [], [], 0
    for turn in range(TURNS):
        complete(reference, "Zebras flush the context.", "--max-tokens", "2")
        got, ref = complete(pair[turn % 2], prompt, *parent), complete(reference, prompt)
        assert got["text"] == ref["text"], (turn, got["cache"])
        paths.append((got["cache"]["path"], got["cache"]["tier"], got["cache"]["restored_tokens"]))
        assert not turn or got["cache"]["restored_tokens"] >= previous > 0, paths
        delays.append(visible(cluster, got["key"]))
        previous = got["tokens"]["prompt"] - CHUNK  # reuse stops at a chunk boundary
        prompt, parent = prompt + got["text"] + "\n" + doc(50 + turn, 20), ["--parent-key", got["key"]]
    print(f"mirror delays (s): {', '.join(f'{d:.3f}' for d in delays)}; paths: {paths}")


def shared(a: Sandbox, reference: Sandbox, i: int) -> tuple[str, bytes]:
    """A prompt host A served (its reply equal to the cold one) and the Redis name of its finish row, once
    A's mirror has written it."""
    prompt = doc(i, 200)
    reply = served(a, reference, prompt)
    settle(a, reply)
    return prompt, f"barrel:{{{reply['key']}}}:row:{reply['key']}".encode()


@pytest.mark.faults
def test_a_slot_migration_during_traffic_is_a_warm_or_cold_reply_never_an_error(
    pair: tuple[Sandbox, Sandbox], reference: Sandbox, cluster: ClusterSandbox
) -> None:
    """The slot of A's finish row moves to another primary while B asks for it: the row first (B's client
    gets ASK for it), the rest after; every reply equals the cold one."""
    a, b = pair
    prompt, row = shared(a, reference, 70)
    target = cluster.migrate_slot_of(row, lambda: served(b, reference, prompt))
    served(b, reference, prompt + " and then, far from the river, a letter came in the morning")
    assert cluster.primary_of(row) is target


@pytest.mark.faults
def test_a_failover_during_traffic_is_a_warm_or_cold_reply_never_an_error(
    pair: tuple[Sandbox, Sandbox], reference: Sandbox, cluster: ClusterSandbox
) -> None:
    """CLUSTER FAILOVER hands the primary of A's finish row to its replica while B asks for it."""
    a, b = pair
    prompt, row = shared(a, reference, 80)
    with cluster.replica_of(cluster.primary_of(row)).admin() as replica:
        replica.execute_command("CLUSTER", "FAILOVER")
    served(b, reference, prompt)
    cluster.wait_ok()
    prompt, _ = shared(a, reference, 81)
    served(b, reference, prompt)


@pytest.mark.faults
def test_a_killed_primary_is_a_cold_reply_and_no_local_row_is_lost(
    pair: tuple[Sandbox, Sandbox], reference: Sandbox, cluster: ClusterSandbox
) -> None:
    """The primary holding A's finish row is killed; B asks for it, A serves on: replies equal the cold ones,
    and every local row stays."""
    a, b = pair
    prompt, row = shared(a, reference, 60)
    rows_a, rows_b = local_rows(a), local_rows(b)
    cluster.primary_of(row).kill()
    served(b, reference, prompt)
    served(a, reference, doc(61, 200))
    assert local_rows(a) >= rows_a and local_rows(b) >= rows_b
    for w in (a, b):
        assert w.ctl("--json", "cache", "verify").json()["bad"] == []

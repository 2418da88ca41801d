"""The Redis tier's operator surface through real processes, no model: barreld with [tiers.redis] on a real
redis-server, and barrelctl's cache stats, dump, evict-bytes and gc with --tier redis.

The rows in Redis are mirrored by a cache store in this process, as another host's would be.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from barreld.cache.remote.redis import RedisStore
from barreld.cache.remote.settings import RedisSettings
from barreld.cache.remote.tier import RemoteTier
from tests.cache.conftest import SCHEME, make_ckpt
from tests.support.redis_sandbox import RedisServer
from tests.support.sandbox import Sandbox

pytestmark = pytest.mark.slow  # three daemons


@pytest.fixture
def daemon(redis_server: RedisServer) -> Iterator[Sandbox]:
    with Sandbox.new(f'\n[tiers.redis]\nurl = "{redis_server.url()}"\ntimeout_ms = 300\n', label="redis-cli") as w:
        w.start_daemon()
        yield w


def other_host_mirrors(url: str, n: int) -> list[bytes]:
    remote = RemoteTier(RedisStore(RedisSettings(url)))
    ckpts = [make_ckpt(b"row %d from another host" % i, 20_000, prefixes=((SCHEME.key(b"row"), 2),))
             for i in range(n)]
    assert all(remote.mirror(c) for c in ckpts)
    remote.close()
    return [c.key for c in ckpts]


def test_stats_dump_evict_and_gc_with_tier_redis(daemon: Sandbox, redis_server: RedisServer) -> None:
    stats = daemon.ctl("--json", "cache", "stats").json()["redis"]
    assert stats["reachable"] and stats["url"] == redis_server.url() and stats["errors"]["refused"] == 0
    table = daemon.ctl("cache", "stats")
    assert table.rc == 0 and "reachable" in table.out and redis_server.url() in table.out

    keys = other_host_mirrors(redis_server.url(), 3)
    redis_server.admin().set("someone-else", b"kept")
    rows = daemon.ctl("--json", "cache", "dump", "--tier", "redis").json()["rows"]
    assert {r["key"] for r in rows} == {k.hex() for k in keys}
    assert all(r["tier"] == "redis" and r["size"] > 20_000 and r["location"].startswith("barrel:{") for r in rows)
    assert daemon.ctl("cache", "dump", "--tier", "redis").rc == 0
    assert daemon.ctl("--json", "cache", "dump").json()["rows"] == []  # local dump: this host has none

    freed = daemon.ctl("--json", "cache", "evict-bytes", "1", "--tier", "redis").json()
    assert freed["evicted"] == 1 and freed["bytes_freed"] > 20_000
    assert daemon.ctl("--json", "cache", "gc").json() == {"evicted": 0}  # local only: Redis untouched
    assert len(daemon.ctl("--json", "cache", "dump", "--tier", "redis").json()["rows"]) == 2
    assert daemon.ctl("--json", "cache", "gc", "--tier", "redis").json() == {"evicted": 2}
    assert redis_server.admin().keys("*") == [b"someone-else"]


def test_redis_away_is_an_error_for_its_commands_and_nothing_else(daemon: Sandbox, redis_server: RedisServer) -> None:
    redis_server.kill()
    r = daemon.ctl("cache", "dump", "--tier", "redis")
    assert r.rc == 1 and "could not be reached" in r.err
    stats = daemon.ctl("--json", "cache", "stats").json()["redis"]
    assert not stats["reachable"] and stats["errors"]["refused"] >= 1
    assert daemon.ctl("--json", "cache", "gc").json() == {"evicted": 0}


def test_tier_redis_without_a_redis_tier(world: Sandbox, tmp_path: Path) -> None:
    world.start_daemon()
    r = world.ctl("cache", "gc", "--tier", "redis")
    assert r.rc == 1 and "no redis tier is configured" in r.err
    assert world.ctl("--json", "cache", "stats").json()["redis"] is None
    bad = world.ctl("cache", "gc", "--tier", "tape")
    assert bad.rc == 2 and "tape" in bad.err

"""RedisStore against a real redis-server: round trips, and every way Redis can lose, damage or withhold a
value (overwritten, wrong length, FLUSHALL, eviction, a killed or paused server, refused credentials) is a
counted miss, never data and never an exception."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

from barreld.cache.remote.redis import HEADER, ROW_KIND, RedisStore
from barreld.cache.remote.settings import RedisSettings
from tests.support.redis_sandbox import RedisServer

PASSWORD = "s3cret-Pa55word"


def key() -> bytes:
    return os.urandom(32)


def make_store(url: str, **settings: object) -> RedisStore:
    """A store whose backoff is short, so tests see it come back within a second."""
    return RedisStore(RedisSettings(url, **settings), backoff_s=(0.05, 0.4))  # type: ignore[arg-type]


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[RedisStore]:
    s = make_store(redis_server.url(), timeout_ms=300)
    yield s
    s.close()


def name_of(server: RedisServer, kind: str, k: bytes) -> bytes:
    """The Redis name of an object, found by the server itself (the test does not rebuild the layout)."""
    names = server.admin().keys(f"barrel:*:{kind}:{k.hex()}")
    assert len(names) == 1, names
    return names[0]


def recover(store: RedisStore, deadline_s: float = 20) -> None:
    """Until the store reaches the server again (its backoff decides when it tries)."""
    deadline = time.monotonic() + deadline_s
    while not store.ping():
        assert time.monotonic() < deadline, store.stats()
        time.sleep(0.05)


# ---- round trips ------------------------------------------------------------------------------------


def test_round_trip_probe_fetch_scan_delete(store: RedisStore, redis_server: RedisServer) -> None:
    a, b, absent = key(), key(), key()
    payload_a, payload_b = os.urandom(1 << 20), b"tiny"
    assert store.put("block", a, payload_a) and store.put("block", b, memoryview(payload_b))
    assert store.exists_many("block", [a, absent, b]) == [True, False, True]
    assert store.exists_many("row", [a]) == [False]  # kinds are separate namespaces
    got = store.get_many("block", [b, absent, a])
    assert [bytes(g) if g is not None else None for g in got] == [payload_b, None, payload_a]
    stats = store.stats()
    assert stats["hits"] == 2 and stats["misses"] == {"missing": 1, "corrupt": 0, "unreachable": 0}
    value_bytes = 2 * HEADER.size + len(payload_a) + len(payload_b)
    assert stats["bytes_written"] == value_bytes == stats["bytes_read"]
    assert stats["reachable"] and stats["rtt_ms"] > 0 and sum(stats["errors"].values()) == 0
    assert {(o.kind, o.key, o.size) for o in store.scan()} == {
        ("block", a, HEADER.size + len(payload_a)), ("block", b, HEADER.size + len(payload_b))}
    assert store.scan("row") == []
    assert store.delete("block", a) and store.delete("block", a)  # already gone is not an error
    assert store.exists_many("block", [a, b]) == [False, True]
    assert redis_server.admin().strlen(name_of(redis_server, "block", b)) == HEADER.size + len(payload_b)


def test_probes_and_fetches_are_one_round_trip_each(store: RedisStore, redis_server: RedisServer) -> None:
    keys = [key() for _ in range(50)]
    for k in keys[::2]:
        assert store.put("block", k, k * 3)
    before = store.stats()["round_trips"]
    commands = int(redis_server.admin().info("stats")["total_commands_processed"])
    assert store.exists_many("block", keys) == [i % 2 == 0 for i in range(50)]
    assert store.stats()["round_trips"] == before + 1
    got = store.get_many("block", keys)
    assert store.stats()["round_trips"] == before + 2
    assert [bytes(g) if g is not None else None for g in got] == [k * 3 if i % 2 == 0 else None
                                                                 for i, k in enumerate(keys)]
    # 50 EXISTS and 50 GETs reached the server (plus the INFO calls of this test).
    processed = int(redis_server.admin().info("stats")["total_commands_processed"]) - commands
    assert 100 <= processed <= 102


def test_publish_row_writes_parts_then_row_under_the_rows_hash_tag(
    store: RedisStore, redis_server: RedisServer
) -> None:
    row, blocks = key(), [key() for _ in range(3)]
    parts = [("block", b, os.urandom(4096)) for b in blocks] + [("logits", row, b"logits")]
    assert store.publish_row(row, parts, b"row metadata")
    names = redis_server.admin().keys("barrel:*")
    assert len(names) == 5 and all(n.startswith(b"barrel:{" + row.hex().encode() + b"}:") for n in names)
    assert bytes(store.get_many(ROW_KIND, [row], tag=row)[0] or b"") == b"row metadata"
    got = store.get_many("block", blocks, tag=row)
    assert [bytes(g or b"") for g in got] == [p for _, _, p in parts[:3]]
    assert store.get_many("block", blocks) == [None] * 3  # not under their own tags
    assert len({key_slot(n) for n in names}) == 1  # one Redis Cluster hash slot, as the client computes it


def test_a_row_whose_part_is_refused_is_not_written(store: RedisStore, redis_server: RedisServer) -> None:
    admin = redis_server.admin()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)  # below what Redis already uses: every write is refused
    row = key()
    assert not store.publish_row(row, [("block", key(), os.urandom(1 << 20)), ("block", key(), b"x")], b"row")
    stats = store.stats()
    # Both parts refused in one round trip; the row was never sent (it would have been a third failure).
    assert stats["errors"]["oom"] == 1 and stats["writes_failed"] == 2 and stats["reachable"]
    admin.config_set("maxmemory", 0)
    assert store.exists_many(ROW_KIND, [row], tag=row) == [False] and admin.dbsize() == 0


def test_scan_sees_only_its_own_prefix(store: RedisStore, redis_server: RedisServer) -> None:
    other = make_store(redis_server.url(), prefix="elsewhere:")
    mine, theirs = key(), key()
    assert store.put("block", mine, b"m") and other.put("block", theirs, b"t")
    admin = redis_server.admin()
    admin.set("unrelated", b"x")
    admin.set(b"barrel:not-barrels-layout", b"x")
    assert [o.key for o in store.scan()] == [mine]
    assert [o.key for o in other.scan("block")] == [theirs]
    assert store.get_many("block", [theirs]) == [None]
    other.close()


def test_unix_socket_url(redis_server: RedisServer) -> None:
    s = make_store(redis_server.unix_url())
    k = key()
    assert s.put("block", k, b"over a unix socket")
    assert bytes(s.get_many("block", [k])[0] or b"") == b"over a unix socket"
    assert s.stats()["reachable"]
    s.close()


def test_tls_url() -> None:
    with RedisServer.start(tls=True) as server:
        s = make_store(server.url())
        k = key()
        assert s.put("block", k, b"over TLS") and bytes(s.get_many("block", [k])[0] or b"") == b"over TLS"
        plain = make_store(server.url().replace("rediss://", "redis://").split("?")[0], timeout_ms=300)
        assert plain.get_many("block", [k]) == [None]  # plain text to a TLS port: an error, never data
        assert sum(plain.stats()["errors"].values()) == 1
        s.close()
        plain.close()


# ---- damaged values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "appended", "truncated", "header_length", "flipped_byte",
                                    "copied_from_another_key", "empty"])
def test_a_damaged_value_is_a_counted_miss_and_is_removed(
    store: RedisStore, redis_server: RedisServer, damage: str
) -> None:
    k, other = key(), key()
    payload = os.urandom(10_000)
    assert store.put("block", k, payload) and store.put("block", other, os.urandom(10_000))
    admin, name = redis_server.admin(), name_of(redis_server, "block", k)
    value = admin.get(name)
    damaged = {
        "garbage": b"not a barrel value at all",
        "appended": value + b"!",
        "truncated": value[:-1],
        "header_length": value[:4] + (len(payload) - 1).to_bytes(8, "little") + value[12:-1],
        "flipped_byte": value[:-1] + bytes([value[-1] ^ 1]),
        "copied_from_another_key": admin.get(name_of(redis_server, "block", other)),
        "empty": b"",
    }[damage]
    admin.set(name, damaged)
    assert store.exists_many("block", [k]) == [True]
    assert store.get_many("block", [k, other])[0] is None
    stats = store.stats()
    assert stats["misses"]["corrupt"] == 1 and stats["hits"] == 1 and stats["corrupt_deleted"] == 1
    assert store.exists_many("block", [k]) == [False]  # gone, so a writer that probes first sends it again
    assert store.put("block", k, payload) and bytes(store.get_many("block", [k])[0] or b"") == payload


def test_a_read_only_store_neither_writes_nor_deletes(store: RedisStore, redis_server: RedisServer) -> None:
    reader = make_store(redis_server.url(), write=False)
    k = key()
    assert not reader.put("block", k, b"x") and not reader.publish_row(k, [], b"row")
    assert redis_server.admin().dbsize() == 0
    assert store.put("block", k, b"x")
    redis_server.admin().set(name_of(redis_server, "block", k), b"damaged")
    assert reader.get_many("block", [k]) == [None] and reader.stats()["misses"]["corrupt"] == 1
    assert not reader.delete("block", k)
    assert redis_server.admin().dbsize() == 1
    reader.close()


# ---- Redis loses values -----------------------------------------------------------------------------


def test_flushall_between_probe_and_fetch(store: RedisStore, redis_server: RedisServer) -> None:
    keys = [key() for _ in range(4)]
    for k in keys:
        assert store.put("block", k, k)
    assert store.exists_many("block", keys) == [True] * 4
    redis_server.admin().flushall()
    assert store.get_many("block", keys) == [None] * 4
    stats = store.stats()
    assert stats["misses"]["missing"] == 4 and stats["hits"] == 0 and sum(stats["errors"].values()) == 0


def test_redis_evicting_while_barrel_writes(store: RedisStore, redis_server: RedisServer) -> None:
    admin = redis_server.admin()
    admin.config_set("maxmemory-policy", "allkeys-lru")
    admin.config_set("maxmemory", "4mb")
    payloads = {key(): os.urandom(100_000) for _ in range(120)}  # 12 MB into 4 MB
    stored = [k for k, p in payloads.items() if store.put("block", k, p)]
    assert int(admin.info("stats")["evicted_keys"]) > 0
    keys = list(payloads)
    got = store.get_many("block", keys)
    hits = [k for k, g in zip(keys, got, strict=True) if g is not None]
    assert all(bytes(g) == payloads[k] for k, g in zip(keys, got, strict=True) if g is not None)
    assert 0 < len(hits) < len(keys) and set(hits) <= set(stored)
    stats = store.stats()
    assert stats["misses"]["missing"] == len(keys) - len(hits) and stats["misses"]["corrupt"] == 0
    assert stats["writes"] == len(stored) and stats["writes"] + stats["writes_failed"] == len(keys)


def test_quota_stops_writes_but_not_reads(redis_server: RedisServer) -> None:
    s = make_store(redis_server.url(), quota=1 << 20)
    first, second = key(), key()
    assert s.put("block", first, os.urandom(600_000))
    assert not s.put("block", second, os.urandom(600_000))
    stats = s.stats()
    assert stats["writes_over_quota"] == 1 and stats["used_bytes"] == 600_000 + HEADER.size
    assert s.exists_many("block", [first, second]) == [True, False]
    assert s.get_many("block", [first])[0] is not None
    s.close()


# ---- Redis goes away --------------------------------------------------------------------------------


def test_killed_server_fails_fast_then_reconnects(
    store: RedisStore, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    k = key()
    assert store.put("block", k, b"before")
    redis_server.kill()
    assert store.get_many("block", [k]) == [None]
    stats = store.stats()
    assert not stats["reachable"] and stats["down"] and stats["errors"]["refused"] + stats["errors"]["reset"] == 1
    # While down, calls do not go out: nothing more is counted as an error, each is a miss or a failed write.
    assert store.exists_many("block", [k]) == [False] and not store.put("block", key(), b"x")
    assert store.get_many("block", [k, k]) == [None, None]
    stats = store.stats()
    assert stats["skipped_down"] >= 3 and sum(stats["errors"].values()) == 1
    assert stats["misses"]["unreachable"] == 3 and stats["writes_failed"] == 1
    redis_server.restart()  # empty: no persistence
    with caplog.at_level(logging.INFO, logger="barreld.cache.redis"):
        recover(store)
    assert [r.getMessage() for r in caplog.records if "again" in r.getMessage()] == [
        f"redis redis://127.0.0.1:{redis_server.port}/0: reachable again"]
    assert store.get_many("block", [k]) == [None]
    assert store.put("block", k, b"after") and bytes(store.get_many("block", [k])[0] or b"") == b"after"
    assert store.stats()["reachable"] and not store.stats()["down"]


def test_server_killed_during_transfers(store: RedisStore, redis_server: RedisServer) -> None:
    keys = [key() for _ in range(4)]
    for k in keys:
        assert store.put("block", k, os.urandom(4 << 20))
    results: list[object] = []

    def reader() -> None:
        for _ in range(30):
            results.extend(store.get_many("block", keys))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    redis_server.kill()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert all(r is None or len(r) == 4 << 20 for r in results)  # each is whole data or a miss
    stats = store.stats()
    assert stats["misses"]["unreachable"] > 0 and sum(stats["errors"].values()) >= 1


def test_paused_server_times_out_and_fails_fast(redis_server: RedisServer) -> None:
    s = make_store(redis_server.url(), timeout_ms=200)
    k = key()
    assert s.put("block", k, b"x")
    redis_server.pause()
    try:
        started = time.monotonic()
        assert s.get_many("block", [k]) == [None]
        waited = time.monotonic() - started
        assert s.stats()["errors"]["timeout"] == 1 and not s.stats()["reachable"]
        assert waited < 5, waited  # bounded by timeout_ms, not hung on the stopped process
        assert s.get_many("block", [k]) == [None] and s.stats()["skipped_down"] == 1  # did not wait again
    finally:
        redis_server.resume()
    recover(s)
    assert bytes(s.get_many("block", [k])[0] or b"") == b"x"
    s.close()


def test_backoff_doubles_while_down_and_resets_on_success(redis_server: RedisServer) -> None:
    now = [1000.0]
    s = RedisStore(RedisSettings(redis_server.url()), backoff_s=(1.0, 4.0), clock=lambda: now[0])
    redis_server.kill()
    tries = []
    for _ in range(24):
        errors = sum(s.stats()["errors"].values())
        s.ping()
        tries.append(sum(s.stats()["errors"].values()) > errors)
        now[0] += 0.5
    # One try, then waits of 1, 2, 4, 4 s (capped), in steps of 0.5 s.
    assert [i for i, tried in enumerate(tries) if tried] == [0, 2, 6, 14, 22]
    redis_server.restart()
    now[0] += 4
    assert s.ping() and not s.stats()["down"]
    redis_server.kill()
    now[0] += 0.1
    s.ping()
    now[0] += 1.0  # back to the first backoff after a success
    errors = sum(s.stats()["errors"].values())
    s.ping()
    assert sum(s.stats()["errors"].values()) == errors + 1
    s.close()


def test_each_kind_of_error_is_logged_once_a_minute(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    s = RedisStore(RedisSettings(redis_server.url()), backoff_s=(0.001, 0.001), clock=lambda: now[0])
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="barreld.cache.redis"):
        for _ in range(5):
            s.ping()
            now[0] += 1
        now[0] += 60
        s.ping()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("ping failed (refused)" in line for line in lines), lines
    assert "(4 more since the last report)" in lines[1]
    assert s.stats()["errors"]["refused"] == 6
    s.close()


# ---- credentials ------------------------------------------------------------------------------------


def test_password_in_the_url_is_used_and_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer.start(password=PASSWORD) as server, caplog.at_level(logging.DEBUG):
        good = make_store(server.url())
        k = key()
        assert good.put("block", k, b"secret data") and bytes(good.get_many("block", [k])[0] or b"")
        wrong = make_store(server.url(password="not-" + PASSWORD))
        missing = make_store(server.url().replace(f":{PASSWORD}@", ""))
        for s in (wrong, missing):
            assert s.get_many("block", [k]) == [None] and not s.put("block", key(), b"x")
            assert s.stats()["errors"]["auth"] == 1 and not s.stats()["reachable"]
        shown = " ".join([caplog.text, repr(good), repr(wrong), repr(good.settings), str(good.stats()),
                          str(wrong.stats())])
        assert "auth" in caplog.text and "127.0.0.1" in caplog.text
        assert PASSWORD not in shown and "***@127.0.0.1" in shown
        for s in (good, wrong, missing):
            s.close()


def test_programming_errors_raise(store: RedisStore) -> None:
    with pytest.raises(ValueError):
        store.put("Block!", key(), b"x")
    with pytest.raises(TypeError):
        store.get_many("block", ["not bytes"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        store.exists_many("block", [b""])

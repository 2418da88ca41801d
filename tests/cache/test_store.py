"""CacheStore behaviour: publish, lookups (exact and alias), verified restores, eviction, reconcile."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from barreld.cache import CacheStore, Checkpoint, StoreLocked, TierConfig, encoded_size
from barreld.cache import tiers as tiers_mod
from barreld.cache.key import DEFAULT_NAMESPACE, Namespace
from tests.faultd import write_fault

from .conftest import SCHEME, flip_byte, make_ckpt

StoreFactory = Callable[..., CacheStore]
SIZE = encoded_size(make_ckpt(b"prompt-A"))  # every prompt-X checkpoint is about this big
ROOM_FOR_TWO = 2 * SIZE + 40


def save(store: CacheStore, rendered: bytes, tier: str = "disk", **kw: object) -> Checkpoint:
    ckpt = make_ckpt(rendered, **kw)  # type: ignore[arg-type]
    out = store.save(ckpt, tier, sync=True, timeout=10)
    assert out.status == "published", out
    return ckpt


def restored_state(store: CacheStore, key: bytes) -> bytes | None:
    hit = store.lookup(key)
    if hit is None:
        return None
    with store.restore(hit) as ckpt:
        return None if ckpt is None else bytes(ckpt.state)


def keys(store: CacheStore, tier: str | None = None) -> set[bytes]:
    return {bytes.fromhex(r["key"]) for r in store.dump(tier=tier)}


@pytest.mark.parametrize("tier", ["ram", "ram_file", "disk"])
def test_save_lookup_restore(store: CacheStore, tier: str) -> None:
    ckpt = save(store, b"hello", tier, reason="finish")
    hit = store.lookup(ckpt.key)
    assert hit is not None and (hit.row_key, hit.tier) == (ckpt.key, tier)
    assert hit.n_tokens == hit.total_tokens == len(ckpt.tokens)
    with store.restore(hit) as got:
        assert got is not None
        assert bytes(got.state) == bytes(ckpt.state) and got.tokens.tolist() == list(ckpt.tokens)
        assert bytes(got.logits) == ckpt.logits and got.rendered == b"hello"
        assert store.dump()[0]["refcount"] == 1
    row = store.dump()[0]
    assert (row["hits"], row["refcount"], row["save_reason"], row["status"]) == (1, 0, "finish", "available")
    counters = store.stats()["counters"]
    assert counters["saves_finish"] == 1 and counters["save_ns"] > 0 and counters["restore_ns"] > 0
    assert store.check() == []


def test_lookup_misses_unknown_keys(store: CacheStore) -> None:
    assert store.lookup(SCHEME.key(b"never saved")) is None


def test_aliases_find_prefixes_and_die_with_their_row(store: CacheStore) -> None:
    p3, p5 = SCHEME.key(b"hel"), SCHEME.key(b"hello")
    long = save(store, b"hello world", "disk", prefixes=((p3, 3), (p5, 5)))
    hit = store.lookup(p5)
    assert hit is not None and (hit.row_key, hit.n_tokens, hit.total_tokens) == (long.key, 5, 11)
    # A second row covering the same prefix from a faster tier is preferred; when it goes, the first
    # row's alias for that prefix is still there.
    other = save(store, b"hello there", "ram_file", prefixes=((p3, 3),))
    hit = store.lookup(p3)
    assert hit is not None and hit.row_key == other.key
    assert store.evict_bytes(1, ["ram_file"]) == (1, encoded_size(other))
    hit = store.lookup(p3)
    assert hit is not None and hit.row_key == long.key
    assert store.gc() == 1
    assert store.lookup(p3) is None and store.lookup(p5) is None
    assert store.check() == []


def test_exact_row_wins_over_alias(store: CacheStore) -> None:
    short = save(store, b"hello")
    save(store, b"hello world", prefixes=((short.key, 5),))
    hit = store.lookup(short.key)
    assert hit is not None and hit.row_key == short.key


def test_duplicate_saves_publish_once(store: CacheStore) -> None:
    ckpt = make_ckpt(b"same prompt")
    results: list[str] = []
    barrier = threading.Barrier(6)

    def go() -> None:
        barrier.wait()
        results.append(store.save(ckpt, "disk", sync=True, timeout=10).status)

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["duplicate"] * 5 + ["published"]
    assert store.counters["saves_duplicate"] == 5 and store.counters["saves_cold"] == 1
    assert store.save(ckpt, "ram", sync=True).status == "duplicate"  # one row per key, any tier
    assert store.check() == []


def test_checkpoint_bigger_than_quota_is_refused(store_factory: StoreFactory) -> None:
    store = store_factory(ram=0, disk=SIZE - 1)
    for tier in ("ram", "disk"):
        out = store.save(make_ckpt(b"x" * 8), tier)
        assert out.status == "dropped" and out.future is None
    assert store.counters["saves_dropped"] == 2 and store.dump() == []


def test_eviction_is_lru_within_the_tier(store_factory: StoreFactory) -> None:
    store = store_factory(disk=ROOM_FOR_TWO, ram_file=ROOM_FOR_TWO)
    a, _ = save(store, b"prompt-A"), save(store, b"prompt-B")
    other = save(store, b"prompt-O", "ram_file")
    assert restored_state(store, a.key) is not None  # A is now more recent than B
    c = save(store, b"prompt-C")
    assert keys(store, "disk") == {a.key, c.key}
    assert keys(store, "ram_file") == {other.key}  # another tier's LRU is not touched
    assert store.counters["evictions"] == 1
    assert store.check() == []


def test_referenced_rows_are_never_evicted(store_factory: StoreFactory) -> None:
    store = store_factory(disk=ROOM_FOR_TWO)
    a, b = save(store, b"prompt-A"), save(store, b"prompt-B")
    hit_a = store.lookup(a.key)
    assert hit_a is not None
    with store.restore(hit_a) as got:
        assert got is not None
        assert restored_state(store, b.key) is not None  # A is least recent, but referenced
        c = save(store, b"prompt-C")
        assert keys(store) == {a.key, c.key}
        assert store.gc() == 1  # C goes, A stays
        assert keys(store) == {a.key}
        d = save(store, b"prompt-D")
        hit_d = store.lookup(d.key)
        assert hit_d is not None
        with store.restore(hit_d):
            out = store.save(make_ckpt(b"prompt-E"), "disk", sync=True)
            assert out.status == "dropped"  # everything left is in use: nothing is evicted
            assert keys(store) == {a.key, d.key}
        assert bytes(got.state) == bytes(a.state)  # still intact under its reader
    assert store.check() == []


def test_evict_bytes_is_lru_across_tiers(store: CacheStore) -> None:
    a = save(store, b"prompt-A", "disk")
    b = save(store, b"prompt-B", "ram_file")
    c = save(store, b"prompt-C", "ram")
    assert store.evict_bytes(0) == (0, 0)
    n, freed = store.evict_bytes(1, ["disk", "ram_file"])
    assert (n, keys(store)) == (1, {b.key, c.key}) and freed == encoded_size(a)
    assert restored_state(store, b.key) is not None  # B is now the most recent
    n, freed = store.evict_bytes(1)
    assert (n, keys(store)) == (1, {b.key}) and freed == encoded_size(c)
    with pytest.raises(ValueError):
        store.evict_bytes(1, ["tape"])
    assert store.counters["evictions"] == 2


def test_rows_keep_their_tenant_across_a_reopen_and_dump_and_texts_keep_to_one(store_factory) -> None:
    store = store_factory()
    alice, bob = Namespace.of("alice"), Namespace.of("bob", "salted")
    for ns in (alice, bob, DEFAULT_NAMESPACE):
        ckpt = Checkpoint.build(SCHEME.within(ns.digest), "test-model", b"the same text", [1, 2, 3], "cold",
                                bytes(300), tenant=ns.tenant)
        assert store.save(ckpt, "disk", sync=True).status == "published"
    store.close()
    store = store_factory()  # the rows as the index stored them, in format 4
    rows = store.dump()
    assert sorted((r["tenant"], r["namespace"]) for r in rows) == sorted(
        (ns.tenant, ns.short) for ns in (alice, bob, DEFAULT_NAMESPACE))
    assert [r["tenant"] for r in store.dump(tenant="alice")] == ["alice"] and store.dump(tenant="carol") == []
    keys = {ns.tenant: SCHEME.within(ns.digest).key(b"the same text") for ns in (alice, bob, DEFAULT_NAMESPACE)}
    for ns in (alice, bob, DEFAULT_NAMESPACE):
        assert [k for k, _ in store.texts("test-model", 10, ns.digest)] == [keys[ns.tenant]]
        hit = store.lookup(keys[ns.tenant])
        with store.restore(hit) as ckpt:
            assert (ckpt.tenant, ckpt.namespace) == (ns.tenant, ns.digest)


def test_dump_and_stats_follow_the_contract(store: CacheStore) -> None:
    save(store, b"on disk", "disk")
    save(store, b"in ram", "ram")
    rows = store.dump()
    assert [set(r) for r in rows] == [
        {
            "key",
            "model",
            "tier",
            "size",
            "tokens",
            "text_bytes",
            "save_reason",
            "status",
            "refcount",
            "hits",
            "last_used",
            "created",
            "location",
            "memory",
            "frontier",
            "blocks",
            "own_bytes",
            "shared_bytes",
            "tenant",
            "namespace",
        }
    ] * 2
    by_tier = {r["tier"]: r for r in rows}
    assert by_tier["ram"]["location"] is None and by_tier["disk"]["location"].endswith(".kvc")
    assert by_tier["disk"]["text_bytes"] == len(b"on disk") and by_tier["disk"]["model"] == "test-model"
    assert rows[0]["last_used"] >= rows[1]["last_used"]  # most recent first
    assert store.dump(tier="ram") == [by_tier["ram"]] and store.dump(model="nope") == []
    stats = store.stats()
    assert set(stats) == {"counters", "tiers", "redis"} and stats["redis"] is None  # no remote tier here
    size = by_tier["disk"]["size"]
    assert by_tier["disk"]["own_bytes"] == size and by_tier["disk"]["shared_bytes"] == by_tier["disk"]["blocks"] == 0
    assert stats["tiers"]["disk"] == {"bytes": size, "quota": 1 << 20, "rows": 1, "stored_bytes": size,
                                      "logical_bytes": size, "dedup_ratio": 1.0}
    contract = [
        "hits_exact",
        "hits_resume",
        "hits_longest_prefix",
        "hits_live",
        "misses",
        "saves_cold",
        "saves_continued",
        "saves_finish",
        "saves_evict",
        "saves_shutdown",
        "saves_dropped",
        "evictions",
        "corrupt_files",
        "longest_prefix_probes",
        "lookup_ns",
        "restore_ns",
        "save_ns",
    ]
    assert set(contract) <= set(stats["counters"])
    store.counters.count("hits_exact")
    store.counters.add_ns("lookup_ns", 5)
    assert store.stats()["counters"]["hits_exact"] == 1 and store.stats()["counters"]["lookup_ns"] == 5
    with pytest.raises(KeyError):
        store.counters.count("hits_typo")



@pytest.mark.parametrize("tier", ["ram", "ram_file", "disk"])
def test_corrupt_payload_is_never_served(store: CacheStore, tier: str) -> None:
    ckpt = save(store, b"fragile", tier, prefixes=((SCHEME.key(b"fra"), 3),))
    location = store.tier(tier).location_for(ckpt.key.hex()) if tier != "ram" else ckpt.key.hex()
    if tier == "ram":
        view = store.tier("ram").read(location)
        view[700] ^= 0x10
        del view
    else:
        flip_byte(location, 700)
    hit = store.lookup(ckpt.key)
    assert hit is not None
    with store.restore(hit) as got:
        assert got is None
    assert store.counters["corrupt_files"] == 1
    assert store.lookup(ckpt.key) is None and store.lookup(SCHEME.key(b"fra")) is None
    assert not store.tier(tier).exists(location)
    assert store.check() == []


def test_valid_file_under_the_wrong_key_is_refused(store: CacheStore) -> None:
    a, b = save(store, b"prompt-A"), save(store, b"prompt-B")
    disk = store.tier("disk")
    shutil.copyfile(disk.location_for(a.key.hex()), disk.location_for(b.key.hex()))
    assert restored_state(store, b.key) is None
    assert store.counters["corrupt_files"] == 1 and keys(store) == {a.key}


def test_missing_file_drops_the_row(store: CacheStore) -> None:
    a = save(store, b"prompt-A")
    os.unlink(store.tier("disk").location_for(a.key.hex()))
    assert restored_state(store, a.key) is None
    assert store.dump() == [] and store.check() == []


def test_verify_drops_bad_rows(store: CacheStore) -> None:
    saved = [save(store, f"prompt-{i}".encode(), tier) for i, tier in enumerate(["disk", "ram_file", "disk"])]
    flip_byte(store.tier("disk").location_for(saved[2].key.hex()), 5)
    progress: list[tuple[int, int]] = []
    assert store.verify(lambda i, n: progress.append((i, n))) == (3, [saved[2].key.hex()])
    assert progress == [(1, 3), (2, 3), (3, 3)]
    assert store.verify() == (2, [])
    assert store.check() == []


def _stall_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make every tier write wait for `gate`; `entered` is set when one is waiting."""
    gate, entered = threading.Event(), threading.Event()

    def hook(tier: str) -> None:
        entered.set()
        gate.wait(10)

    monkeypatch.setattr(tiers_mod, "fault_hook", hook)
    return gate, entered


def test_full_writer_queue_drops_async_saves(
    store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_factory(writers=1, queue_size=2)
    gate, entered = _stall_writes(monkeypatch)
    first = store.save(make_ckpt(b"prompt-0"), "disk")
    assert first.status == "queued" and entered.wait(10)
    queued = [store.save(make_ckpt(f"prompt-{i}".encode()), "disk") for i in (1, 2)]
    dropped = store.save(make_ckpt(b"prompt-3"), "disk")
    assert [q.status for q in queued] == ["queued", "queued"] and dropped.status == "dropped"
    assert store.counters["saves_dropped"] == 1
    gate.set()
    assert [o.future.result(10).status for o in [first, *queued]] == ["published"] * 3  # type: ignore[union-attr]


def test_sync_save_waits_at_most_its_timeout(store: CacheStore, monkeypatch: pytest.MonkeyPatch) -> None:
    gate, entered = _stall_writes(monkeypatch)
    ckpt = make_ckpt(b"slow")
    out = store.save(ckpt, "disk", sync=True, timeout=0.05)
    assert out.status == "timeout" and out.future is not None
    assert store.pending(ckpt.key) is out.future
    assert store.save(ckpt, "disk").status == "duplicate"  # in flight counts as present
    assert store.lookup(ckpt.key) is None  # reserved rows are not served
    gate.set()
    assert out.future.result(10).status == "published"
    assert store.pending(ckpt.key) is None and store.lookup(ckpt.key) is not None
    assert store.check() == []


def test_write_fault_fails_the_save_and_leaves_nothing(
    store: CacheStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiers_mod, "fault_hook", write_fault({"disk": errno.ENOSPC}))
    out = store.save(make_ckpt(b"doomed"), "disk", sync=True)
    assert out.status == "failed" and os.strerror(errno.ENOSPC) in out.detail
    assert store.counters["saves_failed"] == 1 and store.dump() == []
    assert os.listdir(store.tier("disk").root) == [".lock"]
    assert store.check() == []
    monkeypatch.setattr(tiers_mod, "fault_hook", None)
    assert store.save(make_ckpt(b"doomed"), "disk", sync=True).status == "published"


def test_one_store_per_data_dir(store: CacheStore, tmp_path: Path, shm_root: Path) -> None:
    with pytest.raises(StoreLocked):
        CacheStore(tmp_path / "data", {"ram_file": TierConfig(1, shm_root / "other")}).open()
    with pytest.raises(StoreLocked):  # nor two stores on one ram_file root
        CacheStore(tmp_path / "data2", {"ram_file": TierConfig(1, shm_root / "rf")}).open()


# ---- reconcile -------------------------------------------------------------------------------


def reopen(store: CacheStore, store_factory: StoreFactory, **quotas: int) -> CacheStore:
    store.close()
    return store_factory(**quotas)


def test_restart_keeps_file_rows_and_drops_ram_rows(store: CacheStore, store_factory: StoreFactory) -> None:
    d = save(store, b"on disk", "disk")
    f = save(store, b"on shm", "ram_file")
    save(store, b"in ram", "ram")
    assert restored_state(store, d.key) is not None
    store = reopen(store, store_factory)
    assert store.last_reconcile is not None and store.last_reconcile.ram_rows_dropped == 1
    assert keys(store) == {d.key, f.key}
    assert restored_state(store, f.key) == bytes(f.state)
    assert {r["key"]: r["hits"] for r in store.dump()}[d.key.hex()] == 1  # LRU touches survive close
    assert store.check() == []


def test_orphan_files_are_verified_then_adopted_with_aliases(
    store: CacheStore, store_factory: StoreFactory, tmp_path: Path
) -> None:
    prefix = SCHEME.key(b"adopt")
    a = save(store, b"adopt me", "disk", prefixes=((prefix, 5),))
    location = store.tier("disk").location_for(a.key.hex())
    shutil.copyfile(location, tmp_path / "keep")
    assert store.gc() == 1
    shutil.copyfile(tmp_path / "keep", location)
    disk_root = Path(location).parent
    (disk_root / f"{'0' * 64}.kvc").write_bytes(b"garbage")
    shutil.copyfile(tmp_path / "keep", disk_root / f"{'1' * 64}.kvc")  # valid bytes, wrong name
    (disk_root / ".tmp-99999-dead").write_bytes(b"half a checkpoint")
    store = reopen(store, store_factory)
    report = store.last_reconcile
    assert report is not None
    assert (report.adopted, report.corrupt_removed, report.temps_removed) == (1, 2, 1)
    assert store.counters["corrupt_files"] == 2
    hit = store.lookup(prefix)
    assert hit is not None and (hit.row_key, hit.n_tokens) == (a.key, 5)
    assert restored_state(store, a.key) == bytes(a.state)
    assert store.check() == []


def test_dead_reservations_and_missing_files_are_cleared(
    store: CacheStore, store_factory: StoreFactory
) -> None:
    a = save(store, b"prompt-A")
    os.unlink(store.tier("disk").location_for(a.key.hex()))
    store.index.reserve(
        SCHEME.key(b"dead"), "disk", 100, model="m", tokens=1, text_bytes=4, save_reason="cold"
    )
    store = reopen(store, store_factory)
    report = store.last_reconcile
    assert report is not None and (report.missing_dropped, report.reservations_cleared) == (1, 1)
    assert store.dump() == [] and store.stats()["tiers"]["disk"]["bytes"] == 0
    assert store.check() == []


def test_lowered_quota_evicts_lru_at_open(store: CacheStore, store_factory: StoreFactory) -> None:
    a, b, c = (save(store, f"prompt-{x}".encode()) for x in "ABC")
    assert restored_state(store, a.key) is not None
    store = reopen(store, store_factory, disk=ROOM_FOR_TWO)
    assert keys(store) == {a.key, c.key}
    assert store.last_reconcile is not None and store.last_reconcile.over_quota_removed == 1
    assert store.check() == []


def test_orphan_whose_key_lives_in_the_other_tier_is_removed(
    store: CacheStore, store_factory: StoreFactory
) -> None:
    a = save(store, b"prompt-A", "ram_file")
    copy = store.tier("disk").location_for(a.key.hex())
    shutil.copyfile(store.tier("ram_file").location_for(a.key.hex()), copy)
    store = reopen(store, store_factory)
    assert store.last_reconcile is not None and store.last_reconcile.duplicates_removed == 1
    assert not os.path.exists(copy) and keys(store, "ram_file") == {a.key}
    assert store.check() == []


def test_a_failed_payload_delete_does_not_poison_the_key(
    store: CacheStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = save(store, b"prompt-A")
    disk = store.tier("disk")

    def broken_delete(location: str) -> None:
        raise ValueError("simulated")

    monkeypatch.setattr(disk, "delete", broken_delete)
    assert store.gc() == 1  # the row goes; its file stays behind as an orphan
    monkeypatch.undo()
    assert any("has no row" in p for p in store.check())
    os.unlink(disk.location_for(a.key.hex()))
    disk.delete(disk.location_for(a.key.hex()))  # forget its size, as a reopen would
    save(store, b"prompt-A")
    assert restored_state(store, a.key) == bytes(a.state)  # the key is usable again
    assert store.check() == []


def test_the_memory_kind_and_frontier_reach_the_row_the_hit_and_an_adopted_row(
    store: CacheStore, store_factory: StoreFactory
) -> None:
    """A finish checkpoint's key covers prompt and reply, its state only the prompt: lookups must say how
    much of it a restore can use without reading the file, and so must a row rebuilt from the file."""
    ckpt = make_ckpt(b"a prompt and its reply", reason="finish", prefixes=((SCHEME.key(b"a prompt"), 8),))
    ckpt.memory, ckpt.frontier = "hybrid", 8
    assert store.save(ckpt, "disk", sync=True, timeout=10).status == "published"
    assert (store.lookup(ckpt.key).frontier, store.lookup(SCHEME.key(b"a prompt")).frontier) == (8, 8)
    assert [(r["memory"], r["frontier"], r["tokens"]) for r in store.dump()] == [("hybrid", 8, len(ckpt.tokens))]
    location = store.tier("disk").location_for(ckpt.key.hex())
    keep = Path(location).read_bytes()
    assert store.gc() == 1
    Path(location).write_bytes(keep)  # a file with no row, as after a crash between write and index
    store = reopen(store, store_factory)
    assert store.last_reconcile.adopted == 1
    assert [(r["memory"], r["frontier"]) for r in store.dump()] == [("hybrid", 8)]
    assert store.lookup(SCHEME.key(b"a prompt")).frontier == 8

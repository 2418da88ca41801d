"""The index at scale: LRU order and ranked aliases kept in LMDB (victims and alias hits read O(1) rows,
open reads each row once), deletions outside the write lock, gc in batches, a map that grows, and the
index format (format 1 indexes are read, unknown rows are dropped, never misread)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import lmdb
import pytest

from barreld.cache import CacheStore, Checkpoint, TierConfig, encoded_size, locks, tables
from barreld.cache import index as index_mod
from barreld.cache import rows as rows_mod
from barreld.cache.index import Index, Row
from barreld.names import TIER_RANK

from .conftest import SCHEME, make_ckpt

SHARED = SCHEME.key(b"ro")  # a prefix every row below is also findable under, like a common system prompt
STATE = 40


def rendered(i: int) -> bytes:
    return f"row {i:05d}".encode()


def ckpt(i: int, text: bytes | None = None) -> Checkpoint:
    """Row i; a fixed creation time, so every row of the same prompt length has the same size."""
    text = rendered(i) if text is None else text
    made = make_ckpt(text, STATE, prefixes=((SHARED, 2), (SCHEME.key(text[:-1]), len(text) - 1)))
    return replace(made, created=1.7e9)


SIZE = encoded_size(ckpt(0))
Stores = Callable[..., CacheStore]


@pytest.fixture
def stores(shm_root: Path) -> Iterator[Stores]:
    """Stores whose data dir, index included, is under /dev/shm: hundreds of saves in a second or two."""
    opened: list[CacheStore] = []

    def make(disk: int = 1 << 20, ram_file: int = 1 << 20, **kw: int) -> CacheStore:
        tiers = {"ram_file": TierConfig(ram_file, shm_root / "rf"), "disk": TierConfig(disk)}
        store = CacheStore(shm_root / "data", tiers, **kw).open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


class Decodes:
    """Counts the index rows decoded (whole, or their heads at open) while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        unpack = rows_mod.unpack

        def counted(key: bytes, raw: bytes) -> tuple:
            self.n += 1
            return unpack(key, raw)

        monkeypatch.setattr(rows_mod, "unpack", counted)


def fill(store: CacheStore, n: int, tier: str = "disk", start: int = 0) -> None:
    for i in range(start, start + n):
        assert store.save(ckpt(i), tier, sync=True, timeout=30).status == "published"


def index_of(store: CacheStore) -> Index:
    return store.index


def restore(store: CacheStore, key: bytes) -> bool:
    hit = store.lookup(key)
    assert hit is not None
    with store.restore(hit) as got:
        return got is not None


def keys(store: CacheStore) -> set[bytes]:
    return {bytes.fromhex(r["key"]) for r in store.dump()}


# ---- cost does not grow with the number of rows -------------------------------------------------


def test_a_save_into_a_full_tier_reads_a_few_rows_not_the_index(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = 300
    store = stores(disk=rows * SIZE)
    fill(store, rows)
    assert restore(store, ckpt(0).key) and restore(store, ckpt(1).key)  # touched in memory, not in LMDB
    decodes = Decodes(monkeypatch)
    assert store.save(ckpt(rows), "disk", sync=True).status == "published"
    assert decodes.n <= 8, f"a save into a full tier decoded {decodes.n} rows"
    gone = {ckpt(i).key for i in range(rows + 1)} - keys(store)
    assert gone == {ckpt(2).key}  # the least recently used: rows 0 and 1 were restored since
    assert store.counters["evictions"] == 1 and store.check() == []


def test_a_burst_of_restores_is_folded_in_short_transactions(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_mod, "FOLD_BATCH", 4)
    store = stores(disk=30 * SIZE)
    fill(store, 30)
    for i in reversed(range(20)):  # no write between them: 20 touches wait in memory
        assert restore(store, ckpt(i).key)
    folds: list[int] = []
    fold = index_mod.Batch.fold

    def recorded(batch: index_mod.Batch, touched: dict[bytes, tuple[int, int]]) -> None:
        folds.append(len(touched))
        fold(batch, touched)

    monkeypatch.setattr(index_mod.Batch, "fold", recorded)
    fill(store, 11, start=100)  # the full tier evicts the 11 least recently used rows
    assert max(folds) <= 4 and sum(folds) == 20
    evicted = {ckpt(i).key for i in range(30)} - keys(store)
    assert evicted == {ckpt(i).key for i in [*range(20, 30), 19]}
    assert store.check() == []


def test_the_best_of_many_rows_sharing_a_prefix_is_read_first(stores: Stores, monkeypatch: pytest.MonkeyPatch) -> None:
    store = stores()
    fill(store, 200)
    short = make_ckpt(b"row 7", STATE, prefixes=((SHARED, 2),))  # fewer tokens than every other disk row
    assert store.save(short, "disk", sync=True).status == "published"
    decodes = Decodes(monkeypatch)
    hit = store.lookup(SHARED)
    assert hit is not None and (hit.row_key, hit.n_tokens, hit.tier) == (short.key, 2, "disk")
    assert decodes.n <= 2, f"an alias hit shared by 201 rows decoded {decodes.n}"
    fast = ckpt(0, b"row in ram_file")
    assert store.save(fast, "ram_file", sync=True).status == "published"
    hit = store.lookup(SHARED)
    assert hit is not None and (hit.row_key, hit.tier) == (fast.key, "ram_file")  # the fastest tier first
    family = SCHEME.key(b"row 0001")  # prefix of rows 10-19, all 9 tokens in disk: the lowest key wins
    best = min((ckpt(i).key for i in range(10, 20)), key=lambda k: (TIER_RANK["disk"], 9, k))
    hit = store.lookup(family)
    assert hit is not None and (hit.row_key, hit.n_tokens) == (best, 8)
    assert store.check() == []


def test_open_reads_each_row_once_and_each_directory_once(
    stores: Stores, monkeypatch: pytest.MonkeyPatch, shm_root: Path
) -> None:
    store = stores()
    fill(store, 150)
    fill(store, 50, "ram_file", start=150)
    store.close()
    decodes = Decodes(monkeypatch)
    scans: list[str] = []
    real_scandir = index_mod.os.scandir

    def counted_scandir(path: object) -> object:
        scans.append(str(path))
        return real_scandir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(index_mod.os, "scandir", counted_scandir)
    monkeypatch.setattr(index_mod.os, "listdir", lambda path: pytest.fail(f"listed {path} again"))
    store = stores()
    assert decodes.n == 200
    assert sorted(scans) == sorted([str(shm_root / "data" / "kvc"), str(shm_root / "rf")])
    monkeypatch.undo()
    assert len(store.dump()) == 200 and store.check() == []


# ---- the structures are checked ---------------------------------------------------------------


def test_check_finds_broken_lru_alias_and_gone_entries(stores: Stores) -> None:
    store = stores()
    fill(store, 3)
    index = index_of(store)
    db = index.tables
    with db.env.begin(write=True) as txn:
        cur = txn.cursor(db=db.lru)
        assert cur.first()
        txn.delete(cur.key(), db=db.lru)
        txn.put(SCHEME.key(b"stray"), bytes(41), db=db.prefixes)
        txn.put(ckpt(2).key, b"disk\0/nowhere", db=db.gone)
    problems = store.check()
    assert any("missing from the lru order" in p for p in problems)
    assert any(p.startswith(f"alias {SCHEME.key(b'stray').hex()}") for p in problems)
    assert any("available but marked gone" in p for p in problems)


# ---- deletions outside the write lock; gc in batches --------------------------------------------


def _hold_deletes(store: CacheStore, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make the disk tier's deletions wait for `go`; `waiting` is set when one does."""
    disk = store.tier("disk")
    waiting, go = threading.Event(), threading.Event()
    real = disk.delete

    def slow(location: str) -> None:
        waiting.set()
        assert go.wait(30)
        real(location)

    monkeypatch.setattr(disk, "delete", slow)
    return waiting, go


def test_deletions_run_outside_the_write_lock(stores: Stores, monkeypatch: pytest.MonkeyPatch) -> None:
    store = stores(disk=5 * SIZE)  # full: the saves below fit only if the tier stopped counting the gc's files
    fill(store, 5)
    waiting, go = _hold_deletes(store, monkeypatch)
    gc = threading.Thread(target=store.gc)
    gc.start()
    try:
        assert waiting.wait(10)
        # The gc's rows are gone from the index; its files are not yet deleted, and the index is free.
        assert store.lookup(ckpt(0).key) is None
        assert store.save(ckpt(10), "disk", sync=True, timeout=10).status == "published"
        again = store.save(ckpt(0), "disk", sync=True, timeout=0.3)  # its old file is being deleted
        assert again.status == "timeout" and again.future is not None
    finally:
        go.set()
        gc.join(10)
    assert again.future.result(10).status == "published"
    hit = store.lookup(ckpt(0).key)
    assert hit is not None
    with store.restore(hit) as got:
        assert got is not None and bytes(got.state) == bytes(ckpt(0).state)  # not deleted with the old one
    assert keys(store) == {ckpt(0).key, ckpt(10).key} and store.check() == []


def test_gc_in_batches_spares_rows_used_after_it_began(stores: Stores, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_mod, "EVICT_BATCH", 2)
    store = stores()
    fill(store, 9)
    index = index_of(store)
    drain, batches, gc_thread = index.drain_touches, [], threading.get_ident()

    def between_batches() -> None:  # runs before each batch of the gc, outside the write lock (and in saves)
        if threading.get_ident() == gc_thread:
            if len(batches) == 1:
                assert store.save(ckpt(20), "disk", sync=True, timeout=10).status == "published"
                assert restore(store, ckpt(8).key)  # the most recent row, not evicted yet: now used again
            batches.append(len(store.dump()))
        drain()

    monkeypatch.setattr(index, "drain_touches", between_batches)
    with store.restore(store.lookup(ckpt(4).key)) as pinned:  # type: ignore[arg-type]
        assert pinned is not None
        assert store.gc() == 7  # 9 rows, less the pinned one and the one restored during the gc
    assert batches == [9, 8, 6, 4]  # 2, 2, 2 and the last one
    assert keys(store) == {ckpt(4).key, ckpt(8).key, ckpt(20).key}
    files = {Path(r["location"]).name for r in store.dump()}
    assert {p.name for p in (Path(store.tier("disk").root)).glob("*.kvc")} == files  # the rest deleted
    assert store.check() == []


def test_a_save_takes_over_the_deletion_of_its_keys_old_file(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gc deletes its files after its last transaction: a save of a key it removed does not wait for that."""
    monkeypatch.setattr(index_mod, "EVICT_BATCH", 2)
    store = stores()
    fill(store, 6)
    index = index_of(store)
    drain, saved, gc_thread = index.drain_touches, [], threading.get_ident()

    def between_batches() -> None:
        gone = store.lookup(ckpt(0).key) is None  # row 0 removed, its file not deleted yet
        if threading.get_ident() == gc_thread and gone and not saved:
            saved.append(store.save(ckpt(0), "disk", sync=True, timeout=10).status)
        drain()

    monkeypatch.setattr(index, "drain_touches", between_batches)
    assert store.gc() == 6
    assert saved == ["published"]
    assert restore(store, ckpt(0).key) and keys(store) == {ckpt(0).key} and store.check() == []


# ---- the map grows ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_map_grows_past_its_initial_size_without_a_failed_save(
    stores: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    initial = 256 << 10
    monkeypatch.setattr(tables, "INITIAL_MAP_SIZE", initial)
    store = stores(disk=1 << 30)
    fill(store, 10)
    done, errors = threading.Event(), []

    def reader() -> None:  # lookups go on while the map is replaced under them
        while not done.is_set():
            try:
                assert store.lookup(SHARED) is not None and store.lookup(ckpt(3).key) is not None
            except Exception as e:  # noqa: BLE001 - any failure of a reader is the finding
                errors.append(e)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        fill(store, 1190, start=10)
    finally:
        done.set()
        thread.join(10)
    assert errors == [] and store.counters["saves_failed"] == 0
    env = index_of(store).tables.env
    in_use = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    assert in_use > 2 * initial and env.info()["map_size"] > in_use
    assert store.check() == []
    store.close()
    store = stores(disk=1 << 30)  # reopened with the small size asked for: the data decides
    assert len(store.dump()) == 1200 and store.check() == []
    fill(store, 10, start=5000)


def test_a_full_map_fails_one_save_and_grows(stores: Stores, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tables, "INITIAL_MAP_SIZE", 256 << 10)
    monkeypatch.setattr(tables, "_GROW_AT", 100.0)  # never ahead of time: only after a MapFull
    store = stores(disk=1 << 30)
    outcomes = [store.save(ckpt(i), "disk", sync=True).status for i in range(1200)]
    assert "failed" in outcomes and store.counters["saves_failed"] == outcomes.count("failed")
    first = outcomes.index("failed")
    assert outcomes[first + 1] == "published"  # the map grew at the failure
    assert len(store.dump()) == outcomes.count("published") and store.check() == []


# ---- the index format ---------------------------------------------------------------------------


def _to_format_1(data: Path) -> None:
    """Rewrite a closed store's index as format 1 wrote it: JSON rows, an `aliases` table of row key ||
    u32 n_tokens, no meta, lru, prefixes or gone tables."""
    env = lmdb.open(str(data / "index.lmdb"), max_dbs=8)
    names = [b"meta", b"lru", b"prefixes", b"gone"]
    with env.begin(write=True) as txn:
        rows_db = env.open_db(b"rows", txn=txn)
        aliases = env.open_db(b"aliases", txn=txn, dupsort=True)
        rows = [Row.decode(k, v) for k, v in txn.cursor(db=rows_db)]
        for row in rows:
            d = {f: getattr(row, f) for f in Row.__dataclass_fields__ if f not in ("key", "tenant", "namespace")}
            d["aliases"] = [[a.hex(), n] for a, n in row.aliases]
            txn.put(row.key, json.dumps(d).encode(), db=rows_db)
            for a, n in row.aliases:
                txn.put(a, row.key + n.to_bytes(4, "little"), db=aliases)
        txn.put(b"\x01" * 32, b'{"model": "torn', db=rows_db)
        for name in names:
            txn.drop(env.open_db(name, txn=txn), delete=True)
    env.close()


def test_a_format_1_index_is_read_with_one_log_line(
    stores: Stores, shm_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = stores()
    fill(store, 20)
    assert restore(store, ckpt(3).key)
    before = store.dump()
    store.close()
    _to_format_1(shm_root / "data")
    with caplog.at_level(logging.INFO, logger="barreld.cache"):
        store = stores()
    lines = [r.getMessage() for r in caplog.records if "format" in r.getMessage()]
    assert lines == ["the cache index is in format 1: 20 rows rewritten in format 4, 1 dropped (a file whose "
                     "row is gone is verified and adopted at open)"]
    assert store.dump() == before  # every field, and the LRU order, as before
    hit = store.lookup(SHARED)
    assert hit is not None and hit.row_key == min(ckpt(i).key for i in range(20))
    assert store.last_reconcile is not None and store.last_reconcile.adopted == 0
    assert store.check() == []


Tamper = Callable[[lmdb.Transaction, tables.Tables], None]


def _tamper_and_reopen(
    store: CacheStore, stores: Stores, caplog: pytest.LogCaptureFixture, tamper: Tamper
) -> tuple[CacheStore, list[str]]:
    """Change the index by hand, then reopen the store: the new store and the warnings it logged."""
    index = index_of(store)
    with index.tables.env.begin(write=True) as txn:
        tamper(txn, index.tables)
    store.close()
    with caplog.at_level(logging.WARNING, logger="barreld.cache"):
        store = stores()
    return store, [r.getMessage() for r in caplog.records]


def test_an_unknown_index_format_is_dropped_and_its_files_adopted(
    stores: Stores, caplog: pytest.LogCaptureFixture
) -> None:
    store = stores()
    fill(store, 5)
    store, logged = _tamper_and_reopen(
        store, stores, caplog, lambda txn, db: txn.put(b"format", (99).to_bytes(4, "little"), db=db.meta)
    )
    assert logged == [
        "the cache index is in format 99, which this version cannot read: 0 rows rewritten in format 4, 5 "
        "dropped (a file whose row is gone is verified and adopted at open)"
    ]
    assert store.last_reconcile is not None and store.last_reconcile.adopted == 5
    assert keys(store) == {ckpt(i).key for i in range(5)} and store.check() == []


def test_an_unreadable_row_is_dropped_never_misread(stores: Stores, caplog: pytest.LogCaptureFixture) -> None:
    store = stores()
    fill(store, 4)

    def new_row_format(txn: lmdb.Transaction, db: tables.Tables) -> None:  # a format this version never wrote
        raw = txn.get(ckpt(1).key, db=db.rows)
        txn.put(ckpt(1).key, bytes([9]) + raw[1:], db=db.rows)

    store, logged = _tamper_and_reopen(store, stores, caplog, new_row_format)
    assert logged == ["the cache index held 1 unreadable rows: 1 dropped, 3 kept"]
    assert store.last_reconcile is not None and store.last_reconcile.adopted == 1  # its file, verified
    assert keys(store) == {ckpt(i).key for i in range(4)} and store.check() == []


def test_the_write_lock_serves_a_waiting_writer_before_its_holder_again() -> None:
    """A gc's transactions come back to back; a save waiting between them must get its turn."""
    lock = locks.FairLock()
    order: list[str] = []
    lock.acquire()

    def save() -> None:
        with lock:
            order.append("save")

    waiter = threading.Thread(target=save)
    waiter.start()
    while lock._next < 2:  # the save has taken its ticket and waits
        threading.Event().wait(0.001)
    lock.release()
    with lock:  # the gc's next transaction, straight away
        order.append("gc")
    waiter.join(10)
    assert order == ["save", "gc"]

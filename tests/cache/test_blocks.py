"""The block store: checkpoints sharing a prefix store its blocks once, restore byte for byte, and keep every
guarantee of the whole-state store (quotas by stored bytes, eviction by row, reconcile, corruption)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from barreld.cache import CacheStore, Checkpoint, TierConfig, statecut, stateformat
from barreld.cache.blocks import decode_block, encode_block
from barreld.cache.errors import CorruptCheckpoint
from barreld.cache.index import Index
from tests.cache import synthstate as ss
from tests.cache.conftest import SCHEME, flip_byte

B = 16  # block_tokens
LAYERS = (ss.Layer(1, 64, 1, 64), ss.Layer(1, 32, 1, 32))
SPEC = stateformat.StateSpec.for_memory("full")


def state(n: int, *, window: bool = False) -> bytes:
    """A state of n tokens whose cell bytes depend on the position only (as KV depends on the prefix)."""
    sections: list = [ss.Kv("attention", 1, False, 0, LAYERS, tuple(range(n)), 7)]
    if window:
        sections.append(ss.Kv("window", 1, False, 0, LAYERS[:1], tuple(range(max(0, n - 8), n)), 9))
    return ss.build(0, sections).data


def ckpt(n: int, tail: int = 0, *, window: bool = False, logits: bool = True) -> Checkpoint:
    """A checkpoint of n tokens 1..n, whose prompt's last `tail` tokens differ per n (same prefix, new end)."""
    tokens = [i + 1 for i in range(n - tail)] + [1000 + n + i for i in range(tail)]
    spec = stateformat.StateSpec.for_memory("swa" if window else "full")
    raw = state(n, window=window)
    c = Checkpoint.build(SCHEME, "test-model", b",".join(b"%d" % t for t in tokens), tokens, "cold", raw,
                         logits=b"\x00\x00\x80\x3f" * 4 if logits else None)
    c.layout = stateformat.parse(raw, spec).shape
    c.memory = "swa" if window else "full"
    return c


@pytest.fixture
def bstore(tmp_path: Path, shm_root: Path) -> Callable[..., CacheStore]:
    opened: list[CacheStore] = []

    def make(quota: int = 1 << 22, block_tokens: int = B) -> CacheStore:
        tiers = {"ram": TierConfig(quota), "ram_file": TierConfig(quota, shm_root / "rf"), "disk": TierConfig(quota)}
        s = CacheStore(tmp_path / "data", tiers, block_tokens=block_tokens).open()
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def restored(store: CacheStore, c: Checkpoint) -> bytes | None:
    hit = store.lookup(c.key)
    if hit is None:
        return None
    with store.restore(hit) as got:
        return None if got is None else bytes(got.state)


def block_files(store: CacheStore) -> list[Path]:
    return sorted(Path(store.data_dir / "kvc").glob("*.kvb"))


@pytest.mark.parametrize("tier", ["ram", "ram_file", "disk"])
def test_shared_prefix_is_stored_once_and_every_row_restores_its_own_bytes(bstore, tier: str) -> None:
    store = bstore()
    rows = [ckpt(64, 5), ckpt(70, 6), ckpt(80, 0)]  # 4 blocks each share the first 3 blocks (48 tokens)
    for c in rows:
        assert store.save(c, tier, sync=True).status == "published"
    for c in rows:
        assert restored(store, c) == bytes(c.state)  # byte for byte the state it was given
    stats = store.stats()["tiers"][tier]
    assert stats["stored_bytes"] == stats["bytes"] < stats["logical_bytes"]
    assert stats["dedup_ratio"] == pytest.approx(stats["logical_bytes"] / stats["bytes"])
    dump = {r["key"]: r for r in store.dump()}
    whole = dump[rows[2].key.hex()]
    assert whole["blocks"] == 5 and whole["shared_bytes"] > 0 and whole["own_bytes"] >= whole["size"]
    assert sum(r["own_bytes"] for r in dump.values()) + whole["shared_bytes"] == stats["bytes"]
    assert store.check() == []


def test_whole_states_when_block_tokens_is_zero(bstore) -> None:
    store = bstore(block_tokens=0)
    c = ckpt(64)
    store.save(c, "disk", sync=True)
    assert block_files(store) == [] and restored(store, c) == bytes(c.state)


def test_a_state_with_a_window_carries_it_whole(bstore) -> None:
    store = bstore()
    c = ckpt(40, window=True)
    store.save(c, "disk", sync=True)
    assert len(block_files(store)) == 2 and restored(store, c) == bytes(c.state)


def test_a_shared_block_is_deleted_with_its_last_row_only(bstore) -> None:
    store = bstore()
    a, b = ckpt(64, 5), ckpt(70, 6)
    for c in (a, b):
        store.save(c, "disk", sync=True)
    assert len(block_files(store)) == 5  # 3 shared + the 4th of each
    used = store.stats()["tiers"]["disk"]["bytes"]
    rows, freed = store.evict_bytes(1)  # the least recently used: a
    assert rows == 1 and 0 < freed < used and len(block_files(store)) == 4
    assert restored(store, a) is None and restored(store, b) == bytes(b.state)
    assert store.gc() == 1 and block_files(store) == [] and store.stats()["tiers"]["disk"]["bytes"] == 0
    assert store.check() == []


def test_quota_counts_stored_bytes_and_evicts_whole_rows(bstore) -> None:
    probe = bstore()
    probe.save(ckpt(64, 5), "disk", sync=True)
    one = probe.stats()["tiers"]["disk"]["bytes"]
    probe.gc()
    probe.close()
    store = bstore(quota=int(one * 2.2))
    for tail in range(5, 12):  # each row adds its last block and its own file: it shares 3 blocks
        assert store.save(ckpt(64, tail), "disk", sync=True).status == "published"
        assert store.stats()["tiers"]["disk"]["bytes"] <= store.stats()["tiers"]["disk"]["quota"]
        assert store.check() == []
    assert store.stats()["counters"]["evictions"] > 0
    assert store.stats()["tiers"]["disk"]["dedup_ratio"] > 1.5


def test_open_drops_rows_whose_blocks_are_missing_and_blocks_no_row_names(bstore) -> None:
    store = bstore()
    a, b = ckpt(64, 5), ckpt(80, 0)
    for c in (a, b):
        store.save(c, "disk", sync=True)
    last_of_b = store.index.get(b.key).blocks[-1]
    store.close()
    (store.data_dir / "kvc" / f"{last_of_b.hex()}.kvb").unlink()
    stray = store.data_dir / "kvc" / f"{'ab' * 32}.kvb"
    stray.write_bytes(b"".join(bytes(p) for p in encode_block(b"\xab" * 32, b"x" * 10)))
    store = bstore()
    report = store.last_reconcile
    # b's row is dropped, then its file refused for adoption; its 4th block (a's differs) and the stray go
    assert report.blocks_missing == 1 and report.corrupt_removed == 1 and report.orphan_blocks_removed == 2
    assert not stray.exists()
    assert restored(store, a) == bytes(a.state) and store.lookup(b.key) is None
    assert len(block_files(store)) == 4 and store.check() == []


def test_a_row_file_left_without_its_row_is_adopted_with_its_blocks(bstore) -> None:
    store = bstore()
    a = ckpt(64, 5)
    store.save(a, "disk", sync=True)
    store.close()
    import lmdb

    env = lmdb.open(str(store.data_dir / "index.lmdb"), max_dbs=8)
    with env.begin(write=True) as txn:
        for db in (b"rows", b"blocks", b"lru"):
            txn.drop(env.open_db(db, txn=txn), delete=False)
    env.close()
    store = bstore()
    assert store.last_reconcile.adopted == 1 and store.last_reconcile.orphan_blocks_removed == 0
    assert restored(store, a) == bytes(a.state) and store.check() == []


def test_a_corrupt_shared_block_makes_every_row_miss_until_a_save_writes_it_again(bstore) -> None:
    store = bstore()
    rows = [ckpt(64, 5), ckpt(70, 6), ckpt(80, 0)]
    for c in rows:
        store.save(c, "disk", sync=True)
    first = store.index.get(rows[0].key).blocks[0]
    path = store.data_dir / "kvc" / f"{first.hex()}.kvb"
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(raw)
    assert restored(store, rows[0]) is None  # dropped, counted
    assert restored(store, rows[1]) is None
    counters = store.stats()["counters"]
    assert counters["corrupt_blocks"] == 2 and counters["corrupt_files"] == 2
    assert store.save(rows[0], "disk", sync=True).status == "published"  # writes the block again
    assert restored(store, rows[2]) == bytes(rows[2].state)  # repaired by it, the same bytes by its key
    assert restored(store, rows[0]) == bytes(rows[0].state) and store.check() == []


def test_verify_checks_blocks(bstore) -> None:
    store = bstore()
    a, b = ckpt(64, 5), ckpt(16 * 5, 0)
    for c in (a, b):
        store.save(c, "disk", sync=True)
    path = store.data_dir / "kvc" / f"{store.index.get(b.key).blocks[-1].hex()}.kvb"
    os.truncate(path, 40)
    checked, bad = store.verify()
    assert checked == 2 and bad == [b.key.hex()] and restored(store, a) == bytes(a.state)


def test_a_block_file_is_verified_against_its_key_and_checksum() -> None:
    key = b"\x01" * 32
    raw = bytearray(b"".join(bytes(p) for p in encode_block(key, b"payload!")))
    assert bytes(decode_block(raw, key)) == b"payload!"
    with pytest.raises(CorruptCheckpoint, match="not a format 1 block of this key"):
        decode_block(raw, b"\x02" * 32)
    raw[60] ^= 1
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        decode_block(raw, key)


def test_a_row_file_names_blocks_that_chain_its_tokens(bstore) -> None:
    """A row whose block keys are not the chain of its own tokens is refused (its blocks would be another
    prompt's KV)."""
    from barreld.cache.blocks import split

    c = ckpt(64, 5)
    row, _ = split(c, B)
    row.check_key()
    row.chain = type(row.chain)(**{**row.chain.__dict__, "keys": row.chain.keys[::-1]})
    with pytest.raises(CorruptCheckpoint, match="chain"):
        row.check_key()


def test_an_index_of_format_2_is_read_as_whole_state_rows(bstore, caplog: pytest.LogCaptureFixture) -> None:
    """Rows written before blocks existed are whole-state rows: read, rewritten with one log line."""
    import lmdb

    from barreld.cache import rows as row_codec

    store = bstore(block_tokens=0)
    c = ckpt(64)
    store.save(c, "disk", sync=True)
    store.close()
    env = lmdb.open(str(store.data_dir / "index.lmdb"), max_dbs=8)
    with env.begin(write=True) as txn:
        rows = env.open_db(b"rows", txn=txn)
        raw = txn.get(c.key, db=rows)
        head = row_codec._ROW_HEAD.unpack_from(raw)
        assert head[12:] == (0, 0)
        at = row_codec._ROW_HEAD.size
        strings = b"\0".join(raw[at : at + head[9]].split(b"\0")[:6])  # format 2 knew no tenants
        txn.put(c.key, row_codec._ROW_HEAD_2.pack(2, *head[1:9], len(strings), *head[10:12]) + strings
                + raw[at + head[9] :], db=rows)
        txn.put(b"format", (2).to_bytes(4, "little"), db=env.open_db(b"meta", txn=txn))
    env.close()
    with caplog.at_level("WARNING", logger="barreld.cache"):
        store = bstore()
    assert [r.message for r in caplog.records if "format" in r.message] == [
        "the cache index is in format 2: 1 rows rewritten in format 4, 0 dropped (a file whose row is gone is "
        "verified and adopted at open)"]
    assert restored(store, c) == bytes(c.state) and store.check() == []


def test_a_row_file_is_format_2_and_never_read_as_a_whole_state() -> None:
    """A row's state section holds only its tail: it is written as format 2, and a format 1 header on it (what
    an older build would take for a whole state) is refused, as is a format 2 file without its chain."""
    import struct

    import xxhash

    from barreld.cache import decode, encode_parts
    from barreld.cache.blocks import split

    row, _ = split(ckpt(70, 6), B)
    raw = bytearray(b"".join(bytes(p) for p in encode_parts(row)))
    assert struct.unpack_from("<I", raw, 8)[0] == 2 and decode(raw).chain == row.chain
    struct.pack_into("<I", raw, 8, 1)
    raw[-16:] = xxhash.xxh3_128(raw[:-16]).digest()
    with pytest.raises(CorruptCheckpoint, match="chain"):
        decode(raw)


def test_every_block_boundary_of_a_stored_row_restores_that_prefix(bstore) -> None:
    """A row restored and cut at any block boundary is byte for byte the state of that many tokens."""
    store = bstore()
    c = ckpt(90)
    store.save(c, "disk", sync=True)
    with store.restore(store.lookup(c.key)) as got:
        layout = stateformat.parse(got.state, SPEC)
        for k in range(0, 90, B):
            assert bytes(statecut.cut(layout, k)) == state(k)


def test_a_row_that_a_later_row_of_blocks_extends_is_superseded(bstore) -> None:
    store = bstore()
    a, b = ckpt(40), ckpt(64)  # a's text and tokens are b's first; a: 2 blocks and 8 cells of its own
    store.save(a, "disk", sync=True)
    own = Path(store.dump()[0]["location"])
    assert store.save(b, "disk", sync=True, replaces=a.key).status == "published"
    assert store.stats()["counters"]["superseded"] == 1
    assert not own.exists() and [r["key"] for r in store.dump()] == [b.key.hex()]
    hit = store.lookup(a.key)  # a's key finds b now, for a's tokens: a resume by it restores from b
    assert (hit.row_key, hit.n_tokens, hit.total_tokens) == (b.key, len(a.tokens), len(b.tokens))
    assert len(block_files(store)) == 4 and restored(store, b) == bytes(b.state)
    assert store.check() == []


@pytest.mark.parametrize("case", ["text differs", "other tier", "whole states", "held by a reader", "itself", "window"])
def test_a_row_the_newer_row_does_not_cover_is_kept(bstore, case: str) -> None:
    store = bstore(block_tokens=0 if case == "whole states" else B)
    window = case == "window"  # restorable at its own length only: the newer row cannot serve its prefix
    a, b = ckpt(40, 3 if case == "text differs" else 0, window=window), ckpt(64, window=window)
    store.save(a, "ram_file" if case == "other tier" else "disk", sync=True)
    replaces = b.key if case == "itself" else a.key
    if case == "held by a reader":
        with store.restore(store.lookup(a.key)) as got:
            assert got is not None
            store.save(b, "disk", sync=True, replaces=replaces)
    else:
        store.save(b, "disk", sync=True, replaces=replaces)
    assert store.stats()["counters"]["superseded"] == 0
    assert restored(store, a) == bytes(a.state) and restored(store, b) == bytes(b.state)


@pytest.mark.parametrize("held", ["before its reservation", "reserved, its file being written"])
def test_a_row_still_being_written_is_superseded_once_it_is_published(bstore, monkeypatch, held: str) -> None:
    store = bstore()
    a, b = ckpt(40), ckpt(64)
    gate = threading.Event()
    index, tier = store.index, store.tier("disk")
    reserve, put = index.reserve, tier.put

    def held_reserve(key: bytes, *args, **kw):
        if key == a.key:
            assert gate.wait(10)
        return reserve(key, *args, **kw)

    def held_put(name: str, *args, **kw):
        if name == a.key.hex():
            assert gate.wait(10)
        return put(name, *args, **kw)

    if held == "before its reservation":
        monkeypatch.setattr(index, "reserve", held_reserve)
    else:
        monkeypatch.setattr(tier, "put", held_put)
    pending = store.save(a, "disk").future
    assert store.save(b, "disk", sync=True, replaces=a.key).status == "published"
    assert store.stats()["counters"]["superseded"] == 0  # a is not there yet
    gate.set()
    assert pending.result(10).status == "published"
    assert store.stats()["counters"]["superseded"] == 1 and [r["key"] for r in store.dump()] == [b.key.hex()]
    assert store.lookup(a.key).row_key == b.key and store.check() == []


def test_stats_keep_logical_bytes_without_reading_a_row(bstore, monkeypatch) -> None:
    store = bstore()
    for c in (ckpt(64, 5), ckpt(70, 6), ckpt(80, 0)):
        store.save(c, "disk", sync=True)
    store.evict_bytes(1)
    logical = {r.key: r.stored_bytes for r in store.index.rows()}
    assert len(logical) == 2

    def no_rows(self) -> None:
        raise AssertionError("cache stats read the rows")

    monkeypatch.setattr(Index, "rows", no_rows)
    assert store.stats()["tiers"]["disk"]["logical_bytes"] == sum(logical.values())
    monkeypatch.undo()
    store.close()
    reopened = bstore()  # counted again by the one pass at open
    assert reopened.stats()["tiers"]["disk"]["logical_bytes"] == sum(logical.values())
    assert reopened.check() == []


def _count_block_reads(store: CacheStore, tier: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every block location the tier is read at from now on."""
    t = store.tier(tier)
    reads: list[str] = []
    for name in ("read", "read_into"):
        if hasattr(t, name):
            real = getattr(t, name)

            def counted(location: str, *args, _real=real):
                if location.endswith(".kvb"):
                    reads.append(location)
                return _real(location, *args)

            monkeypatch.setattr(t, name, counted)
    return reads


def test_a_ram_restore_of_the_row_assembled_last_hands_that_assembly_back(bstore, monkeypatch) -> None:
    store = bstore()
    a, b = ckpt(64, 5), ckpt(80, 3)
    for c in (a, b):
        store.save(c, "ram", sync=True)
    assert restored(store, a) == bytes(a.state)
    reads = _count_block_reads(store, "ram", monkeypatch)
    assert restored(store, a) == bytes(a.state) and reads == []  # the same row file: no block read again
    assert restored(store, b) == bytes(b.state) and len(reads) == len(store.index.get(b.key).blocks)
    reads.clear()
    assert restored(store, a) == bytes(a.state) and len(reads) == len(store.index.get(a.key).blocks)


@pytest.mark.parametrize("tier", ["ram", "ram_file", "disk"])
def test_a_restored_state_is_read_only(bstore, tier: str) -> None:
    store = bstore()
    a = ckpt(64, 5)
    store.save(a, tier, sync=True)
    for _ in range(2):  # assembled, then (ram) handed back
        with store.restore(store.lookup(a.key)) as got:
            assert got is not None and memoryview(got.state).readonly and bytes(got.state) == bytes(a.state)


@pytest.mark.parametrize("tier", ["ram_file", "disk"])
def test_a_file_tier_reads_and_verifies_every_block_on_every_restore(bstore, tier: str, monkeypatch) -> None:
    store = bstore()
    a = ckpt(64, 5)
    store.save(a, tier, sync=True)
    assert restored(store, a) == bytes(a.state)
    reads = _count_block_reads(store, tier, monkeypatch)
    assert restored(store, a) == bytes(a.state) and len(reads) == len(store.index.get(a.key).blocks)
    flip_byte(reads[0], 100)
    assert restored(store, a) is None
    assert store.stats()["counters"]["corrupt_blocks"] == 1


def test_verify_hashes_the_ram_tiers_blocks(bstore) -> None:
    """A restore trusts a ram-tier block (this process's own memory); `cache verify` does not."""
    store = bstore()
    a = ckpt(64, 5)
    store.save(a, "ram", sync=True)
    assert restored(store, a) == bytes(a.state)
    tier = store.tier("ram")
    view = tier.read(tier.block_location(store.index.get(a.key).blocks[0].hex()))
    view[100] ^= 0xFF
    del view
    assert restored(store, a) == bytes(a.state)  # the assembly made before the damage, its row file unchanged
    checked, bad = store.verify()
    assert checked == 1 and bad == [a.key.hex()] and restored(store, a) is None


def test_a_ram_block_with_another_key_in_its_header_is_refused(bstore) -> None:
    """Not hashed again on a restore, a ram-tier block still has its header checked against its key."""
    store = bstore()
    a = ckpt(64, 5)
    store.save(a, "ram", sync=True)
    tier = store.tier("ram")
    view = tier.read(tier.block_location(store.index.get(a.key).blocks[0].hex()))
    view[16] ^= 0xFF  # the key field of the block's header
    del view
    assert restored(store, a) is None
    assert store.stats()["counters"]["corrupt_blocks"] == 1


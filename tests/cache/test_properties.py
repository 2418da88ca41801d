"""Stateful property test: random saves, lookups (exact and by prefix), restores (with held references),
gc, evict_bytes and restarts, checked step by step against a model of what an LRU cache with per-tier
quotas must hold. Evictions run in batches of two rows and writes fold one restore's touch each, so
every gc and most evictions take several transactions and touches wait in memory across writes; `check()`
verifies the index's LRU and alias structures after every step."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from barreld.cache import CacheStore, Checkpoint, TierConfig, blocks, encoded_size, stateformat
from barreld.cache import index as index_mod
from barreld.names import TIER_NAMES, TIER_RANK

from . import synthstate
from .conftest import SCHEME, make_ckpt

pytestmark = pytest.mark.slow  # hundreds of generated runs

QUOTAS = {"ram": 2600, "ram_file": 3600, "disk": 5000}
# Encoded sizes (two prefix aliases each) come out near 740, 990, 1630 and 3230 bytes: several fit per
# tier, the largest not in ram.
STATE_LENS = [40, 300, 900, 2500]


# Prefixes: b"prompt" of every row (6 tokens), b"prompt " of rows 0-9 (7), b"prompt 1" of rows 10-15 (8),
# which is also row 1's own prompt: an exact row wins over the aliases.
PROBES = [b"prompt", b"prompt ", b"prompt 1", b"prompt 2", b"prompt 12"]


def rendered(idx: int) -> bytes:
    return f"prompt {idx}".encode()


def aliases(text: bytes) -> tuple[tuple[bytes, int], ...]:
    return ((SCHEME.key(text[:6]), 6), (SCHEME.key(text[:-1]), len(text) - 1))


def checkpoint(idx: int, state_len: int) -> Checkpoint:
    text = rendered(idx)
    return make_ckpt(text, state_len, prefixes=aliases(text))


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.batches = index_mod.EVICT_BATCH, index_mod.FOLD_BATCH
        index_mod.EVICT_BATCH, index_mod.FOLD_BATCH = 2, 1
        self.root = Path(tempfile.mkdtemp(prefix="barrel-prop-", dir="/dev/shm"))
        self.store = self._open()
        self.tick = 0
        # key -> (tier, size, last use tick, state length): what the store must hold.
        self.rows: dict[bytes, tuple[str, int, int, int]] = {}
        self.pins: dict[bytes, ExitStack] = {}

    def _open(self) -> CacheStore:
        return CacheStore(
            self.root / "data",
            {
                "ram": TierConfig(QUOTAS["ram"]),
                "ram_file": TierConfig(QUOTAS["ram_file"], self.root / "rf"),
                "disk": TierConfig(QUOTAS["disk"]),
            },
        ).open()

    def _use(self, key: bytes) -> None:
        self.tick += 1
        tier, size, _, state_len = self.rows[key]
        self.rows[key] = (tier, size, self.tick, state_len)

    def _lru(self, tiers: tuple[str, ...]) -> list[bytes]:
        """Evictable rows of these tiers, least recently used first."""
        rows = [(r[2], k) for k, r in self.rows.items() if r[0] in tiers and k not in self.pins]
        return [k for _, k in sorted(rows)]

    @rule(idx=st.integers(0, 15), state_len=st.sampled_from(STATE_LENS), tier=st.sampled_from(TIER_NAMES))
    def save(self, idx: int, state_len: int, tier: str) -> None:
        self._save(checkpoint(idx, state_len), state_len, tier)

    def _expect(self, ckpt: Checkpoint, tier: str) -> tuple[str, list[bytes], int]:
        """What a save must do: its outcome, the rows it evicts, the bytes its row takes."""
        size = encoded_size(ckpt)
        victims: list[bytes] = []
        if ckpt.key in self.rows:
            return "duplicate", victims, size
        if size > QUOTAS[tier]:
            return "dropped", victims, size
        need = sum(r[1] for r in self.rows.values() if r[0] == tier) + size - QUOTAS[tier]
        for key in self._lru((tier,)):
            if need <= 0:
                break
            victims.append(key)
            need -= self.rows[key][1]
        return "dropped" if need > 0 else "published", victims, size

    def _save(self, ckpt: Checkpoint, state_len: int, tier: str) -> None:
        expected, victims, size = self._expect(ckpt, tier)
        assert self.store.save(ckpt, tier, sync=True, timeout=30).status == expected
        event(f"save {expected}" + (" after evicting" if victims and expected == "published" else ""))
        if expected == "published":
            for key in victims:
                del self.rows[key]
            self.rows[ckpt.key] = (tier, size, 0, state_len)
            self._use(ckpt.key)

    def _expected_hit(self, probe: bytes) -> tuple[bytes, int] | None:
        """What a lookup of `probe` must find: the exact row if there is one, else the best row holding
        the prefix (fastest tier, then fewest tokens, then lowest key), as (row key, tokens kept)."""
        key = SCHEME.key(probe)
        if key in self.rows:
            return key, len(probe)
        texts = {SCHEME.key(rendered(i)): rendered(i) for i in range(16)}
        holders = [
            (TIER_RANK[self.rows[k][0]], len(texts[k]), k, n)
            for k in self.rows
            for alias, n in aliases(texts[k])
            if alias == key
        ]
        return min(holders)[2:] if holders else None

    @rule(idx=st.integers(0, 15))
    def restore(self, idx: int) -> None:
        key = SCHEME.key(rendered(idx))
        hit = self.store.lookup(key)
        if key not in self.rows:  # nothing, or a longer row holding this prompt as a prefix
            assert (None if hit is None else (hit.row_key, hit.n_tokens)) == self._expected_hit(rendered(idx))
            return
        tier, _, _, state_len = self.rows[key]
        assert hit is not None and (hit.row_key, hit.tier) == (key, tier)
        with self.store.restore(hit) as got:
            assert got is not None
            assert bytes(got.state) == checkpoint(idx, state_len).state
        self._use(key)

    @rule(probe=st.sampled_from(PROBES))
    def lookup_prefix(self, probe: bytes) -> None:
        hit = self.store.lookup(SCHEME.key(probe))
        assert (None if hit is None else (hit.row_key, hit.n_tokens)) == self._expected_hit(probe)

    @precondition(lambda self: len(self.pins) < 3)
    @rule(idx=st.integers(0, 15))
    def pin(self, idx: int) -> None:
        """Enter a restore and keep it open: the row is referenced until unpinned."""
        key = SCHEME.key(rendered(idx))
        if key not in self.rows or key in self.pins:
            return
        stack = ExitStack()
        hit = self.store.lookup(key)
        assert hit is not None
        assert stack.enter_context(self.store.restore(hit)) is not None
        self.pins[key] = stack
        self._use(key)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.pins.pop(key).close()

    @rule()
    def gc(self) -> None:
        victims = self._lru(TIER_NAMES)
        assert self.store.gc() == len(victims)
        for key in victims:
            del self.rows[key]

    @rule(
        n=st.integers(0, 6000),
        tiers=st.none() | st.lists(st.sampled_from(TIER_NAMES), min_size=1, unique=True),
    )
    def evict_bytes(self, n: int, tiers: list[str] | None) -> None:
        victims, freed = [], 0
        for key in self._lru(tuple(tiers or TIER_NAMES)):
            if freed >= n:
                break
            victims.append(key)
            freed += self.rows[key][1]
        assert self.store.evict_bytes(n, tiers) == (len(victims), freed)
        event(f"evict_bytes evicted {min(len(victims), 2)}+")
        for key in victims:
            del self.rows[key]

    @rule()
    def restart(self) -> None:
        """Close and reopen: file rows (and their LRU order) survive, ram rows do not."""
        for stack in self.pins.values():
            stack.close()
        self.pins.clear()
        self.store.close()
        self.store = self._open()
        self.rows = {k: r for k, r in self.rows.items() if r[0] != "ram"}

    @invariant()
    def store_matches_model(self) -> None:
        dump = self.store.dump()  # most recently used first
        assert [(bytes.fromhex(r["key"]), r["tier"], r["size"]) for r in dump] == [
            (k, r[0], r[1]) for k, r in sorted(self.rows.items(), key=lambda kv: -kv[1][2])
        ]
        assert {bytes.fromhex(r["key"]) for r in dump if r["refcount"]} == set(self.pins)
        for name, usage in self.store.stats()["tiers"].items():
            assert usage["bytes"] <= usage["quota"] == QUOTAS[name]
        assert self.store.check() == []

    def teardown(self) -> None:
        for stack in self.pins.values():
            stack.close()
        self.store.close()
        index_mod.EVICT_BATCH, index_mod.FOLD_BATCH = self.batches
        shutil.rmtree(self.root, ignore_errors=True)


CacheMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cache_machine = CacheMachine.TestCase


BLOCK_TOKENS = 8
BLOCK_QUOTAS = {"ram": 3000, "ram_file": 4200, "disk": 6000}
BLOCK_LENS = [8, 20, 40]  # cells: 1, 2 and 5 whole blocks (a tail of 4 on 20)


def chained(idx: int, n: int) -> Checkpoint:
    """Row idx's checkpoint as blocks: tokens 0.. shared by every row up to a fork at (idx % 4) blocks, its
    own after; the KV of a cell depends on its position only, so equal block keys hold equal bytes."""
    fork = (idx % 4) * BLOCK_TOKENS
    tokens = [t if t < fork else 100 + idx for t in range(n)]
    kv = synthstate.Kv("attention", 1, False, 0, (synthstate.Layer(1, 16, 1, 16),), tuple(range(n)), 3)
    state = synthstate.build(0, [kv]).data
    text = rendered(idx)
    ckpt = Checkpoint.build(SCHEME, "test-model", text, tokens, "cold", state, logits=bytes(16),
                            prefixes=aliases(text))
    ckpt.layout = stateformat.parse(state, stateformat.StateSpec.for_memory("full")).shape
    return ckpt


class BlockCacheMachine(CacheMachine):
    """The same rules over the block store: a tier's bytes are its rows' own files plus each block it holds
    once; an eviction frees a row's blocks that no remaining row names; quotas count stored bytes."""

    def _open(self) -> CacheStore:
        tiers = {"ram": TierConfig(BLOCK_QUOTAS["ram"]), "ram_file": TierConfig(BLOCK_QUOTAS["ram_file"],
                 self.root / "rf"), "disk": TierConfig(BLOCK_QUOTAS["disk"])}
        return CacheStore(self.root / "data", tiers, block_tokens=BLOCK_TOKENS).open()

    def _chain(self, key: bytes) -> tuple[str, set[bytes], int]:
        tier, _, _, n = self.rows[key]
        idx = next(i for i in range(16) if SCHEME.key(rendered(i)) == key)
        split = blocks.split(chained(idx, n), BLOCK_TOKENS)
        chain = split[0].chain
        return tier, set(chain.keys), chain.block_size

    def _stored(self, tier: str, rows: list[bytes]) -> int:
        held: dict[bytes, int] = {}
        total = 0
        for key in rows:
            if self.rows[key][0] == tier:
                _, keys, size = self._chain(key)
                total += self.rows[key][1]
                held.update(dict.fromkeys(keys, size))
        return total + sum(held.values())

    def _freed(self, victims: list[bytes], tiers: tuple[str, ...]) -> int:
        before = {t: self._stored(t, list(self.rows)) for t in tiers}
        rest = [k for k in self.rows if k not in victims]
        return sum(before[t] - self._stored(t, rest) for t in tiers)

    @rule(idx=st.integers(0, 15), state_len=st.sampled_from(BLOCK_LENS), tier=st.sampled_from(TIER_NAMES))
    def save(self, idx: int, state_len: int, tier: str) -> None:
        self._save(chained(idx, state_len), state_len, tier)

    def _expect(self, ckpt: Checkpoint, tier: str) -> tuple[str, list[bytes], int]:
        size, quota = encoded_size(blocks.split(ckpt, BLOCK_TOKENS)[0]), BLOCK_QUOTAS[tier]
        if ckpt.key in self.rows:
            return "duplicate", [], size
        self.rows[ckpt.key] = (tier, size, self.tick + 1, len(ckpt.tokens))
        with_new = self._stored(tier, list(self.rows))
        added = with_new - self._stored(tier, [k for k in self.rows if k != ckpt.key])
        victims: list[bytes] = []
        for key in self._lru((tier,)):
            if with_new - self._freed(victims, (tier,)) <= quota:
                break
            if key != ckpt.key:
                victims.append(key)
        fits = added <= quota and with_new - self._freed(victims, (tier,)) <= quota
        del self.rows[ckpt.key]
        return "published" if fits else "dropped", victims, size

    def _expected_hit(self, probe: bytes) -> tuple[bytes, int] | None:
        key = SCHEME.key(probe)
        if key in self.rows:
            return key, self.rows[key][3]
        texts = {SCHEME.key(rendered(i)): rendered(i) for i in range(16)}
        holders = [(TIER_RANK[self.rows[k][0]], self.rows[k][3], k, n)
                   for k in self.rows for alias, n in aliases(texts[k]) if alias == key and n <= self.rows[k][3]]
        return min(holders)[2:] if holders else None

    @rule(idx=st.integers(0, 15))
    def restore(self, idx: int) -> None:
        key = SCHEME.key(rendered(idx))
        hit = self.store.lookup(key)
        if key not in self.rows:
            assert (None if hit is None else (hit.row_key, hit.n_tokens)) == self._expected_hit(rendered(idx))
            return
        assert hit is not None and (hit.row_key, hit.tier) == (key, self.rows[key][0])
        with self.store.restore(hit) as got:
            assert got is not None and bytes(got.state) == bytes(chained(idx, self.rows[key][3]).state)
        self._use(key)

    @rule(n=st.integers(0, 6000), tiers=st.none() | st.lists(st.sampled_from(TIER_NAMES), min_size=1, unique=True))
    def evict_bytes(self, n: int, tiers: list[str] | None) -> None:
        names = tuple(tiers or TIER_NAMES)
        victims: list[bytes] = []
        for key in self._lru(names):
            if self._freed(victims, names) >= n:
                break
            victims.append(key)
        freed = self._freed(victims, names)
        assert self.store.evict_bytes(n, tiers) == (len(victims), freed)
        for key in victims:
            del self.rows[key]

    @invariant()
    def store_matches_model(self) -> None:
        dump = self.store.dump()
        assert [(bytes.fromhex(r["key"]), r["tier"], r["size"]) for r in dump] == [
            (k, r[0], r[1]) for k, r in sorted(self.rows.items(), key=lambda kv: -kv[1][2])
        ]
        assert {bytes.fromhex(r["key"]) for r in dump if r["refcount"]} == set(self.pins)
        for name, usage in self.store.stats()["tiers"].items():
            assert usage["bytes"] == self._stored(name, list(self.rows)) <= usage["quota"] == BLOCK_QUOTAS[name]
        assert self.store.check() == []


BlockCacheMachine.TestCase.settings = settings(CacheMachine.TestCase.settings, max_examples=50,
                                               stateful_step_count=40)
test_block_cache_machine = BlockCacheMachine.TestCase

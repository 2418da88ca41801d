"""Stateful property test: random saves, lookups, restores (with held references), gc, evict_bytes and
restarts, checked step by step against a model of what an LRU cache with per-tier quotas must hold."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from barreld.cache import CacheStore, TierConfig, encoded_size
from barreld.names import TIER_NAMES

from .conftest import SCHEME, make_ckpt

QUOTAS = {"ram": 2600, "ram_file": 3600, "disk": 5000}
# Encoded sizes come out near 500, 780, 1380 and 2980 bytes: several fit per tier, the largest not in ram.
STATE_LENS = [40, 300, 900, 2500]


def rendered(idx: int) -> bytes:
    return f"prompt {idx}".encode()


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
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
        ckpt = make_ckpt(rendered(idx), state_len)
        size = encoded_size(ckpt)
        victims: list[bytes] = []
        if ckpt.key in self.rows:
            expected = "duplicate"
        elif size > QUOTAS[tier]:
            expected = "dropped"
        else:
            need = sum(r[1] for r in self.rows.values() if r[0] == tier) + size - QUOTAS[tier]
            for key in self._lru((tier,)):
                if need <= 0:
                    break
                victims.append(key)
                need -= self.rows[key][1]
            expected = "dropped" if need > 0 else "published"
        assert self.store.save(ckpt, tier, sync=True, timeout=30).status == expected
        event(f"save {expected}" + (" after evicting" if victims and expected == "published" else ""))
        if expected == "published":
            for key in victims:
                del self.rows[key]
            self.rows[ckpt.key] = (tier, size, 0, state_len)
            self._use(ckpt.key)

    @rule(idx=st.integers(0, 15))
    def restore(self, idx: int) -> None:
        key = SCHEME.key(rendered(idx))
        hit = self.store.lookup(key)
        if key not in self.rows:
            assert hit is None
            return
        tier, _, _, state_len = self.rows[key]
        assert hit is not None and (hit.row_key, hit.tier) == (key, tier)
        with self.store.restore(hit) as got:
            assert got is not None
            assert bytes(got.state) == make_ckpt(rendered(idx), state_len).state
        self._use(key)

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
        shutil.rmtree(self.root, ignore_errors=True)


CacheMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cache_machine = CacheMachine.TestCase

"""Every save reason and every policy gate, as rows in a real store (policy: align 16, trim 2, min 8)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import CHUNK, Engine, WatchedStore, plain


def reload(engine: Engine, **opts: object) -> None:
    engine.registry.unload("m")
    engine.load(**opts)


def test_a_cold_prefill_saves_at_its_aligned_boundary_then_the_finish(engine: Engine) -> None:
    mark = len(engine.backend().calls)
    reply = engine.run(plain(40, 1))
    cold, finish = engine.rows("cold"), engine.rows("finish")
    assert [r["tokens"] for r in cold] == [32]  # (40 - 2) // 16 * 16
    assert [(r["key"], r["tokens"]) for r in finish] == [(reply.done.key.hex(), 40 + 12)]
    assert engine.store.lookup(reply.done.prompt_key).n_tokens == 40  # the prompt is findable too
    assert [r["frontier"] for r in finish] == [40]  # the reply is in its key, not in its reusable state
    ends = [call.items[-1].pos for call in engine.backend().calls[mark:] if call.op == "decode"][:5]
    assert ends == [7, 15, 23, 31, 39]  # the capture at 32 left the prefill's chunks as they are
    assert engine.counter("saves_cold") == engine.counter("saves_finish") == 1


@pytest.mark.parametrize(
    ("prompt_tokens", "policy", "cold"),
    [
        (34, {}, [32]),  # 34 - 2 trimmed = 32
        (33, {}, [16]),  # 33 - 2 = 31, aligned down to 16
        (40, {"boundary_align_tokens": "12", "boundary_trim_tokens": "0"}, [32]),  # 36, down to a chunk (8)
        (15, {}, []),  # under cold_min_tokens (16)
        (40, {"cold_max_tokens": "16"}, [16]),
        (40, {"boundary_align_tokens": "8", "boundary_trim_tokens": "0"}, [40]),
        (40, {"cold_min_tokens": "41"}, []),
    ],
)
def test_cold_save_gates(engine: Engine, prompt_tokens: int, policy: dict, cold: list[int]) -> None:
    reload(engine, policy=policy)
    engine.run(plain(prompt_tokens, 2))
    assert [r["tokens"] for r in engine.rows("cold")] == cold
    assert len(engine.rows("finish")) == 1


def test_a_warm_start_past_the_cold_boundary_saves_no_cold_checkpoint(engine: Engine) -> None:
    a = plain(40, 3)
    engine.run(a)
    engine.restarted().run(a + plain(6, 4))  # 46 tokens: boundary 32 lies inside the restored 40
    assert len(engine.rows("cold")) == 1


def test_continued_saves_every_interval_of_generated_tokens(engine: Engine) -> None:
    reload(engine, policy={"continued_interval": "4"})
    engine.run(plain(20, 5), max_tokens=10)
    assert [r["tokens"] for r in engine.rows("continued")] == [24, 28]
    assert [r["tokens"] for r in engine.rows("finish")] == [30]
    assert {r["frontier"] for r in engine.rows() if r["save_reason"] != "cold"} == {20}


@pytest.mark.parametrize("min_tokens", ["infinity", "53"])
def test_min_tokens_gates_every_save(engine: Engine, min_tokens: str) -> None:
    reload(engine, policy={"min_tokens": min_tokens, "continued_interval": "4"})
    reply = engine.run(plain(40, 6))  # 52 tokens in all
    assert reply.done is not None and engine.rows() == []
    assert sum(engine.counter(f"saves_{r}") for r in ("cold", "continued", "finish", "evict")) == 0
    engine.registry.unload("m")
    assert engine.rows() == []


def test_claiming_a_sequence_saves_its_state_when_it_is_stored_nowhere(engine: Engine) -> None:
    engine.run(plain(40, 7))
    second = engine.run(plain(40, 8))  # claims the 1st one's sequence; its finish checkpoint is stored
    assert engine.rows("evict") == []
    engine.store.gc()
    engine.run(plain(40, 9))  # claims the 2nd one's sequence, whose checkpoint is gone
    assert [(r["key"], r["tokens"]) for r in engine.rows("evict")] == [
        (second.done.key.hex(), 40 + second.done.completion_tokens)
    ]


def test_cutting_a_live_sequence_saves_it_first_when_it_is_stored_nowhere(engine: Engine) -> None:
    a = plain(40, 10)
    engine.run(a)
    engine.rows()
    engine.store.gc()
    second = engine.run(a + plain(10, 11))
    assert second.route == "live" and engine.rows("evict") == []  # it kept all 40: nothing reusable was lost
    engine.store.gc()
    reply = engine.run(a[:25] + plain(20, 12))  # keeps 24 of the 49 prompt tokens
    assert reply.route == "live"
    assert [(r["key"], r["tokens"], r["frontier"]) for r in engine.rows("evict")] == [
        (second.done.key.hex(), 49 + second.done.completion_tokens, 49)
    ]


def test_unloading_saves_live_sequences_stored_nowhere(engine: Engine) -> None:
    reload(engine, n_seq_max=2)
    first = engine.run(plain(40, 12))
    engine.run(plain(40, 13))
    engine.rows()
    engine.store.gc()
    assert engine.registry.unload("m") == 2
    rows = engine.rows("shutdown")
    assert len(rows) == 2 and first.done.key.hex() in {r["key"] for r in rows}
    assert engine.restarted().run(plain(40, 12)).route == "exact"


def test_shutdown_saves_stop_at_evict_save_timeout(engine: Engine) -> None:
    reload(engine, policy={"evict_save_timeout_ms": "0"})
    engine.run(plain(40, 14))
    engine.rows()
    engine.store.gc()
    assert engine.registry.unload("m") == 0
    assert engine.rows() == []


def test_saves_go_to_the_models_tier(engine: Engine) -> None:
    reload(engine, tier="ram")
    a = plain(40, 15)
    engine.run(a)
    assert {r["tier"] for r in engine.rows()} == {"ram"}
    assert engine.restarted().run(a).started.cache.tier == "ram"


@pytest.fixture
def blocks_engine(tmp_path: Path) -> Iterator[Engine]:
    store = WatchedStore(tmp_path, block_tokens=CHUNK).open()
    e = Engine(tmp_path, store)
    e.load()
    yield e
    e.close()
    store.close()


def test_each_turn_of_a_conversation_supersedes_the_rows_of_the_turn_before(blocks_engine: Engine) -> None:
    engine = blocks_engine
    first = plain(40, 16)
    one = engine.run(first)
    kept = [r["key"] for r in engine.rows()]
    assert kept == [one.done.key.hex()] and engine.counter("superseded") == 1  # the cold capture went
    second = first + one.text + plain(30, 17)[1:]
    two = engine.run(second)
    assert [r["key"] for r in engine.rows()] == [two.done.key.hex()]
    assert engine.counter("superseded") == engine.counter("saves_cold") + engine.counter("saves_finish") - 1
    other = first + one.text + plain(30, 18)[1:]  # another second turn, resumed by the first turn's key
    branch = engine.restarted().run(other, parent_key=one.done.key)
    assert branch.started.cache.route == "resume" and branch.text == engine.cold(other).text
    # the first turn's row is gone: its prompt finds the second's, which keeps the first prompt's logits
    again = engine.restarted().run(first)
    assert again.started.cache.route == "exact" and again.started.cache.restored_tokens == 40
    assert again.started.cache.prefilled_tokens == 0
    assert again.text == engine.cold(first).text

"""The batch planner alone: pure, so its rules are checked on any mix of requests."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from barreld.engine.backend import BatchItem
from barreld.engine.plan import MIN_CHUNK, Slot, plan_batch


def slot(seq: int, pos: int, target: int, pending: int | None = None, cold_at: int | None = None) -> Slot:
    return Slot(seq, pos, list(range(100 + seq * 1000, 100 + seq * 1000 + target)), pending, cold_at)


def test_sampling_steps_come_first_then_prefill_chunks_within_n_batch() -> None:
    slots = [slot(0, 10, 40), slot(1, 5, 5, pending=7), slot(2, 0, 30)]
    batch = plan_batch(slots, cap=16, n_batch=24)
    assert batch.items[0] == BatchItem(7, 5, 1, True)
    assert [it.seq for it in batch.items] == [1] + [0] * 16 + [2] * 7
    assert batch.samples == [(1, 0)] and batch.prefills == [(0, 16), (2, 23)]
    assert [it.pos for it in batch.items if it.seq == 0] == list(range(10, 26))
    assert [it.logits for it in batch.items].count(True) == 3


def test_a_chunk_stops_at_the_cold_boundary_and_resumes_past_it() -> None:
    assert [it.pos for it in plan_batch([slot(0, 0, 40, cold_at=32)], 64, 64).items] == list(range(32))
    assert [it.pos for it in plan_batch([slot(0, 32, 40, cold_at=32)], 64, 64).items] == list(range(32, 40))


def test_prefill_only_leaves_sampling_steps_out() -> None:
    batch = plan_batch([slot(0, 5, 5, pending=3), slot(1, 0, 10)], 64, 64, prefill_only=True)
    assert batch.samples == [] and {it.seq for it in batch.items} == {1}


def test_no_room_means_no_chunk_rather_than_one_token() -> None:
    batch = plan_batch([slot(0, 5, 5, pending=1), slot(1, 0, 10)], 64, n_batch=2)
    assert [it.seq for it in batch.items] == [0]


@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.integers(1, 60), st.booleans(), st.one_of(st.none(), st.integers(0, 60))),
        max_size=6,
    ),
    st.integers(MIN_CHUNK, 40),
    st.integers(9, 64),
    st.booleans(),
)
def test_every_plan_keeps_the_rules(raw: list, cap: int, n_batch: int, prefill_only: bool) -> None:
    slots = []
    for seq, (pos, extra, decoding, cold_at) in enumerate(raw):
        pending = 1 if decoding else None
        cold = None if cold_at is None else min(cold_at, pos + extra)  # the worker's boundary is in the prompt
        slots.append(slot(seq, pos + extra if decoding else pos, pos + extra, pending, cold))
    batch = plan_batch(slots, cap, n_batch, prefill_only)
    assert len(batch.items) <= max(n_batch, len(slots))
    for s in slots:
        mine = [it for it in batch.items if it.seq == s.seq]
        assert [it.pos for it in mine] == list(range(s.pos, s.pos + len(mine)))
        if s.pending is not None:
            assert mine == ([] if prefill_only else [BatchItem(1, s.pos, s.seq, True)])
            continue
        assert [it.token for it in mine] == list(s.target[s.pos : s.pos + len(mine)])
        assert len(mine) <= cap and [it.logits for it in mine] == [False] * (len(mine) - 1) + [True] * bool(mine)
        end = s.cold_at if s.cold_at is not None and s.pos < s.cold_at else len(s.target)
        assert s.pos + len(mine) <= end and (len(mine) != 1 or end - s.pos == 1)  # never a one-token tail
        assert end - (s.pos + len(mine)) != 1 or not mine

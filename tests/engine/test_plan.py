"""The batch planner alone: pure, so its rules are checked on any mix of requests."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from barreld.engine.backend import BatchItem
from barreld.engine.plan import Slot, call_end, chunk_end, common_prefix_len, plan_batch


def slot(seq: int, pos: int, target: int, pending: int | None = None, stops: tuple[int, ...] = ()) -> Slot:
    return Slot(seq, pos, list(range(100 + seq * 1000, 100 + seq * 1000 + target)), pending, stops)


def test_whole_chunks_come_first_then_the_sampling_steps_within_n_batch() -> None:
    slots = [slot(0, 16, 40), slot(1, 5, 5, pending=7), slot(2, 0, 30), slot(3, 0, 30)]
    batch = plan_batch(slots, chunk=16, n_batch=40)
    assert batch.items[-1] == BatchItem(7, 5, 1, True)
    assert [it.seq for it in batch.items] == [0] * 16 + [2] * 16 + [1]
    assert batch.samples == [(1, 32)] and batch.prefills == [(0, 15), (2, 31)]
    assert [it.pos for it in batch.items if it.seq == 0] == list(range(16, 32))
    assert batch.waiting  # the fourth slot's chunk did not fit: it waits whole, never cut short


def test_each_prefill_goes_to_llama_cpp_in_a_call_of_its_own_and_the_sampling_steps_in_one() -> None:
    """llama.cpp cuts a batch of several sequences into micro-batches with equally many tokens of each: beside
    a sampling step a chunk's first token would be in one of its own. And kernels that take rows in groups
    count them from the call's first row: a prompt's last chunk of 5 tokens would put the next chunk at row 5."""
    slots = [slot(0, 32, 37), slot(1, 0, 40), slot(2, 3, 3, pending=9)]
    batch = plan_batch(slots, chunk=16, n_batch=64)
    assert [it.seq for it in batch.items] == [0] * 5 + [1] * 16 + [2]
    assert batch.calls == [(0, 5), (5, 21), (21, 22)]
    assert batch.prefills == [(0, 4), (1, 20)] and batch.samples == [(2, 21)]


def test_runs_of_equal_length_from_up_to_shared_sequences_share_a_call() -> None:
    """Where the probe proved it: llama.cpp keeps runs of equal length whole in one micro-batch, and takes
    several sequences into one only while each id follows the one before. A run of another length, of one
    token (the one-token path) or of a sequence out of that order is a call of its own; calls come in the order
    of their first sequences, and the sampling steps after them all."""
    slots = [slot(2, 32, 80), slot(0, 0, 40), slot(1, 16, 37), slot(3, 32, 37), slot(4, 0, 50), slot(5, 3, 3, 9),
             slot(6, 0, 1)]
    batch = plan_batch(slots, chunk=16, n_batch=80, shared=3)
    calls = [[(it.seq, it.pos) for it in batch.items[a:b]] for a, b in batch.calls]
    assert [sorted({seq for seq, _ in call}) for call in calls] == [[0, 1, 2], [3], [4], [6], [5]]
    assert calls[0] == [(s, p) for s, start in ((0, 0), (1, 16), (2, 32)) for p in range(start, start + 16)]
    assert batch.prefills == [(1, 15), (2, 31), (0, 47), (3, 52), (4, 68), (6, 69)] and batch.samples == [(5, 70)]
    two = plan_batch(slots, chunk=16, n_batch=80, shared=2)
    assert [sorted({it.seq for it in two.items[a:b]}) for a, b in two.calls] == [[0, 1], [2], [3], [4], [6], [5]]
    apart = plan_batch([slot(0, 0, 16), slot(1, 0, 5), slot(2, 0, 16)], chunk=16, n_batch=80, shared=3)
    assert [sorted({it.seq for it in apart.items[a:b]}) for a, b in apart.calls] == [[0], [1], [2]]  # 0, 2: not next
    assert plan_batch(slots, chunk=16, n_batch=80).calls == [(0, 16), (16, 32), (32, 48), (48, 53), (53, 69),
                                                             (69, 70), (70, 71)]  # not proven: a call each


def test_chunks_end_at_absolute_multiples_of_the_chunk_size() -> None:
    """A prefill that starts at a restored boundary splits where a cold one does, one-token tail included."""
    assert [it.pos for it in plan_batch([slot(0, 0, 41)], 16, 64).items] == list(range(16))
    assert [it.pos for it in plan_batch([slot(0, 32, 41)], 16, 64).items] == list(range(32, 41))
    assert [it.pos for it in plan_batch([slot(0, 32, 33)], 16, 64).items] == [32]
    assert chunk_end(40, 100, 16) == 48 and chunk_end(48, 100, 16) == 64 and chunk_end(96, 100, 16) == 100


def test_prefill_only_leaves_sampling_steps_out() -> None:
    batch = plan_batch([slot(0, 5, 5, pending=3), slot(1, 0, 10)], 64, 64, prefill_only=True)
    assert batch.samples == [] and {it.seq for it in batch.items} == {1}


def test_no_room_means_no_chunk_rather_than_part_of_one() -> None:
    batch = plan_batch([slot(0, 5, 5, pending=1), slot(1, 0, 10)], 8, n_batch=8)
    assert [it.seq for it in batch.items] == [0] and batch.waiting
    assert plan_batch([slot(1, 0, 10)], 8, n_batch=8, prefill_only=True).items[-1].pos == 7


def test_a_prefill_alone_takes_whole_chunks_up_to_n_batch_and_its_next_stop_in_one_call() -> None:
    batch = plan_batch([slot(0, 8, 100, stops=(80,))], 16, 64, merge=True)
    assert [it.pos for it in batch.items] == list(range(8, 64)) and batch.calls == [(0, 56)]
    assert batch.prefills == [(0, 55)] and [it.logits for it in batch.items].count(True) == 1
    assert plan_batch([slot(0, 64, 100, stops=(80,))], 16, 64, merge=True).items[-1].pos == 79
    assert plan_batch([slot(0, 96, 100)], 16, 64, merge=True).items[-1].pos == 99
    two = plan_batch([slot(0, 0, 100), slot(1, 0, 100)], 16, 64, merge=True)
    assert two.calls == [(0, 16), (16, 32)]  # with company, the canonical chunks
    assert plan_batch([slot(0, 0, 100)], 16, 64).calls == [(0, 16)]  # not proven: one chunk a call


def test_a_call_of_several_chunks_ends_on_a_chunk_boundary_or_the_prompt_end() -> None:
    assert call_end(0, 100, 16, 64) == 64 and call_end(8, 100, 16, 64) == 64 and call_end(8, 100, 16, 50) == 48
    assert call_end(8, 100, 16, 4) == 16  # the first chunk whatever the room
    assert call_end(0, 100, 16, 64, stops=(32,)) == 32 and call_end(0, 40, 16, 64) == 40
    assert call_end(0, 100, 16, 0) == chunk_end(0, 100, 16)


def test_common_prefix_of_token_lists() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2 and common_prefix_len([], [1]) == 0


@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(1, 60), st.booleans()), max_size=6),
    st.integers(1, 40),
    st.integers(9, 64),
    st.booleans(),
    st.sampled_from([0, 2, 3]),
)
def test_every_plan_keeps_the_rules(raw: list, chunk: int, n_batch: int, prefill_only: bool, shared: int) -> None:
    chunk = min(chunk, n_batch)
    slots = []
    for seq, (pos, extra, decoding) in enumerate(raw):
        pending = 1 if decoding else None
        aligned = pos // chunk * chunk  # a prefill resumes at a chunk boundary
        slots.append(slot(seq, pos + extra if decoding else aligned, pos + extra, pending))
    batch = plan_batch(slots, chunk, n_batch, prefill_only, shared=shared)
    assert len(batch.items) <= max(n_batch, len(slots))
    rows = [i for i, it in enumerate(batch.items) if slots[it.seq].pending is not None]
    assert rows == list(range(len(batch.items) - len(rows), len(batch.items)))  # sampling steps last
    for s in slots:
        mine = [it for it in batch.items if it.seq == s.seq]
        assert [it.pos for it in mine] == list(range(s.pos, s.pos + len(mine)))
        if s.pending is not None:
            assert mine == ([] if prefill_only else [BatchItem(1, s.pos, s.seq, True)])
            continue
        assert [it.token for it in mine] == list(s.target[s.pos : s.pos + len(mine)])
        assert [it.logits for it in mine] == [False] * (len(mine) - 1) + [True] * bool(mine)
        if mine:  # exactly the canonical chunk, in a llama.cpp call of its own or beside runs of its length
            assert s.pos + len(mine) == chunk_end(s.pos, len(s.target), chunk)
            first = batch.items.index(mine[0])
            call = next(batch.items[a:b] for a, b in batch.calls if a <= first < b)
            runs = {it.seq: sum(x.seq == it.seq for x in call) for it in call}
            ids = list(runs)
            assert call == mine or (len(mine) > 1 and set(runs.values()) == {len(mine)} and len(runs) <= shared
                                    and ids == list(range(ids[0], ids[0] + len(ids))))
        elif s.pos < len(s.target):
            assert batch.waiting
    assert [i for c in batch.calls for i in range(*c)] == list(range(len(batch.items)))
    for a, b in batch.calls[:-1] if batch.samples else batch.calls:  # runs sharing a call: each a sequence's own
        seqs = [it.seq for it in batch.items[a:b]]
        assert seqs == sorted(seqs, key=seqs.index)


def test_a_short_last_chunk_stays_a_call_of_its_own_when_chunks_are_merged() -> None:
    """Inside a larger call its tokens would take other kernels than the chunked prefill gives them (flash
    attention's tiled path from 64 rows; a token alone its own path), and the prompt's floats would depend on
    whether its prefill ran alone."""
    assert call_end(0, 650, 128, 512, min_batch=64) == 512 and call_end(512, 650, 128, 512, min_batch=64) == 640
    assert call_end(512, 710, 128, 512, min_batch=64) == 710  # a last chunk of 70 is merged
    assert call_end(0, 257, 128, 512) == 256 and call_end(0, 258, 128, 512) == 258  # one token alone; two merged
    assert call_end(0, 257, 128, 0) == 128


def test_a_call_ends_at_a_stop_inside_a_chunk() -> None:
    """A ring keeps a prompt's state at the last multiple of its grain short of its end (13,005 tokens: 12,992):
    the call stops there, as a warm start from that state splits the chunk, and the next call runs on."""
    assert call_end(12_800, 13_005, 128, 512, stops=(12_992,)) == 12_928  # the chunk before it: merged no further
    assert call_end(12_928, 13_005, 128, 512, stops=(12_992,)) == 12_992
    assert call_end(12_992, 13_005, 128, 512, stops=(12_992,)) == 13_005
    assert call_end(12_928, 13_005, 128, 0, stops=(12_992,)) == 12_992  # several sequences: the same split
    slot = Slot(0, 12_928, list(range(13_005)), None, stops=(12_992,))
    assert plan_batch([slot], 128, 512).calls == [(0, 64)]



def test_with_spans_every_call_holds_min_batch_tokens_across_chunk_boundaries() -> None:
    """Where the probe proved it: a warm start short of min_batch before a chunk boundary runs on through the
    next chunk, and a last chunk of fewer joins the call before it, alone or not, whatever the stops say."""
    assert call_end(1000, 1300, 128, 0, min_batch=64, spans=True) == 1152  # 24 to the boundary: and the next
    assert call_end(1000, 1050, 128, 0, min_batch=64, spans=True) == 1050
    assert call_end(1024, 1100, 128, 0, min_batch=64, spans=True) == 1100
    assert call_end(896, 1050, 128, 0, min_batch=64, spans=True) == 1050  # a last chunk of 26 joins it
    assert call_end(896, 1050, 128, 0, {1024}, min_batch=64, spans=True) == 1050
    assert call_end(0, 300, 128, 0, min_batch=64, spans=True) == 128  # a last chunk of 44 joins the next call
    assert call_end(128, 300, 128, 0, min_batch=64, spans=True) == 300
    assert call_end(0, 300, 128, 512, min_batch=64, spans=True) == 300  # merged: one call
    assert call_end(0, 300, 128, 200, min_batch=64, spans=True) == 128  # 256 would leave 44 alone
    assert call_end(0, 300, 128, 512, {128}, min_batch=64, spans=True) == 128
    assert call_end(0, 40, 128, 0, min_batch=64, spans=True) == 40  # a prompt that short has one call


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 700), st.integers(1, 700), st.sampled_from([16, 32, 128]), st.sampled_from([4, 8, 64]),
       st.booleans())
def test_with_spans_a_prefill_is_calls_of_min_batch_at_least(start: int, extra: int, chunk: int, min_batch: int,
                                                              alone: bool) -> None:
    assume(2 * min_batch <= chunk)  # the probe tries no fewest batch the chunk cannot hold twice
    end, pos, calls = start + extra, start, []
    while pos < end:
        stop = call_end(pos, end, chunk, 4 * chunk if alone else 0, min_batch=min_batch, spans=True)
        assert pos < stop <= end and (stop == end or stop % chunk == 0)
        assert stop - pos <= chunk + 2 * min_batch or alone  # n_batch at load holds the longest
        calls.append(stop - pos)
        pos = stop
    assert all(n >= min_batch for n in calls) or calls == [extra]  # only a prefill that short has fewer

"""ModelWorker over FakeBackend: batches, the one-token-batch rule, stored logits, cancellation, queue limits,
failures and the ways a reply ends."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from barreld.engine.backend import BatchItem, ContextSettings
from barreld.errors import InvalidArgument, ResourceExhausted, Unavailable
from tests.fakes.backend import EOG, FakeBackend, render_user_turn

from .conftest import CHUNK, Engine, WatchedStore, collect, greedy, plain


def reload(engine: Engine, **opts: object) -> None:
    engine.registry.unload("m")
    engine.load(**opts)


def prefill_batches(engine: Engine, after: int = 0, seq: int = 0) -> list[list[int]]:
    """Positions of the multi-position batches of `seq` decoded since call number `after`."""
    be = engine.backend()
    out = []
    for call in be.calls[after:]:
        items = [it.pos for it in call.items if it.seq == seq]
        if call.op == "decode" and items:
            out.append(items)
    return out


@pytest.mark.parametrize(
    ("extra", "chunks"),
    [(b"", []), (b"#", [[40]]), (b"#" * 9, [list(range(40, 48)), [48]])],
    ids=["same prompt", "one more token", "past a chunk boundary"],
)
def test_a_live_prefill_splits_where_the_cold_one_does(engine: Engine, extra: bytes, chunks: list) -> None:
    """Resent as is, the prompt samples from its stored logits; longer, it is prefilled from the last chunk
    boundary in the cold run's chunks, a one-token tail included (the cold run has the same one)."""
    a = plain(40, 1)
    engine.run(a)
    mark = len(engine.backend().calls)
    reply = engine.run(a + extra)
    assert reply.route == "live" and reply.started.cache.prefilled_tokens == len(extra)
    assert prefill_batches(engine, mark)[: len(chunks)] == chunks
    assert reply.text == engine.cold(a + extra).text


def test_an_exact_hit_with_stored_logits_samples_without_a_decode(engine: Engine) -> None:
    a = plain(40, 2)
    first = engine.run(a)
    later = engine.restarted()
    be = later.backend()
    mark = len(be.calls)  # after the load's own check of the state layout
    reply = later.run(a)
    assert reply.route == "exact" and reply.started.cache.prefilled_tokens == 0
    assert [c.op for c in be.calls[mark : mark + 2]] == ["state_set", "seq_rm"]  # restore, then the reply off
    assert [it.pos for it in be.calls[mark + 2].items] == [40]  # the first decode is the first sampled token
    assert reply.text == first.text == engine.cold(a).text


def test_a_cold_checkpoint_restored_whole_uses_its_logits(engine: Engine) -> None:
    engine.run(plain(40, 3))  # a cold checkpoint of its first 32 tokens
    a32 = plain(40, 3)[:31]
    later = engine.restarted()
    reply = later.run(a32)
    assert reply.route == "exact" and reply.started.cache.prefilled_tokens == 0
    assert reply.text == engine.cold(a32).text


def test_an_exact_hit_on_a_prefix_alias_does_not_use_logits_of_another_position(engine: Engine) -> None:
    reload(engine, policy={"cold_min_tokens": "1000"})
    a = plain(40, 32)
    engine.run(a)  # the finish checkpoint has the prompt's logits (position 40), aliases at 16 and 32
    head = a[:31]  # its first 32 tokens
    reply = engine.restarted().run(head)
    assert reply.route == "exact" and reply.started.cache.prefilled_tokens == CHUNK  # the last chunk again
    assert reply.text == engine.cold(head).text


def test_the_first_token_is_never_end_of_generation(engine: Engine) -> None:
    be = FakeBackend(engine.model_file, ContextSettings(n_ctx=32, n_batch=32))
    for seed in range(2000):  # a prompt whose most likely next token ends generation
        a = plain(20, seed)
        be.seq_rm(0, 0, -1)
        be.decode([BatchItem(t, i, 0, i == 19) for i, t in enumerate(be.tokenize(a))])
        if int(np.argmax(be.logits(19))) in EOG:
            break
    reply = engine.run(a)
    assert reply.done.completion_tokens >= 1 and reply.text
    assert reply.text == greedy(engine.model_file, be.tokenize(a))[1]


def test_every_prefill_splits_at_multiples_of_the_chunk_size(engine: Engine) -> None:
    reload(engine, policy={"prefill_chunk_size": "5"})
    a = plain(41, 4)
    mark = len(engine.backend().calls)
    reply = engine.run(a)
    chunks = prefill_batches(engine, mark)[: -reply.done.completion_tokens + 1]
    assert chunks == [list(range(p, min(p + 5, 41))) for p in range(0, 41, 5)]  # 8 x 5, then one token
    assert reply.text == engine.cold(a).text


def test_two_sequences_share_batches_and_reply_as_if_alone(engine: Engine) -> None:
    reload(engine, n_seq_max=2)
    be = engine.backend()
    a, b = plain(40, 5), plain(30, 6)
    be.hold()
    ra = engine.submit(a)
    assert be.wait_held()
    rb = engine.submit(b)
    be.release()
    first, second = collect(ra), collect(rb)
    assert any({it.seq for it in batch} == {0, 1} for batch in be.batches())
    assert first.text == engine.cold(a).text and second.text == engine.cold(b).text


def test_an_uncapped_prefill_runs_to_its_end_before_the_next_sampling_step(engine: Engine) -> None:
    reload(engine, n_seq_max=2, policy={"prefill_chunk_size": "infinity", "cold_min_tokens": "1000"})
    be = engine.backend()
    be.hold()
    ra = engine.submit(plain(20, 7), max_tokens=30)
    assert be.wait_held()
    rb = engine.submit(plain(150, 8))  # more than n_batch (64): three batches
    be.release()
    collect(ra), collect(rb)
    with_b = [batch for batch in be.batches() if any(it.seq == 1 for it in batch)]
    assert [sum(it.seq == 1 for it in batch) for batch in with_b[:3]] == [64, 64, 22]
    assert all(it.seq == 1 for batch in with_b[1:3] for it in batch)  # no sampling step in between


def test_a_cancelled_queued_request_fails_and_frees_nothing(engine: Engine) -> None:
    be = engine.backend()
    be.hold()
    running = engine.submit(plain(40, 9))
    assert be.wait_held()
    queued = engine.submit(plain(40, 10))
    queued.cancel()
    be.release()
    assert "cancelled" in str(collect(queued).error)
    assert collect(running).done.finish_reason == "length"


def test_a_running_request_cancelled_stops_after_its_next_step(engine: Engine) -> None:
    be = engine.backend()
    a = plain(CHUNK, 11)  # one prefill batch
    be.hold()
    req = engine.submit(a, max_tokens=50)
    assert be.wait_held()
    req.cancel()
    be.release()
    reply = collect(req)
    assert reply.done.finish_reason == "cancelled" and reply.done.completion_tokens == 1
    assert reply.text == engine.cold(a, max_tokens=1).text
    assert len(be.tokens(0)) == CHUNK  # the sampled token is text only: its KV would never be reused


def test_a_request_cancelled_mid_prefill_keeps_what_was_evaluated(engine: Engine) -> None:
    reload(engine, policy={"prefill_chunk_size": "10"})
    be = engine.backend()
    be.hold()
    req = engine.submit(plain(40, 12))
    assert be.wait_held()
    req.cancel()
    be.release()
    reply = collect(req)
    assert reply.done.finish_reason == "cancelled" and reply.done.completion_tokens == 0
    assert len(be.tokens(0)) == 10
    assert [r["tokens"] for r in engine.rows("finish")] == [10]


def test_the_queue_bound_refuses_at_once(tmp_path: Path, store: WatchedStore) -> None:
    engine = Engine(tmp_path, store, max_queue=1)
    engine.load()
    worker = engine.registry.get("m").worker
    be = engine.backend()
    be.hold()
    first = engine.submit(plain(40, 13))
    assert be.wait_held()
    second = engine.submit(plain(40, 14))
    with pytest.raises(ResourceExhausted, match="1 requests queued"):
        engine.submit(plain(40, 15))
    assert {k: worker.counts()[k] for k in ("running", "queued", "live")} == {"running": 1, "queued": 1, "live": 0}
    be.release()
    assert collect(first).done and collect(second).done
    assert {k: worker.counts()[k] for k in ("running", "queued", "live")} == {"running": 0, "queued": 0, "live": 1}
    engine.close()


def test_unloading_cancels_the_running_request_and_fails_the_queued(engine: Engine) -> None:
    be = engine.backend()
    worker = engine.registry.get("m").worker
    be.hold()
    running = engine.submit(plain(40, 16))
    assert be.wait_held()
    queued = engine.submit(plain(40, 17))
    unloading = threading.Thread(target=engine.registry.unload, args=("m",))
    unloading.start()
    be.release()
    unloading.join(10)
    assert collect(running).done.finish_reason == "cancelled"
    assert isinstance(collect(queued).error, Unavailable)
    with pytest.raises(Unavailable):
        worker.submit(queued.params)


def test_prompts_must_fit_the_context(engine: Engine) -> None:
    reload(engine, n_ctx=64)
    too_long = engine.run(plain(64, 18))
    assert isinstance(too_long.error, InvalidArgument) and "64 tokens" in str(too_long.error)
    reply = engine.run(plain(60, 19), max_tokens=100)
    tokens, text = greedy(engine.model_file, engine.backend().tokenize(plain(60, 19)), 100, n_ctx=64)
    assert reply.done.finish_reason == "length" and reply.done.completion_tokens == len(tokens) == 4
    assert reply.text == text


def test_a_failed_decode_fails_the_running_requests_and_the_model_goes_on(engine: Engine) -> None:
    engine.backend().fail_next("decode")
    failed = engine.run(plain(40, 20))
    assert "decode failed" in str(failed.error)
    a = plain(40, 21)
    assert engine.run(a).text == engine.cold(a).text


def test_a_refused_restore_falls_back_to_the_next_row_and_a_prefill(engine: Engine) -> None:
    a = plain(40, 22)
    engine.run(a)
    later = engine.restarted()
    later.backend().fail_next("state_set")  # the finish row, found under the prompt's key
    reply = later.run(a)
    assert (reply.route, reply.started.cache.restored_tokens) == ("longest_prefix", 32)  # the cold capture
    assert reply.text == engine.cold(a).text


def test_a_corrupt_checkpoint_is_dropped_and_the_prompt_prefilled(engine: Engine) -> None:
    a = plain(40, 23)
    engine.run(a)
    for row in engine.rows():
        path = Path(row["location"])
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    reply = engine.restarted().run(a)
    assert reply.route == "miss" and reply.text == engine.cold(a).text
    assert engine.counter("corrupt_files") >= 1


def test_a_request_that_fails_to_start_leaves_the_model_serving(engine: Engine) -> None:
    engine.run(plain(40, 24))
    engine.store.settle()
    engine.store.gc()
    engine.backend().fail_next("seq_rm")  # the claimed sequence cannot be cleared
    failed = engine.run(plain(40, 25))
    assert "failed to start" in str(failed.error)
    a = plain(40, 26)
    assert engine.run(a).text == engine.cold(a).text


def test_a_crashed_worker_fails_its_requests_and_refuses_new_ones(engine: Engine, monkeypatch) -> None:
    be = engine.backend()

    def broken(index: int) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(be, "logits", broken)
    reply = engine.run(plain(40, 27))
    assert "failed; see the daemon log" in str(reply.error)
    with pytest.raises(Unavailable):
        engine.submit(plain(40, 28))


def test_a_stop_string_ends_the_reply_before_it(engine: Engine) -> None:
    a = plain(40, 29)
    whole = engine.cold(a, max_tokens=20).text
    stop = whole[6:8]
    reply = engine.run(a, max_tokens=20, stop=(stop,))
    assert reply.done.finish_reason == "stop"
    assert reply.text == reply.streamed == whole[: whole.find(stop)]


def test_a_models_turn_end_ends_a_chat_reply_as_its_end_of_turn_token_would(engine: Engine) -> None:
    question = b"why is the sky blue?"
    whole = engine.run(question, chat=True, max_tokens=20).text
    end = next(whole[i : i + 2] for i in range(4, len(whole)) if whole[i : i + 2].isascii())
    reload(engine, stop=(end.decode(),))
    reply = engine.run(question, chat=True, max_tokens=20)
    assert reply.text == reply.streamed == whole[: whole.find(end)]
    assert reply.done.finish_reason == "stop" and reply.done.stop == b""  # the model ended its turn
    asked = engine.run(question, chat=True, max_tokens=20, stop=(end,))
    assert asked.text == reply.text and asked.done.stop == end  # the client's own stop string is named
    raw = render_user_turn(question)  # a raw prompt is no conversation: no turn to end
    assert engine.run(raw, max_tokens=20).text == engine.cold(raw, max_tokens=20).text == whole


def test_an_end_of_generation_token_ends_the_reply(engine: Engine) -> None:
    be = engine.backend()
    for seed in range(100):
        a = plain(20, 1000 + seed)
        tokens, text = greedy(engine.model_file, be.tokenize(a), max_tokens=200)
        if tokens[-1] in EOG:
            break
    reply = engine.run(a, max_tokens=200)
    assert reply.done.finish_reason == "stop" and reply.text == text
    assert reply.done.completion_tokens == len(tokens)


def test_seeded_sampling_replies_alike_warm_and_cold(engine: Engine) -> None:
    a = plain(40, 30)
    params = {"temperature": 0.9, "seed": 7}
    first = engine.run(a, **params)
    warm = engine.restarted().run(a, **params)
    assert warm.route == "exact" and warm.text == first.text == engine.cold(a, **params).text
    assert engine.cold(a, temperature=0.9, seed=8).text != first.text


def test_logprobs_cover_each_token_of_the_text_as_it_streams(engine: Engine) -> None:
    a = plain(30, 31)
    reply = engine.run(a, logprobs=3, max_tokens=20)
    entries = reply.done.logprobs
    assert entries and b"".join(e.chosen.text for e in entries) == reply.text
    assert reply.streamed_logprobs == entries
    for e in entries:
        assert len(e.top) == 3 and e.top[0].logprob >= e.chosen.logprob and e.chosen.logprob <= 0
        assert [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
    assert engine.run(a, max_tokens=20).done.logprobs == ()


def test_a_request_the_sampler_refuses_fails_alone(engine: Engine) -> None:
    a = plain(20, 32)
    beyond = engine.run(a, logit_bias=((10**6, 1.0),))
    assert isinstance(beyond.error, InvalidArgument) and "logit_bias key 1000000" in str(beyond.error)
    grammar = engine.run(a, grammar='root ::= "a"')  # the fake has no llama.cpp vocabulary to match against
    assert isinstance(grammar.error, InvalidArgument) and "grammar" in str(grammar.error)
    assert engine.run(a).text == engine.cold(a).text


def test_a_chat_turn_is_the_rendered_template(engine: Engine) -> None:
    be = engine.backend()
    reply = engine.run(b"why is the sky blue?", chat=True)
    rendered = render_user_turn(b"why is the sky blue?")
    assert reply.started.prompt_tokens == len(be.tokenize(rendered))
    assert reply.text == engine.cold(rendered).text


def test_timings_are_reported_in_milliseconds(engine: Engine) -> None:
    t = engine.run(plain(40, 31)).done.timings
    assert 0 <= t.lookup <= t.total and 0 < t.ttft <= t.total < 10_000

"""The reuse probe over FakeBackend, whose floats depend on the batch split as configured, and the engine
serving at the grain it finds: every reply a cold prefill's, the reply settled and reused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from barreld.engine.backend import ContextSettings
from barreld.engine.exactness import ReuseProbe, measure
from barreld.engine.registry import model_memory
from barreld.engine.sequence import PROMPT_LOGITS_KEPT, Sequence
from barreld.names import MemoryKind
from tests.fakes.backend import FakeBackend, write_gguf

from .conftest import CHUNK, Engine, WatchedStore, collect, plain

SETTINGS = ContextSettings(n_ctx=256, n_batch=64)


def opened(path: Path, settings: ContextSettings = SETTINGS) -> FakeBackend:
    return FakeBackend(path, settings)


@pytest.mark.parametrize("memory", [MemoryKind.FULL, MemoryKind.RECURRENT, MemoryKind.HYBRID])
def test_a_model_whose_floats_ignore_the_split_is_reusable_at_any_token_but_not_its_reply(
    tmp_path: Path, memory: MemoryKind
) -> None:
    be = opened(write_gguf(tmp_path / "m.gguf", memory=memory))
    verdict = measure(be, model_memory(be, 16))
    assert (verdict.grain, verdict.generated, verdict.source) == (1, False, "probe")  # a token alone differs
    assert be.seq_pos_range(0) == (-1, -1)  # the probe leaves its sequence empty


def test_a_split_sensitive_model_keeps_the_chunk_rule(tmp_path: Path) -> None:
    be = opened(write_gguf(tmp_path / "m.gguf", split=True))
    verdict = measure(be, model_memory(be, 16))
    assert verdict.grain == 16 and not verdict.merged
    be = opened(write_gguf(tmp_path / "fa.gguf"), ContextSettings(n_ctx=256, n_batch=64, flash_attn=True))
    verdict = measure(be, model_memory(be, 16))
    assert verdict.grain == 16 and not verdict.merged  # one call of 47 tokens is under the tiled path's 64


def test_calls_of_several_chunks_are_allowed_where_they_give_the_chunked_floats(tmp_path: Path) -> None:
    be = opened(write_gguf(tmp_path / "m.gguf"), ContextSettings(n_ctx=256, n_batch=128))
    verdict = measure(be, model_memory(be, 32))
    assert verdict.merged and "several chunks a call" in verdict.describe(32)
    be = opened(write_gguf(tmp_path / "fa.gguf"), ContextSettings(n_ctx=1024, n_batch=512, flash_attn=True))
    verdict = measure(be, model_memory(be, 128))
    assert (verdict.grain, verdict.min_batch, verdict.merged, verdict.spans) == (1, 64, True, True)
    be = opened(write_gguf(tmp_path / "n.gguf"), ContextSettings(n_ctx=256, n_batch=32))
    assert not measure(be, model_memory(be, 32)).merged  # n_batch is one chunk: nothing to merge


def test_a_model_whose_small_batches_take_another_path_is_reused_where_a_full_batch_follows(tmp_path: Path) -> None:
    """As llama.cpp's flash attention on the CPU under 64 tokens: the probe finds the fewest tokens a batch off
    a chunk boundary may hold, and with it the finest grain."""
    be = opened(write_gguf(tmp_path / "m.gguf", min_batch=8), ContextSettings(n_ctx=256, n_batch=128))
    verdict = measure(be, model_memory(be, 32))
    assert (verdict.grain, verdict.min_batch) == (1, 8)
    assert "at least 8 short of the prompt's end" in verdict.describe(32)  # every call holding 8 (spans)


class Crossing(FakeBackend):
    """Floats that also depend on a call crossing a chunk boundary (32) from a point off one: calls of several
    whole chunks and calls that run on through the next chunk both give other floats."""

    def _split(self, run: list[int]) -> bytes:
        crosses = run[0] % 32 and run[0] // 32 != run[-1] // 32
        return super()._split(run) + (b"x" if crosses else b"")


def test_calls_that_hold_min_batch_across_chunk_boundaries_are_allowed_where_they_give_the_chunked_floats(
    tmp_path: Path
) -> None:
    be = opened(write_gguf(tmp_path / "m.gguf", min_batch=8), ContextSettings(n_ctx=256, n_batch=128))
    verdict = measure(be, model_memory(be, 32))
    assert verdict.spans and "8 short of the prompt's end, every call holding 8" in verdict.describe(32)
    crossing = Crossing(write_gguf(tmp_path / "c.gguf", min_batch=8), ContextSettings(n_ctx=256, n_batch=128))
    verdict = measure(crossing, model_memory(crossing, 32))
    assert (verdict.grain, verdict.min_batch, verdict.merged, verdict.spans) == (1, 8, False, False)
    small = opened(write_gguf(tmp_path / "s.gguf", min_batch=8), ContextSettings(n_ctx=256, n_batch=40))
    assert not measure(small, model_memory(small, 32)).spans  # no room for 32 + 2 * 8 in a call
    plain_model = opened(write_gguf(tmp_path / "p.gguf"), ContextSettings(n_ctx=256, n_batch=128))
    assert not measure(plain_model, model_memory(plain_model, 32)).spans  # any two tokens do: nothing to gain


class Shifted(FakeBackend):
    """A ring whose floats follow where a call starts in its chunk (64): as Gemma 3's measured, a start off a
    multiple of 16 gives other floats, but for a few such starts (there 120 of 128, and 56 at some depths)."""

    def _split(self, run: list[int]) -> bytes:
        off = run[0] % 64
        return super()._split(run) + (b"s" if off % 16 and off not in (24, 56) else b"")


def test_a_ring_is_reused_at_the_grain_every_point_of_a_chunk_proves(tmp_path: Path) -> None:
    """Past its first wrap, with its fewest batch (a last call of under 8 tokens takes other kernels): the one
    point of each chunk that the other kinds try would have passed a grain of 8 here; a ring insensitive to
    the shift is reused at any token, with the fewest batch."""
    settings = ContextSettings(n_ctx=512, n_batch=64)
    shifted = Shifted(write_gguf(tmp_path / "r.gguf", memory=MemoryKind.SWA, window=32, min_batch=8), settings)
    memory = model_memory(shifted, 64)
    assert memory.ring
    verdict = measure(shifted, memory)
    assert (verdict.grain, verdict.min_batch, verdict.source) == (16, 8, "probe")
    plain_ring = opened(write_gguf(tmp_path / "p.gguf", memory=MemoryKind.SWA, window=32, min_batch=8), settings)
    plain = measure(plain_ring, model_memory(plain_ring, 64))
    assert (plain.grain, plain.min_batch) == (1, 8)
    assert shifted.seq_pos_range(0) == (-1, -1)


def test_prefills_of_several_sequences_share_a_call_where_each_gets_its_floats_alone(tmp_path: Path) -> None:
    settings = ContextSettings(n_ctx=256, n_batch=64, n_seq_max=3)
    be = opened(write_gguf(tmp_path / "m.gguf"), settings)
    verdict = measure(be, model_memory(be, 16))
    assert verdict.shared == 3 and "prefills of up to 3 sequences share a call" in verdict.describe(16)
    assert all(be.seq_pos_range(seq) == (-1, -1) for seq in range(3))  # the probe leaves them empty
    beside = opened(write_gguf(tmp_path / "b.gguf", beside=True), settings)
    assert measure(beside, model_memory(beside, 16)).shared == 0
    alone = opened(write_gguf(tmp_path / "a.gguf"), ContextSettings(n_ctx=256, n_batch=64))
    assert measure(alone, model_memory(alone, 16)).shared == 0  # one sequence: nothing to share
    ring = opened(write_gguf(tmp_path / "r.gguf", memory=MemoryKind.SWA, window=32), dataclasses.replace(
        settings, n_ctx=512))
    assert measure(ring, model_memory(ring, 64)).shared == 0  # its window is ordered after a lone call only


@pytest.mark.parametrize("beside", [False, True])
def test_prompts_arriving_together_prefill_in_shared_calls_and_reply_as_cold(
    tmp_path: Path, store: WatchedStore, beside: bool
) -> None:
    model = write_gguf(tmp_path / "fake.gguf", beside=beside)
    e = Engine(tmp_path, store, model_file=model, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    assert e.load(n_seq_max=3).exact_reuse.shared == (0 if beside else 3)
    be = e.backend()
    mark, prompts = len(be.calls), [plain(n, 20 + i) for i, n in enumerate((40, 35, 44))]  # last chunks 8, 3, 4
    be.hold()
    first = e.submit(prompts[0])
    assert be.wait_held()
    rest = [e.submit(p) for p in prompts[1:]]
    be.release()
    replies = [collect(r) for r in (first, *rest)]
    runs = [[sum(it.seq == s for it in c.items) for s in range(3)] for c in be.calls[mark:] if c.op == "decode"]
    assert ([CHUNK] * 3 in runs) == (not beside)  # the second chunk of one, the first of the others
    for prompt, reply in zip(prompts, replies, strict=True):
        assert reply.text == e.cold(prompt).text
    e.close()


def test_a_fewest_batch_the_chunk_cannot_hold_twice_keeps_the_chunk_rule(tmp_path: Path) -> None:
    be = opened(write_gguf(tmp_path / "m.gguf", min_batch=16), ContextSettings(n_ctx=256, n_batch=128))
    assert measure(be, model_memory(be, 16)).grain == 16


def test_no_room_for_a_probe_fails_safe_to_the_chunk_rule(tmp_path: Path) -> None:
    be = opened(write_gguf(tmp_path / "m.gguf"), ContextSettings(n_ctx=32, n_batch=32))
    assert measure(be, model_memory(be, 16)).grain == 16


def test_a_verdict_is_remembered_per_file_and_settings(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    probe = ReuseProbe(tmp_path / "memo.json")
    be = opened(path)
    first = probe(be, model_memory(be, 16), path, SETTINGS)
    be = opened(path)
    again = probe(be, model_memory(be, 16), path, SETTINGS)
    assert (first.source, again.source, again.grain) == ("probe", "memo", first.grain)
    assert not be.ops("decode")
    be = opened(path)
    other = probe(be, model_memory(be, 32), path, SETTINGS)  # another chunk size: measured again
    assert other.source == "probe"


@pytest.mark.parametrize(("forced", "min_batch", "chunk"), [(None, 0, CHUNK), (CHUNK, 0, CHUNK), (None, 8, 16)])
def test_a_chat_at_the_measured_grain_replies_as_cold_and_reuses_the_settled_reply(
    tmp_path: Path, store: WatchedStore, forced: int | None, min_batch: int, chunk: int
) -> None:
    model = write_gguf(tmp_path / "fake.gguf", min_batch=min_batch)
    e = Engine(tmp_path, store, model_file=model, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    policy = {"settle_tokens": "infinity", "prefill_chunk_size": str(chunk)}
    loaded = e.load(policy=policy | ({} if forced is None else {"reuse_grain": str(forced)}))
    assert loaded.memory.grain == (forced or 1) and loaded.exact_reuse.source == ("forced" if forced else "probe")
    assert loaded.memory.min_batch == (min_batch or 2)
    prompt, restores, previous = plain(37, 1), [], 0
    for turn in range(4):
        reply = e.run(prompt)
        assert reply.text == e.cold(prompt).text, turn
        restored = reply.started.cache.restored_tokens
        if turn:
            assert reply.route == "live" and restored > previous  # the previous prompt and its reply, settled
            restores.append(restored)
        e.wait_settled()
        previous = reply.started.prompt_tokens
        prompt = prompt + reply.text + plain(11, turn + 2)[1:]
    assert e.counter("settled_tokens") > 0
    # the coarse rule keeps whole chunks; the measured grain reuses past them (off the chunks at least once)
    assert all(r % chunk == 0 for r in restores) if forced else any(r % chunk for r in restores)
    e.close()


def test_the_same_prompt_after_its_reply_settled_samples_from_its_kept_logits(tmp_path: Path, store: WatchedStore
                                                                              ) -> None:
    e = Engine(tmp_path, store, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    e.load(policy={"settle_tokens": "infinity"})
    prompt = plain(37, 3)
    first = e.run(prompt)
    e.wait_settled()
    assert e.counter("settled_tokens") > 0
    again = e.run(prompt)
    assert (again.route, again.started.cache.restored_tokens) == ("live", 37)  # no prefill at all
    assert again.text == first.text
    e.close()


def test_a_bulk_extend_equals_appending_one_by_one() -> None:
    one, bulk = Sequence(0), Sequence(1)
    one.append(7, b"ab", prefilled=True)
    bulk.append(7, b"ab", prefilled=True)
    for t, piece in ((1, b"c"), (2, b""), (3, b"def")):
        one.append(t, piece, prefilled=True)
    bulk.extend_prefilled([1, 2, 3], [b"c", b"", b"def"])
    assert (bulk.tokens, bulk.offsets, bytes(bulk.rendered), bulk.frontier) == (
        one.tokens, one.offsets, bytes(one.rendered), one.frontier)


def test_a_sequence_keeps_the_logits_of_its_latest_prompts_while_its_tokens_still_hold_them() -> None:
    seq = Sequence(0)
    seq.extend_prefilled(list(range(40)), [b"x"] * 40)
    rows = {n: np.full(4, n, dtype=np.float32) for n in range(1, PROMPT_LOGITS_KEPT + 3)}
    seq.keep_logits(rows)
    assert sorted(seq.prompt_logits) == list(range(3, PROMPT_LOGITS_KEPT + 3))  # the latest ones
    assert seq.logits_at(5) == 5 and seq.logits_at(2) is None
    seq.truncate(6)
    assert sorted(seq.prompt_logits) == [3, 4, 5, 6] and seq.logits_at(6) == 6
    assert seq.frontier_logits is None  # whether the cut is the prompt's own state is the memory's to say


def test_a_recurrent_state_stored_off_the_chunks_is_found_by_a_longer_prompt(tmp_path: Path, store: WatchedStore
                                                                            ) -> None:
    """At grain 1 a recurrent model keeps its prompt's state at the prompt's end (37 tokens, between the
    chunk boundaries that a longest-prefix walk probes): the walk meets the row under 32 and confirms the
    prompt holds the rest, so a longer prompt restores all 37 after a restart, not the snapshot at 16."""
    model = write_gguf(tmp_path / "recurrent.gguf", memory=MemoryKind.RECURRENT)
    e = Engine(tmp_path, store, model_file=model, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    assert e.load().memory.grain == 1
    a = plain(37, 4)
    e.run(a)
    prompt = a + b"&" + plain(20, 5)[1:]
    reply = e.restarted().run(prompt)
    assert (reply.route, reply.started.cache.restored_tokens) == ("longest_prefix", 37)
    assert reply.text == e.cold(prompt).text
    other = e.restarted().run(a[:-2] + b"&&" + plain(20, 6)[1:])  # leaves it at 35: only the snapshot at 16
    assert (other.route, other.started.cache.restored_tokens) == ("longest_prefix", 16)
    assert e.counter("reuse_refused") == 0
    e.close()


def test_a_prompts_one_token_last_chunk_is_a_call_of_its_own_even_in_a_lone_prefill(tmp_path: Path,
                                                                                    store: WatchedStore) -> None:
    """A lone prefill puts several chunks in one call, but not a last chunk of fewer than min_batch tokens
    (here one): a prompt cut back to its last chunk boundary after a restart prefills that token alone, and a
    cold prefill must have given it the same kernels, whether or not it ran beside another sequence."""
    e = Engine(tmp_path, store, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    assert e.load().exact_reuse.merged
    prompt = plain(4 * CHUNK + 1, 9)
    e.run(prompt + plain(20, 10)[1:])
    reply = e.restarted().run(prompt)
    assert (reply.started.cache.restored_tokens, reply.started.cache.prefilled_tokens) == (4 * CHUNK, 1)
    assert reply.text == e.cold(prompt).text
    e.close()


def test_with_calls_of_min_batch_a_state_is_restored_to_its_end_and_warm_starts_fall_near_chunk_boundaries(
    tmp_path: Path, store: WatchedStore
) -> None:
    """Every call holding 8 tokens at least (spans): a prompt's 3-token last chunk joined the call before it,
    so after a restart a longer prompt restores all 67 tokens (the rule for a short last chunk otherwise: 64);
    and a live sequence is cut at 61, 3 short of a chunk boundary (the warm start's first call runs on through
    the next chunk; otherwise: 56). Every reply a cold prefill's."""
    model = write_gguf(tmp_path / "fake.gguf", min_batch=8)
    e = Engine(tmp_path, store, model_file=model, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    loaded = e.load(policy={"prefill_chunk_size": "16"})
    assert loaded.exact_reuse.spans and loaded.memory.spans
    head = plain(4 * 16 + 3, 12)
    e.run(head)
    prompt = head + plain(20, 13)[1:]
    reply = e.restarted().run(prompt)
    assert (reply.route, reply.started.cache.restored_tokens) == ("longest_prefix", 4 * 16 + 3)
    assert reply.text == e.cold(prompt).text
    head = plain(4 * 16 - 3, 14)
    e.run(head)
    prompt = head + plain(20, 15)[1:]
    reply = e.run(prompt)
    assert (reply.route, reply.started.cache.restored_tokens) == ("live", 4 * 16 - 3)
    assert reply.text == e.cold(prompt).text
    e.close()


def test_a_prompt_whose_short_last_chunk_settled_again_is_not_restored_whole_from_its_kept_logits(
    tmp_path: Path, store: WatchedStore
) -> None:
    """A prompt of 4 chunks and one token prefills that token alone; settling its reply prefills the token
    again inside a full batch (other KV). The live sequence cut back to the prompt, kept logits and all, is then
    not the prompt's state: the same prompt sent again restores the finish row, saved before the settling
    (the prompt's own state and logits), and replies as cold."""
    e = Engine(tmp_path, store, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    e.load(policy={"settle_tokens": "infinity"})
    prompt = plain(4 * CHUNK + 1, 12)
    e.run(prompt)
    e.wait_settled()
    assert e.counter("settled_tokens") > 0
    again = e.run(prompt)
    assert (again.route, again.started.cache.restored_tokens) == ("exact", 4 * CHUNK + 1)
    assert again.text == e.cold(prompt).text
    e.close()


def test_a_prompt_ending_off_the_grain_settled_again_is_not_restored_whole_from_its_kept_logits(
    tmp_path: Path, store: WatchedStore
) -> None:
    """On a model whose floats follow the split (the chunk rule), a prompt's last two tokens, past its last
    chunk boundary, are computed again inside a full chunk when its reply settles: the live sequence cut back
    to the prompt is not its state, so it is not restored whole with its kept logits."""
    model = write_gguf(tmp_path / "split.gguf", split=True)
    e = Engine(tmp_path, store, model_file=model, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    assert e.load(policy={"settle_tokens": "infinity"}).memory.grain == CHUNK
    prompt = plain(4 * CHUNK + 2, 13)
    e.run(prompt)
    e.wait_settled()
    assert e.counter("settled_tokens") > 0
    again = e.run(prompt)
    assert (again.route, again.started.cache.restored_tokens) != ("live", 4 * CHUNK + 2)
    assert again.text == e.cold(prompt).text
    e.close()


@pytest.mark.parametrize("min_batch", [0, 8])
def test_a_conversation_replayed_after_a_restart_samples_its_prompts_from_a_later_turns_row(
    tmp_path: Path, min_batch: int
) -> None:
    """A turn's row supersedes the one before (blocks), so after a restart most earlier prompts are exact hits
    in a later turn's row. With the logits the conversation kept after each prompt (the latest
    PROMPT_LOGITS_KEPT, where the next turn's tokens still hold it), each samples at once, where it prefilled its
    last min_batch tokens or so before. A prompt whose last chunk took other kernels (one token, by default)
    keeps no logits in a row: a cut there is not its state, so that token is prefilled again. Every reply cold."""
    store = WatchedStore(tmp_path, block_tokens=16).open()
    model = write_gguf(tmp_path / "fake.gguf", min_batch=min_batch)
    e = Engine(tmp_path, store, model_file=model, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    e.load(policy={"prefill_chunk_size": "16", "cold_min_tokens": "4096"}, n_ctx=1024)  # finish rows only
    prompts, prompt = [], plain(37, 20)
    for turn, extra in enumerate((11, 16, 13, 20, 12, 9, 15, 17, 10)):
        prompts.append(prompt)
        reply = e.run(prompt)
        prompt = prompt + reply.text + plain(extra, 21 + turn)[1:]
    kept = {n for seq in e.registry.get("m").worker.seqs for n in seq.prompt_logits}
    assert len(kept) == PROMPT_LOGITS_KEPT and len(e.rows()) < len(prompts) // 2
    replay, whole = e.restarted(), 0
    for turn, prompt in enumerate(prompts):
        reply = replay.run(prompt)
        n, cache = reply.started.prompt_tokens, reply.started.cache
        assert reply.text == e.cold(prompt).text, turn
        if n % 16 == 1 and not min_batch:  # a one-token last chunk
            assert cache.prefilled_tokens == 1, turn
        elif n in kept:
            assert (cache.route, cache.prefilled_tokens) == ("exact", 0), turn
            whole += 1
    assert whole >= PROMPT_LOGITS_KEPT - 2
    e.close()
    store.close()

"""Every route on every memory kind over FakeBackend: the reply is always a cold prefill's, and a route the
kind's rules refuse says so (reuse_refused, or a miss). Split-sensitive models throughout, as Gemma is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from barreld.engine.chat import Message
from barreld.engine.request import Done
from barreld.names import MemoryKind
from tests.fakes.backend import write_gguf

from .conftest import CHUNK, Engine, WatchedStore, plain

WINDOW = 24
KINDS = {  # name: (memory kind, swa_full)
    "full": (MemoryKind.FULL, True),
    "swa": (MemoryKind.SWA, True),
    "swa_ring": (MemoryKind.SWA, False),  # without swa_full: a ring of WINDOW + n_batch cells, never cut live
    "recurrent": (MemoryKind.RECURRENT, True),
    "hybrid": (MemoryKind.HYBRID, True),
}


@pytest.fixture(params=list(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def engine(tmp_path: Path, store: WatchedStore, kind: str) -> Iterator[Engine]:
    memory, swa_full = KINDS[kind]
    window = WINDOW if memory is MemoryKind.SWA else 0
    model = write_gguf(tmp_path / f"{kind}.gguf", memory=memory, window=window, split=True)
    e = Engine(tmp_path, store, model_file=model)
    e.load(swa_full=swa_full)
    yield e
    e.close()


def finished(engine: Engine, n: int, seed: int) -> tuple[bytes, object]:
    """A prompt of n tokens and its first reply, which ends at max_tokens (all its text is in the key)."""
    for s in range(seed, seed + 50):
        a = plain(n, s)
        first = engine.run(a)
        if first.done.finish_reason == "length":
            return a, first
    raise AssertionError("every reply ended with end-of-generation")


def test_chat_turn_two_reuses_turn_ones_prompt_and_its_settled_reply(engine: Engine, kind: str) -> None:
    """Live, the reply included: settled while idle from a cut (full and swa) or from the prompt's snapshot
    (recurrent, hybrid and an SWA ring, which are never cut)."""
    engine.registry.unload("m")
    engine.load(swa_full=KINDS[kind][1], policy={"settle_tokens": "infinity"})
    a, first = finished(engine, 40, 1)
    engine.wait_settled()
    prompt = a + first.text + b"#next"
    reply = engine.run(prompt)
    restored = reply.started.cache.restored_tokens
    assert reply.route == "live" and restored % CHUNK == 0 and engine.counter("settled_tokens") > 0, restored
    # A state that cannot be cut serves only a prompt holding all of its text: the reply's text tokenised
    # again differs from its sampled tokens here, so recurrent and hybrid fall back to the prompt's snapshot.
    assert restored >= 40 if kind in ("recurrent", "hybrid", "swa_ring") else restored > 40
    assert reply.text == engine.cold(prompt).text


def test_resume_after_a_restart(engine: Engine, kind: str) -> None:
    a, first = finished(engine, 40, 2)
    prompt = a + first.text + b"#next"
    reply = engine.restarted().run(prompt, parent_key=first.done.key)
    assert (reply.route, reply.started.cache.restored_tokens) == ("resume", 40)
    assert reply.text == engine.cold(prompt).text


def test_exact_after_a_restart_samples_from_the_stored_logits(engine: Engine, kind: str) -> None:
    a, first = finished(engine, 40, 3)
    reply = engine.restarted().run(a)
    assert (reply.route, reply.started.cache.restored_tokens) == ("exact", 40)
    assert reply.text == first.text == engine.cold(a).text


def test_the_same_prompt_ending_off_a_chunk_boundary_restores_whole_after_a_restart(engine: Engine, kind: str) -> None:
    """A memory that cannot be cut keeps a finish state at the prompt's last chunk boundary (40), so the
    prompt's end is stored as a row of its own, with its logits: every kind takes all 43 tokens back."""
    a, first = finished(engine, 43, 13)
    cuts = engine.registry.get("m").memory.cuts_states
    assert (engine.counter("end_snapshots") > 0) is not cuts  # one a prompt `finished` tried
    reply = engine.restarted().run(a)
    assert (reply.route, reply.started.cache.restored_tokens) == ("exact", 43)
    assert reply.text == first.text == engine.cold(a).text


@pytest.mark.parametrize("kind", ["swa_ring", "recurrent"], indirect=True)
def test_the_end_snapshot_is_read_once_the_first_token_is_out_and_kept_when_that_token_ends_the_reply(
        engine: Engine, kind: str) -> None:
    """Its state read is off the first token's path (sampling leaves KV as the prompt left it), and a reply
    of one token still queues it before the client hears Done (a next turn then finds it stored or in
    flight), and before the finish appends that token to the sequence's text."""
    worker = engine.registry.get("m").worker
    read, seen, answered = worker.cache.end_snapshot, [], []

    def spy(seq: object) -> object:
        seen.append([r.first_token_at is not None for r in worker._active])
        save, events = read(seq), worker._active[0].events

        def queued() -> object:
            answered.append(any(isinstance(e, Done) for e in list(events.queue)))
            return save()
        return queued

    worker.cache.end_snapshot = spy
    a = plain(43, 21)
    first = engine.run(a, max_tokens=1)
    assert seen == [[True]] and answered == [False] and engine.counter("end_snapshots") == 1
    reply = engine.restarted().run(a, max_tokens=1)
    assert (reply.route, reply.started.cache.restored_tokens) == ("exact", 43)
    assert reply.text == first.text == engine.cold(a, max_tokens=1).text


@pytest.mark.parametrize("kind", ["swa_ring"], indirect=True)
def test_without_snapshots_the_same_prompt_prefills_its_last_partial_chunk_again(engine: Engine, kind: str) -> None:
    engine.registry.unload("m")
    engine.load(swa_full=False, policy={"snapshot_gap_tokens": "infinity"})
    a, first = finished(engine, 43, 13)
    reply = engine.restarted().run(a)
    assert (reply.route, reply.started.cache.restored_tokens) == ("exact", 40)
    assert engine.counter("end_snapshots") == 0
    assert reply.text == first.text


def test_longest_prefix_finds_the_cold_capture(engine: Engine, kind: str) -> None:
    a, _ = finished(engine, 40, 4)  # a cold checkpoint of its first 32 tokens (a snapshot where it cannot be cut)
    prompt = a[:35] + plain(15, 99)[1:]
    reply = engine.restarted().run(prompt)
    assert (reply.route, reply.started.cache.restored_tokens) == ("longest_prefix", 32)
    assert reply.text == engine.cold(prompt).text
    whole = engine.restarted().run(a[:31])  # exactly the captured 32 tokens
    assert whole.route == "exact"
    assert whole.text == engine.cold(a[:31]).text


def test_a_prompt_that_leaves_turn_one_midway(engine: Engine, kind: str) -> None:
    """It shares 20 tokens: full attention and a sliding window with swa_full cut the live sequence back to
    16; a recurrent state exists only at its own length and a ring is never cut, so it is refused and counted,
    and the snapshot the prefill stored at 16 serves."""
    a, _ = finished(engine, 40, 5)
    engine.rows()  # every save published: the snapshot at 16 is there to serve
    prompt = a[:19] + plain(20, 98)[1:]
    reply = engine.run(prompt)
    if kind in ("recurrent", "hybrid", "swa_ring"):
        assert (reply.route, reply.started.cache.restored_tokens) == ("longest_prefix", 16)
        assert engine.counter("reuse_refused") >= 1
    else:
        assert (reply.route, reply.started.cache.restored_tokens) == ("live", 16)
    assert reply.text == engine.cold(prompt).text


def test_a_short_prompt_is_reused_on_every_kind(engine: Engine, kind: str) -> None:
    """Within the window every SWA cell of a saved state is in it: restores are exact without swa_full too."""
    a, first = finished(engine, 20, 6)  # a cold checkpoint at 16, a finish state at 16
    prompt = a + first.text + b"#next"
    reply = engine.restarted().run(prompt, parent_key=first.done.key)
    assert (reply.route, reply.started.cache.restored_tokens) == ("resume", 16)
    assert reply.text == engine.cold(prompt).text


@pytest.mark.parametrize("kind", ["swa_ring"], indirect=True)
def test_a_wrapped_ring_is_restored_at_its_own_length(engine: Engine, kind: str) -> None:
    """Past WINDOW + n_batch cells the ring wraps; each prefill call leaves its window in order, so the
    snapshot the prefill kept at the prompt's last chunk boundary serves the next turn exactly (a ring's live
    sequence is never cut)."""
    a, first = finished(engine, 100, 7)
    assert max(r["frontier"] for r in engine.rows()) > WINDOW + 16
    prompt = a + first.text + b"#next"
    reply = engine.run(prompt)
    assert reply.route == "live" and reply.started.cache.restored_tokens == 100 // CHUNK * CHUNK
    assert engine.counter("reuse_refused") == 0
    assert reply.text == engine.cold(prompt).text


@pytest.mark.parametrize("kind", ["full", "recurrent"], indirect=True)
def test_a_restore_llama_cpp_does_not_account_for_is_prefilled_cold(
    engine: Engine, kind: str, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    a, first = finished(engine, 40, 8)
    later = engine.restarted()
    monkeypatch.setattr(later.backend(), "seq_pos_range", lambda seq: (1, 39))
    reply = later.run(a)
    # the exact row is undone, then the next best (the cold capture at 32) likewise: each counted
    assert reply.route == "miss" and later.counter("reuse_refused") == 2
    assert "prefilling instead" in caplog.text
    assert reply.text == first.text


def test_every_save_is_a_chunk_boundary_or_a_whole_prompt(engine: Engine, kind: str) -> None:
    """What a later prompt can start from: the frontier is a multiple of the chunk size, or the prompt
    itself with its logits; a memory that cannot be cut never stores generated tokens' KV."""
    finished(engine, 43, 9)
    rows = engine.rows()
    assert rows
    for row in rows:
        assert row["memory"] == str(KINDS[kind][0])
        assert row["frontier"] % CHUNK == 0 or row["frontier"] == 43
        assert row["frontier"] <= 43 < row["tokens"] or row["save_reason"] == "cold"


TEMPLATE = "{% for m in messages %}{{ m.content }}#{% endfor %}{% if add_generation_prompt %}%{% endif %}"


def test_a_conversation_that_shares_only_its_system_message_restores_after_a_restart(engine: Engine,
                                                                                       kind: str) -> None:
    """Agents' prompts part at message ends: a prefill passing one (at the chunk boundary below it) stores
    the state there, so a memory that cannot be cut still restores the shared system message from the store."""
    engine.registry.unload("m")
    engine.load(swa_full=KINDS[kind][1], policy={"snapshot_gap_tokens": CHUNK})
    system = Message("system", plain(16, 10).decode())  # BOS, 15 bytes and '#': its end is token 17
    first = (system, Message("user", plain(31, 11).decode()))
    assert engine.run(b"", messages=first, chat_template=TEMPLATE).route == "miss"
    second = (system, Message("user", "&" + plain(20, 12).decode()))  # '&' is no byte of `first`'s user message
    reply = engine.restarted().run(b"", messages=second, chat_template=TEMPLATE)
    assert reply.route == "longest_prefix" and reply.started.cache.restored_tokens == 16
    assert reply.text == engine.cold(b"", messages=second, chat_template=TEMPLATE).text
    expected = 0 if KINDS[kind][0] is MemoryKind.FULL else 1  # a state that can be cut serves every prefix
    assert engine.counter("boundary_snapshots") == expected


@pytest.mark.parametrize("kind", ["recurrent"], indirect=True)
def test_without_snapshots_a_shared_system_message_is_a_miss(engine: Engine, kind: str) -> None:
    engine.registry.unload("m")
    engine.load(policy={"snapshot_gap_tokens": "infinity"})
    system = Message("system", plain(16, 10).decode())
    engine.run(b"", messages=(system, Message("user", plain(31, 11).decode())), chat_template=TEMPLATE)
    second = (system, Message("user", "&" + plain(20, 12).decode()))
    assert engine.restarted().run(b"", messages=second, chat_template=TEMPLATE).route == "miss"

"""Every lookup route and its tie-breaks, through ModelWorker and WarmStarts over a real store.

Every warm reply is compared with the reply a cold prefill gives (temperature 0): over FakeBackend the
logits are a function of the whole token history in the KV cells, so any wrong restore or cut shows.
"""

from __future__ import annotations

from pathlib import Path

from barreld.engine.exactness import ReuseProbe

from .conftest import CHUNK, Engine, Reply, WatchedStore, collect, plain, prose, wait_until


def test_every_route_replies_as_a_cold_prefill(engine: Engine) -> None:
    a = plain(40, 1)
    first = engine.run(a)
    assert first.route == "miss" and first.started.cache.restored_tokens == 0
    assert first.text == engine.cold(a).text

    b = a + plain(20, 2)
    live = engine.run(b)
    assert live.route == "live" and live.started.cache.restored_tokens >= 38
    assert live.started.cache.tier is None
    assert live.text == engine.cold(b).text

    exact = engine.restarted().run(a)
    assert exact.route == "exact" and exact.started.cache.restored_tokens == 40
    assert exact.started.cache.tier == "disk"
    assert exact.text == first.text

    c = a[:35] + plain(15, 3)
    prefix = engine.restarted().run(c)
    assert prefix.route == "longest_prefix" and prefix.started.cache.restored_tokens == 32
    assert prefix.text == engine.cold(c).text

    d = a + plain(10, 4)
    resume = engine.restarted().run(d, parent_key=first.done.prompt_key)
    assert resume.route == "resume" and resume.started.cache.restored_tokens == 40
    assert resume.text == engine.cold(d).text
    assert [engine.counter(f"hits_{r}") for r in ("live", "exact", "longest_prefix", "resume")] == [1, 1, 1, 1]


def test_a_live_turn_that_retokenises_keeps_only_the_tokens_the_prompt_shares(engine: Engine) -> None:
    """The prompt is tokenised whole, as a cold prefill would; the live sequence serves the tokens it shares
    with it, down to a chunk boundary."""
    be = engine.backend()
    a = plain(39, 5) + b"t"
    engine.run(a)
    prompt = a + b"he cat and the dog"
    assert be.tokenize(prompt)[:40] != be.tokenize(a)  # "t" + "he" is one token when the prompt is tokenised whole
    reply = engine.run(prompt)
    assert reply.route == "live" and reply.started.prompt_tokens == len(be.tokenize(prompt))
    assert reply.started.cache.restored_tokens == 32  # 39 shared, down to a multiple of the chunk size (8)
    assert be.tokens(0)[: len(be.tokenize(prompt))] == be.tokenize(prompt)
    assert reply.text == engine.cold(prompt).text


def finished_by_length(engine: Engine, seed: int) -> tuple[bytes, Reply]:
    """A 40-token prompt whose reply ends at max_tokens (so its text is all of the finish checkpoint's)."""
    for s in range(seed, seed + 50):
        a = plain(40, s)
        first = engine.run(a)
        if first.done.finish_reason == "length":
            return a, first
    raise AssertionError("every reply ended with end-of-generation")


def test_a_resumed_turn_reuses_the_parents_prompt_never_its_reply(engine: Engine) -> None:
    """Generated tokens were decoded one per batch, so their KV is not what a prefill of them gives: the next
    turn restores the parent's prompt and prefills the reply again with the new text."""
    a, first = finished_by_length(engine, 33)
    prompt = a + first.text + b"#x"
    resumed = engine.restarted().run(prompt, parent_key=first.done.key)
    assert resumed.route == "resume" and resumed.started.cache.restored_tokens == 40
    assert resumed.text == engine.cold(prompt).text
    other = a + b"#y" + first.text  # shares the prompt with the live sequence, not the reply it holds
    live = engine.run(other)
    assert live.route == "live" and live.started.cache.restored_tokens == 40
    assert live.text == engine.cold(other).text


def test_live_wins_a_tie_and_the_store_is_not_asked(engine: Engine) -> None:
    a = plain(40, 6)
    first = engine.run(a)
    engine.store.settle()
    probes = engine.counter("longest_prefix_probes")
    again = engine.run(a, parent_key=first.done.prompt_key)
    assert again.route == "live" and again.text == first.text
    assert engine.backend().ops("state_set") == []
    assert engine.counter("hits_exact") == 0 and engine.counter("longest_prefix_probes") == probes


def test_resume_wins_a_tie_with_the_longest_prefix(engine: Engine) -> None:
    a = plain(32, 7)  # the parent ends on a walk boundary: both routes cover 32 tokens
    first = engine.run(a)
    engine.store.settle()
    b = a + plain(20, 8)
    reply = engine.restarted().run(b, parent_key=first.done.prompt_key)
    assert reply.route == "resume" and reply.started.cache.restored_tokens == 32
    assert reply.text == engine.cold(b).text
    b2 = a + plain(20, 9)  # no parent: the walk finds the same 32 tokens
    walked = engine.restarted().run(b2)
    assert walked.route == "longest_prefix" and walked.started.cache.restored_tokens == 32


def test_the_walk_stops_below_what_a_live_sequence_covers(engine: Engine) -> None:
    a = plain(40, 9)
    engine.run(a)
    engine.store.settle()
    probes = engine.counter("longest_prefix_probes")
    b = a + plain(20, 10)  # boundaries 48, 32, 16: only 48 is above the live 40
    assert engine.run(b).route == "live"
    assert engine.counter("longest_prefix_probes") == probes + 1


def test_a_short_shared_header_is_not_worth_a_live_sequence(engine: Engine) -> None:
    a = plain(40, 11)
    engine.run(a)
    b = a[:5] + plain(36, 12)
    reply = engine.run(b)
    assert reply.route == "miss" and reply.text == engine.cold(b).text


def test_the_longest_of_two_live_sequences_wins(engine: Engine) -> None:
    engine.registry.unload("m")
    engine.load(n_seq_max=2)
    be = engine.backend()
    a, other = plain(40, 13), plain(40, 14)
    engine.run(a)
    engine.run(a[:10] + other[:30])  # too little in common: it takes the empty sequence
    b = a + plain(10, 15)
    reply = engine.run(b)
    assert reply.route == "live" and reply.started.cache.restored_tokens >= 38
    assert be.tokens(0)[: len(be.tokenize(b))] == be.tokenize(b)
    assert reply.text == engine.cold(b).text


def test_resume_waits_for_the_parents_in_flight_save(engine: Engine) -> None:
    a = prose(10, 16)
    engine.store.publishing.clear()
    first = engine.run(a)
    assert engine.store.pending(first.done.key) is not None
    later = engine.restarted(settle=False)
    prompt = a + first.text + b"!x"
    req = later.submit(prompt, parent_key=first.done.key)
    wait_until(lambda: later.counter("resume_waits") == 1)
    engine.store.publishing.set()
    reply = collect(req)
    assert reply.route == "resume"
    assert reply.started.cache.restored_tokens == first.started.prompt_tokens // CHUNK * CHUNK


def test_a_resume_that_waits_too_long_prefills(engine: Engine) -> None:
    engine.registry.unload("m")
    engine.load(policy={"session_resume_wait_ms": "20"})
    a = plain(40, 17)
    engine.store.publishing.clear()
    first = engine.run(a)
    later = engine.restarted(settle=False)
    prompt = a + first.text + b"#"
    reply = later.run(prompt, parent_key=first.done.key)
    engine.store.publishing.set()
    assert reply.route == "miss" and later.counter("resume_waits") == 1
    assert reply.text == engine.cold(prompt).text


def test_rows_stored_as_blocks_are_found_at_every_block(tmp_path: Path) -> None:
    """An agent's next prompt extends its last one, whose length is no multiple of the alignment (16): with
    blocks (8 tokens) the walk probes every block and, the row read, every token it shares with the prompt
    counts, so the whole last prompt is reused at the measured grain (1 here), not its last multiple of 16."""
    store = WatchedStore(tmp_path, block_tokens=CHUNK).open()
    e = Engine(tmp_path, store, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    e.load()
    a = plain(44, 21)
    first = e.run(a)
    e.run(plain(30, 22))  # another agent takes the live sequence
    store.settle()  # the finish row is published
    b = a + first.text + plain(12, 23)[1:]
    reply = e.run(b)
    assert (reply.route, reply.started.cache.restored_tokens) == ("longest_prefix", 44)
    assert reply.text == e.cold(b).text
    e.close()
    store.close()

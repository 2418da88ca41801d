"""Why a miss missed: a changed timestamp in a system prompt, or a rewritten old turn, is reported as the first
difference from the closest text the live sequences hold; a whole hit reports nothing. An explained prompt
(look-up only) is compared with the stored rows too, so the report survives a restart."""

from __future__ import annotations

from barreld.engine.divergence import common_prefix, divergence

from .conftest import Engine, plain

HEAD = b"System: you are a helpful agent. The time is 2026-12-01T14:03:12Z. "


def test_a_changed_timestamp_in_the_system_prompt_is_the_first_difference(engine: Engine) -> None:
    body = plain(200, 3)
    engine.run(HEAD + body)
    moved = HEAD.replace(b"14:03:12", b"14:03:13")
    reply = engine.run(moved + body)
    d = reply.done.cache.divergence
    at = HEAD.index(b"2Z.")
    assert reply.route == "miss" or reply.done.cache.restored_tokens <= at
    assert d is not None and d.cached.startswith(b"2Z. ") and d.prompt.startswith(b"3Z. ")
    assert at <= d.matched_bytes <= at + 8  # the rendered prompt holds BOS's text before HEAD
    assert 0 < d.matched_tokens <= at + 1  # the prompt's tokens wholly inside the match (BOS included)


def test_a_rewritten_old_turn_is_the_first_difference(engine: Engine) -> None:
    turn1, turn2 = b"User: " + plain(70, 4), b"\nUser: " + plain(70, 5)
    first = engine.run(turn1)
    history = turn1 + b"\nAssistant: " + first.text
    engine.run(history + turn2)
    rewritten = turn1[:50] + b"#EDITED#" + turn1[50:] + b"\nAssistant: " + first.text + turn2 + b"\nUser: more"
    d = engine.run(rewritten).done.cache.divergence
    assert d is not None and d.prompt.startswith(b"#EDITED#") and d.cached.startswith(turn1[50:])


def test_a_whole_hit_reports_no_divergence(engine: Engine) -> None:
    prompt = plain(100, 6)
    engine.run(prompt)
    again = engine.run(prompt)
    assert again.done.cache.restored_tokens == again.done.prompt_tokens and again.done.cache.divergence is None


def test_the_closest_text_wins_and_tokens_are_counted_whole() -> None:
    d = divergence(b"abcdef", [0, 2, 4, 6], [("live", b"abx"), ("k1", b"abcdxx"), ("k2", b"abcdyy"), ("k3", b"")])
    assert d is not None and (d.matched_bytes, d.matched_tokens, d.cached, d.prompt) == (4, 2, b"xx", b"ef")
    assert d.against == "k1"  # the first of the closest
    assert divergence(b"abc", [0, 3], []) is None


def test_common_prefix_agrees_with_a_plain_walk() -> None:
    for a, b in [(b"", b"x"), (b"abc", b"abc"), (b"abc", b"abd"), (b"a" * 1000 + b"b", b"a" * 1000 + b"c")]:
        walk = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == walk


def test_an_explained_prompt_is_compared_with_stored_rows_and_runs_nothing(engine: Engine) -> None:
    body = plain(200, 7)
    engine.run(HEAD + body)
    later = engine.restarted()  # no live sequence: only the stored rows can say where the prompt left them
    rows = {r["key"] for r in engine.store.dump()}
    counters = dict(engine.store.stats()["counters"])
    moved = HEAD.replace(b"14:03:12", b"14:03:13")
    explained = later.run(moved + body, explain=True)
    d = explained.done.cache.divergence
    assert explained.text == b"" and explained.done.finish_reason == "explain" and explained.done.completion_tokens == 0
    assert d is not None and d.against in rows and d.cached.startswith(b"2Z. ") and d.prompt.startswith(b"3Z. ")
    assert explained.done.cache.restored_tokens <= d.matched_tokens  # a stored head before the timestamp, at most
    after = engine.store.stats()["counters"]
    assert {r["key"] for r in engine.store.dump()} == rows  # nothing saved
    assert [after[k] - counters[k] for k in ("misses", "hits_exact", "saves_cold")] == [0, 0, 0]
    same = later.run(HEAD + body, explain=True)  # what a resend would restore, said before running it
    assert same.done.cache.restored_tokens == same.done.prompt_tokens and same.done.cache.divergence is None

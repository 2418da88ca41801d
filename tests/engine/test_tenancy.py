"""Tenants on the engine: a prompt of one namespace never reuses, nor reports, anything of another's, live or
stored, while each namespace's own prompts are as warm as before."""

from __future__ import annotations

from barreld.cache.key import Namespace

from .conftest import Engine, WatchedStore, collect, plain, wait_until

ALICE, BOB = Namespace.of("alice"), Namespace.of("bob")
SECRET = b"System: the door code is 4711 and the client is ACME. " + plain(160, 31)


def test_bob_reuses_and_sees_nothing_of_alices_live_sequence(engine: Engine) -> None:
    alice = engine.run(SECRET, namespace=ALICE)
    bob = engine.run(SECRET, namespace=BOB)
    assert (bob.route, bob.done.cache.restored_tokens, bob.done.cache.divergence) == ("miss", 0, None)
    assert bob.text == engine.cold(SECRET).text == alice.text
    assert bob.done.prompt_key != alice.done.prompt_key and bob.done.key != alice.done.key
    engine.store.settle()
    again = engine.run(SECRET, namespace=ALICE)  # from her live sequence, or her row if Bob's request took it
    assert again.route != "miss" and again.done.cache.restored_tokens > 0


def test_after_a_restart_bob_finds_none_of_alices_rows_and_explain_compares_with_his_own(engine: Engine) -> None:
    engine.run(SECRET, namespace=ALICE)
    later = engine.restarted()
    bob = later.run(SECRET + b" more", namespace=BOB)
    assert bob.route == "miss" and bob.done.cache.restored_tokens == 0
    explained = later.run(SECRET + b" other", namespace=BOB, explain=True)
    d = explained.done.cache.divergence
    assert d is None or SECRET[:40] not in d.cached  # compared with Bob's own rows only
    alice = later.run(SECRET + b" more", namespace=ALICE)
    assert alice.route in ("exact", "longest_prefix") and alice.done.cache.restored_tokens > 0
    assert {r["tenant"] for r in later.rows()} == {"alice", "bob"}


def test_a_guess_at_the_next_token_never_restores_anything_of_another_tenant(engine: Engine) -> None:
    engine.run(SECRET, namespace=ALICE)
    public = b"System: the door code is "
    for n, guess in enumerate((b"4711", b"4712", b"1234", b"4711 and the client is ACME. ")):
        first = Namespace.of("bob", f"guess {n}")  # each guess as Bob's first request of that text
        probe = engine.run(public + guess + b" nonce %d" % n, namespace=first, max_tokens=1)
        assert probe.done.cache.restored_tokens == 0 and probe.done.cache.divergence is None


def test_two_salts_share_nothing_and_the_same_salt_shares(engine: Engine) -> None:
    one, two = Namespace.of("app", "user-1"), Namespace.of("app", "user-2")
    engine.run(SECRET, namespace=one)
    assert engine.run(SECRET, namespace=two).done.cache.restored_tokens == 0
    engine.store.settle()
    assert engine.run(SECRET, namespace=one).done.cache.restored_tokens > 0
    later = engine.restarted()
    assert later.run(SECRET, namespace=one).route == "exact"
    assert later.run(SECRET + b"!", namespace=Namespace.of("app")).done.cache.restored_tokens == 0


def test_a_parent_key_of_another_tenant_is_never_waited_for(engine: Engine, store: WatchedStore) -> None:
    store.publishing.clear()  # Alice's finish save stays in flight
    try:
        alice = engine.run(SECRET, namespace=ALICE)
        waits = engine.counter("resume_waits")
        bob = engine.run(SECRET + b" next", namespace=BOB, parent_key=alice.done.key)
        assert engine.counter("resume_waits") == waits and bob.done.cache.restored_tokens == 0
        own = engine.submit(SECRET + b" next", namespace=ALICE, parent_key=alice.done.key)
        wait_until(lambda: engine.counter("resume_waits") == waits + 1)  # her own save is waited for
    finally:
        store.publishing.set()
    assert collect(own).done.cache.restored_tokens > 0

"""The cache in the engine, proven with the real model through the real daemon and socket.

A warm world saves and restores; a reference world runs with every save disabled, so each of its
replies comes from a cold prefill. Replies are compared byte for byte at temperature 0.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from barrelctl.sandbox import Sandbox

pytestmark = pytest.mark.model

POLICY = """
[policy]
min_tokens = 128
cold_min_tokens = 128
boundary_trim_tokens = 16
boundary_align_tokens = 256
continued_interval = 16
"""
NO_SAVES = "\n[policy]\nmin_tokens = \"infinity\"\n"
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there would their we him been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people river stone garden "
    "window letter morning silver"
).split()
DOC_WORDS = (600, 640, 680, 720, 800, 900, 1400, 2900)   # about 600..3,000 tokens each


def doc(i: int, n_words: int) -> str:
    r = random.Random(i)
    return f"{chr(65 + i % 26)}{i}: " + " ".join(r.choice(WORDS) for _ in range(n_words))


def complete(w: Sandbox, prompt: str, *args: str) -> dict:
    r = w.ctl("--json", "complete", "-", "--max-tokens", "12", *args, input=prompt.encode())
    assert r.rc == 0, r.err
    return r.json()


def counters(w: Sandbox) -> dict:
    return w.ctl("--json", "cache", "stats").json()["counters"]


def reasons(w: Sandbox) -> set[str]:
    return {row["save_reason"] for row in w.ctl("--json", "cache", "dump").json()["rows"]}


@pytest.fixture(scope="module")
def warm():
    with Sandbox.new(POLICY) as w:
        w.start_daemon()
        yield w


@pytest.fixture(scope="module")
def cold():
    with Sandbox.new(NO_SAVES) as w:
        w.start_daemon()
        yield w


def test_warm_replies_equal_cold_replies_on_every_restore_path(warm: Sandbox, cold: Sandbox) -> None:
    """exact, longest_prefix and resume hits on prefilled checkpoints reply exactly as a cold prefill."""
    docs = [doc(i, n) for i, n in enumerate(DOC_WORDS)]
    firsts = [complete(warm, d) for d in docs]
    assert all(f["cache"]["path"] == "miss" for f in firsts)
    assert min(f["tokens"]["prompt"] for f in firsts) >= 600 and max(f["tokens"]["prompt"] for f in firsts) <= 3000
    cases = []
    for d, first in zip(docs, firsts, strict=True):
        cases.append(("exact", d, ()))
        cases.append(("longest_prefix", d[: int(len(d) * 0.8)] + " a different ending about rivers", ()))
        cases.append(("resume", d + " and then the story went on", ("--parent-key", first["prompt_key"])))
    compared = 0
    for expected_path, prompt, args in cases:
        for w in (warm, cold):  # leave no live sequence that shares a head with the next prompt
            complete(w, "Zebras flush the context.", "--max-tokens", "2")
        got = complete(warm, prompt, *args)
        ref = complete(cold, prompt)
        assert ref["cache"]["path"] == "miss"
        assert got["cache"]["path"] == expected_path, (expected_path, got["cache"])
        assert got["cache"]["restored_tokens"] > 0
        assert got["text"] == ref["text"], (expected_path, got["cache"])
        compared += 1
    assert compared >= 20
    c = counters(warm)
    assert c["hits_exact"] >= 8 and c["hits_longest_prefix"] >= 8 and c["hits_resume"] >= 8
    assert c["misses"] >= 8 and c["longest_prefix_probes"] >= 8
    assert c["restore_ns"] > 0 and c["lookup_ns"] > 0


def test_live_turn_equals_restored_turn_after_restart() -> None:
    """Turn 2 served from the live sequence, and turn 2 served after a restart by restoring turn 1's
    finish checkpoint (generated tokens included), reply the same."""
    turn1 = doc(100, 600)
    with Sandbox.new(POLICY) as w:
        w.start_daemon()
        first = complete(w, turn1)
        assert first["finish_reason"] == "length"
        turn2 = turn1 + first["text"] + "\nQuestion: what happened next?"
        live = complete(w, turn2)
        assert live["cache"]["path"] == "live"
    with Sandbox.new(POLICY) as w:
        p = w.start_daemon()
        assert complete(w, turn1)["key"] == first["key"]
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        w.start_daemon()
        restored = complete(w, turn2, "--parent-key", first["key"])
        assert restored["cache"]["path"] == "resume"
        assert restored["cache"]["tier"] == "disk"
        assert restored["cache"]["restored_tokens"] == first["tokens"]["prompt"] + first["tokens"]["completion"]
        assert restored["text"] == live["text"]


def test_resume_waits_for_an_in_flight_finish_save(world: Sandbox) -> None:
    """Two models share one key scheme (same GGUF and context): turn 2 on the second model can only
    resume from turn 1's finish checkpoint, which is still being written when it arrives."""
    world.write_config(POLICY + '\n[[models]]\nname = "a"\npath = "{p}"\n\n[[models]]\nname = "b"\npath = "{p}"\n'
                       .format(p=_bundled()))
    world.start_daemon()
    client = world.client()
    waited = 0
    for attempt in range(3):
        text = doc(200 + attempt, 700)
        done = client.complete(text.encode(), model="a", max_tokens=4).result()
        turn2 = (text.encode() + done.text + b" and after that")
        assert client.complete(turn2, model="b", max_tokens=4, parent_key=done.key).result().route == "resume"
        waited = counters(world)["resume_waits"]
        if waited:
            break
    assert waited >= 1


def test_retokenised_prompt_with_the_same_bytes_hits(served_policy: Sandbox) -> None:
    """Sampled tokens are often not how their text tokenises: find a reply whose text tokenises to another
    count than its checkpoint holds. Keys are over bytes, so the next turn still resumes from it."""
    from barreld.engine.llama_backend import ContextSettings, LlamaBackend

    w = served_policy
    head = doc(300, 550)
    tok = LlamaBackend(Path(_bundled()), ContextSettings(n_ctx=4096))
    try:
        for seed in range(1, 9):
            first = complete(w, head, "--max-tokens", "40", "--temperature", "1.5", "--seed", str(seed))
            held = first["tokens"]["prompt"] + first["tokens"]["completion"]
            if len(tok.tokenize((head + first["text"]).encode())) != held:
                break
        else:
            pytest.fail("no seed gave a reply that retokenises differently")
    finally:
        tok.close()
    complete(w, doc(301, 550))  # take the live sequence away
    got = complete(w, head + first["text"] + " and the river", "--parent-key", first["key"])
    assert got["cache"]["path"] == "resume"
    assert got["cache"]["restored_tokens"] == held


def test_every_save_reason_lands_in_the_index() -> None:
    with Sandbox.new(POLICY) as w:
        w.start_daemon()
        complete(w, doc(400, 700), "--max-tokens", "20")      # cold (at 512), continued (at 16), finish
        assert {"cold", "continued", "finish"} <= reasons(w)
    with Sandbox.new(POLICY) as w:
        p = w.start_daemon("--drop-async-saves", module="tests.faultd")
        complete(w, doc(401, 700))
        complete(w, doc(402, 700))        # takes the only sequence: the first state is saved as evict
        assert "evict" in reasons(w)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        w.start_daemon()
        assert "shutdown" in reasons(w)
        assert counters(w)["corrupt_files"] == 0


def test_corrupt_checkpoint_is_never_restored(world: Sandbox) -> None:
    world.write_config(POLICY)
    p = world.start_daemon()
    text = doc(500, 700)
    first = complete(world, text)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0
    files = list((world.data_dir / "kvc").glob("*.kvc"))
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x40
        f.write_bytes(bytes(data))
    world.start_daemon()
    again = complete(world, text)
    assert again["cache"]["path"] == "miss"
    assert again["text"] == first["text"]
    assert counters(world)["corrupt_files"] >= 1


@pytest.fixture(scope="module")
def served_policy():
    with Sandbox.new(POLICY) as w:
        w.start_daemon()
        yield w


def _bundled() -> str:
    from barreld.engine.registry import bundled_model_path

    return str(bundled_model_path("smollm2"))

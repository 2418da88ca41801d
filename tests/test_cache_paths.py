"""The cache in the engine, proven with the real models through the real daemon and socket.

A warm daemon saves and restores; a reference daemon runs with every save disabled, and is flushed before
each request, so each of its replies comes from a cold prefill. Replies are compared byte for byte at
temperature 0, on one model of each memory kind: SmolLM2 (full attention; and with flash attention and a q8_0
cache), Gemma 3 270M (sliding window 512, with swa_full on and off), a tiny Mamba (recurrent) and a tiny LFM2
(hybrid). Each is served at the reuse grain its load's probe measured.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from barrelctl.client import Completion
from barreld.engine.chat import Message
from barreld.engine.memory import Memory
from barreld.engine.registry import bundled_model_path
from barreld.names import MemoryKind
from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import gemma_path, tiny_hybrid_path, tiny_recurrent_path

pytestmark = pytest.mark.model

CHUNK = 128  # the prefill chunk size at n_batch 512: every reuse point is a multiple of it
BLOCK = 128  # the default block_tokens
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


@dataclass(frozen=True)
class Model:
    path: Callable[[], Path]
    knobs: str  # its [[models]] lines beyond name and path
    words: int  # turn one's length: about 600 to 3,000 tokens
    memory: str


MODELS = {
    "smollm2": Model(lambda: bundled_model_path("smollm2"), "flash_attn = false\n", 640, "full"),
    # flash attention and a q8_0 cache: other kernels, another grain (the floats follow the split more)
    "smollm2_fa": Model(lambda: bundled_model_path("smollm2"), 'flash_attn = true\ntype_k = "q8_0"\n'
                        'type_v = "q8_0"\n', 600, "full"),
    # the defaults, flash attention on an f16 cache: its tiled path from 64 rows (a fewest batch of 64; calls of
    # 64 at least)
    "smollm2_tiled": Model(lambda: bundled_model_path("smollm2"), "", 660, "full"),
    "gemma": Model(gemma_path, "swa_full = true\n", 620, "swa"),
    "gemma_ring": Model(gemma_path, "swa_full = false\n", 1300, "swa"),  # past 1,024 tokens: the ring wraps
    "mamba": Model(tiny_recurrent_path, "", 2600, "recurrent"),
    "lfm2": Model(tiny_hybrid_path, "", 1500, "hybrid"),
}


TINY = (tiny_recurrent_path, tiny_hybrid_path)
RING_CELLS = 1024  # Gemma's SWA ring without swa_full: window 512 + n_batch 512


def models_config_of(model: str) -> str:
    m = MODELS[model]
    return f'\n[[models]]\nname = "{model}"\npath = "{m.path()}"\nn_threads = 1\n{m.knobs}'


def models_config() -> str:
    return "".join(map(models_config_of, MODELS))


def doc(i: int, n_words: int) -> str:
    r = random.Random(i)
    return f"{chr(65 + i % 26)}{i}: " + " ".join(r.choice(WORDS) for _ in range(n_words))


def complete(w: Sandbox, prompt: str, *args: str) -> dict:
    r = w.ctl("--json", "complete", "-", "--max-tokens", "12", *args, input=prompt.encode())
    assert r.rc == 0, r.err
    return r.json()


def ask(w: Sandbox, model: str, prompt: str, parent_key: str = "") -> Completion:
    with w.client() as c:
        return c.complete(prompt.encode(), model=model, max_tokens=12, parent_key=parent_key, timeout=600).result()


def flush(w: Sandbox, model: str) -> None:
    """An unrelated prompt takes the model's only sequence: the next request shares nothing live with it."""
    ask(w, model, "Zebras flush the context.")


def verdicts(w: Sandbox) -> dict[str, dict]:
    """Each model's reuse verdict, as its load's probe measured it (grain: the chunk when nothing finer is
    exact)."""
    return {m["name"]: m["exact_reuse"] for m in w.ctl("--json", "models").json()["models"]}


def full_rule(w: Sandbox) -> Memory:
    """The bundled model's reuse rule, at the grain and fewest batch its daemon measured."""
    rule = next(m["exact_reuse"] for m in w.ctl("--json", "models").json()["models"] if m["name"] == "smollm2")
    return Memory(MemoryKind.FULL, chunk=CHUNK, grain=rule["grain"], min_batch=rule["min_batch"],
                  spans=bool(rule.get("spans")))


def counters(w: Sandbox) -> dict:
    return w.ctl("--json", "cache", "stats").json()["counters"]


def reasons(w: Sandbox) -> set[str]:
    return {row["save_reason"] for row in w.ctl("--json", "cache", "dump").json()["rows"]}


@pytest.fixture(scope="module")
def warm() -> Iterator[Sandbox]:
    with Sandbox.new(POLICY + models_config()) as w:
        w.start_daemon(timeout=300)
        w.wait_models(set(MODELS))
        yield w


@pytest.fixture(scope="module")
def cold() -> Iterator[Sandbox]:
    with Sandbox.new(NO_SAVES + models_config()) as w:
        w.start_daemon(timeout=300)
        w.wait_models(set(MODELS))
        yield w


def expected_routes(model: str, n1: int, spans: int = 0) -> dict[str, tuple[str, int]]:
    """Route and the fewest restored tokens each case takes, for a first prompt of n1 tokens: what the chunk
    rule gave (a finer grain reuses as much or more), but with calls of `spans` tokens at least (the probe's
    spans) a warm start leaves that many to the prompt's end, even from a chunk boundary.

    A memory that cannot be cut keeps its prompt's state at the last point its grain allows min_batch tokens
    short of the prompt's end (the last chunk boundary, p, at least) or, where its grain allows, at the end."""
    p = n1 // CHUNK * CHUNK - spans
    # Full attention: turn two's row superseded turn one's, whose key and prompt now find turn two's row,
    # which has no logits at n1: the last partial chunk is prefilled again.
    return {"live": ("live", p), "exact": ("exact", p), "resume": ("resume", p)}


@pytest.mark.parametrize("model", list(MODELS))
def test_every_route_replies_as_a_cold_prefill(warm: Sandbox, cold: Sandbox, model: str) -> None:
    """Turn one (a miss, with a cold capture during its prefill), then turn two from its live sequence, a
    prompt that leaves it halfway (a cut; where a state cannot be cut, refused and counted, and served by a
    snapshot stored at a stride boundary), then from the
    store the same prompt again, a resumed turn two and a prompt that leaves turn one near its end: every
    reply is the reference's, and only prefilled tokens are ever reused, at multiples of the model's measured
    reuse grain (the settled reply included)."""
    turn1 = doc(len(model), MODELS[model].words)
    flush(cold, model)
    first, ref = ask(warm, model, turn1), ask(cold, model, turn1)
    assert first.route == "miss" and first.finish_reason == "length" and first.text == ref.text
    assert 600 <= first.prompt_tokens <= 3000
    assert model != "gemma_ring" or first.prompt_tokens > RING_CELLS, first.prompt_tokens
    text = first.text.decode("utf-8", "replace")
    cases = [
        ("live", turn1 + text + "\nQuestion: what happened next?", ""),
        ("midway", turn1[: len(turn1) // 2] + " and then something else entirely happened", ""),
        ("exact", turn1, ""),
        ("resume", turn1 + text + "\nAnd after that, the river?", first.key),
        # past the cold capture (turn one's last stride boundary), which a state that cannot be cut needs
        ("longest_prefix", turn1[: int(len(turn1) * 0.995)] + " a different ending about a garden", ""),
    ]
    rule = verdicts(warm)[model]
    expected = expected_routes(model, first.prompt_tokens, rule["min_batch"] if rule.get("spans") else 0)
    grain = rule["grain"]
    references = {turn1: ref}  # a cold prefill at temperature 0 replies the same every time: asked once
    for case, prompt, parent in cases:
        if case not in ("live", "midway"):
            flush(warm, model)
        refused = counters(warm)["reuse_refused"]
        got = ask(warm, model, prompt, parent)
        if prompt not in references:
            flush(cold, model)
            references[prompt] = ask(cold, model, prompt)
        ref = references[prompt]
        assert ref.route == "miss" and got.text == ref.text, (case, got.route, got.restored)
        if case == "midway" and (MODELS[model].memory in ("recurrent", "hybrid") or model == "gemma_ring"):
            # the live sequence shares half of its prompt, but a recurrent state exists at its end only, and a
            # ring is never cut: refused and counted, and the snapshot turn one's prefill stored at a stride
            # boundary serves
            assert got.route == "longest_prefix" and got.restored % CHUNK == 0, (got.route, got.restored)
            assert counters(warm)["reuse_refused"] > refused
        elif case == "midway":
            assert got.route == "live" and got.restored % grain == 0 and got.restored > 0, (got.route, got.restored)
        elif case in expected:
            route, fewest = expected[case]
            assert got.route == route and got.restored >= fewest, (case, got.route, got.restored)
            assert got.restored % grain == 0 or got.restored == got.prompt_tokens, (case, got.restored)
        else:
            assert got.route == case and got.restored % grain == 0 and got.restored > 0, (got.route, got.restored)
        assert got.prefilled == got.prompt_tokens - got.restored
    rows = warm.ctl("--json", "cache", "dump", "--model", model).json()["rows"]
    assert rows and {r["memory"] for r in rows} == {MODELS[model].memory}
    for r in rows:  # a finish row's state is its prompt's; an evicted one may hold its settled reply too
        assert r["frontier"] < r["tokens"] or r["save_reason"] in ("cold", "evict")
        # a state that cannot be cut is kept where a longer prompt can extend it, or at the end of a settled text
        assert r["frontier"] % grain == 0 or MODELS[model].memory == "full" or r["frontier"] == r["tokens"]
    # Stored as chains of 128-token blocks (the default), which the rows of one conversation share; a
    # recurrent state has no attention cells to cut and stays whole.
    assert all(r["blocks"] == (0 if MODELS[model].memory == "recurrent" else r["frontier"] // BLOCK) for r in rows)
    if sum(1 for r in rows if r["blocks"]) > 1:  # one conversation's rows share its first blocks
        assert any(r["shared_bytes"] for r in rows)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat(w: Sandbox, model: str, messages: list[tuple[str, str]], parent_key: str = "") -> Completion:
    with w.client() as c:
        return c.complete(b"", model=model, messages=[Message(r, t) for r, t in messages], chat_template=CHATML,
                          max_tokens=12, parent_key=parent_key, timeout=600).result()


@pytest.mark.parametrize("model", list(MODELS))
def test_a_stored_prefix_restores_exactly_after_a_restart(cold: Sandbox, model: str) -> None:
    """An agent's conversation, then a restart (nothing live to lean on): a conversation that shares only its
    system message restores the state stored where that message ended (longest prefix, from disk), and the
    next turn resumes from the first; both replies are a cold prefill's. A state that cannot be cut serves
    only its own length, so the prefill snapshots it at the message's end (the chunk boundary below it), and
    the first prompt's end at the last multiple of the grain before it."""
    words = MODELS[model].words * 2 // 5  # a system message of 250 to 1,200 tokens
    system = ("system", doc(40 + len(model), words))
    # a long task, so that the cold capture (near the prompt's end) lies past the system message
    first = [system, ("user", doc(41, words))]
    with Sandbox.new(POLICY + models_config_of(model)) as w:
        p = w.start_daemon(timeout=300)
        one = chat(w, model, first)
        assert one.route == "miss"
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0
        w.start_daemon(timeout=300)
        cases = [("longest_prefix", [system, ("user", doc(42, 50))], ""),
                 ("resume", [*first, ("assistant", one.text.decode("utf-8", "replace")), ("user", doc(43, 40))],
                  one.key)]
        for route, messages, parent in cases:
            flush(w, model)
            flush(cold, model)
            got, ref = chat(w, model, messages, parent), chat(cold, model, messages)
            assert ref.route == "miss" and got.text == ref.text, (route, got.route, got.restored)
            # The tiny models' tokenizers join the cue's newline to the reply's first bytes: the parent's last
            # token is not the prompt's, and the next best row (the snapshot at the system message) serves.
            served = {route, "longest_prefix"} if MODELS[model].path in TINY else {route}
            assert got.route in served and got.tier == "disk" and got.restored >= CHUNK, (route, got.route)
            if MODELS[model].memory != "full":  # a state kept where a longer prompt can extend it
                assert got.restored % verdicts(w)[model]["grain"] == 0, got.restored


def test_models_show_their_memory_kind_and_every_knob_loads(warm: Sandbox) -> None:
    """`models` shows each model's memory kind, window and knobs; a load with every knob set serves, and a
    cache type the model's heads cannot hold is refused with the reason; dump rows show their kind."""
    models = {m["name"]: m for m in warm.ctl("--json", "models").json()["models"]}
    got = {name: (m["memory"], m["swa_window"], m["swa_full"], m["prefill_chunk"]) for name, m in models.items()}
    assert got == {"smollm2": ("full", 0, False, CHUNK), "smollm2_fa": ("full", 0, False, CHUNK),
                   "smollm2_tiled": ("full", 0, False, CHUNK),
                   "gemma": ("swa", 512, True, CHUNK),
                   "gemma_ring": ("swa", 512, False, CHUNK), "mamba": ("recurrent", 0, False, CHUNK),
                   "lfm2": ("hybrid", 0, False, CHUNK)}
    assert models["mamba"]["reuse"] == "a state at its own length only" and models["smollm2"]["n_threads"] == 1
    table = warm.ctl("models", COLUMNS="400").out
    assert "swa(512)" in table and "hybrid" in table and "restores and cuts at any" in table
    reuse = {name: m["exact_reuse"] for name, m in models.items()}
    assert all(r["source"] in ("probe", "memo") and CHUNK % r["grain"] == 0 for r in reuse.values()), reuse
    assert reuse["smollm2"]["grain"] < CHUNK  # SmolLM2 Q4_1's floats do not depend on the split (FACTS)
    tiled = reuse["smollm2_tiled"]
    assert (tiled["grain"], tiled["min_batch"], tiled["merged"], tiled["spans"]) == (1, 64, True, True), tiled
    quantised = ("--flash-attn", "--type-k", "q8_0", "--type-v", "q4_0")
    r = warm.ctl("--json", "load", "knobs", "--path", _bundled(), "--n-threads", "2", "--n-gpu-layers", "0",
                 "--no-swa-full", *quantised)
    assert r.rc == 0, r.err
    loaded = r.json()
    assert (loaded["n_threads"], loaded["n_gpu_layers"], loaded["gpu_layers"], loaded["flash_attn"]) == (2, 0, 0, True)
    assert (loaded["type_k"], loaded["type_v"], loaded["memory"]) == ("q8_0", "q4_0", "full")
    assert ask(warm, "knobs", doc(7, 200)).completion_tokens == 12
    assert warm.ctl("unload", "knobs").rc == 0
    # the tiny LFM2's heads are 16 wide: llama.cpp stores no 32-value block in them, and the error says so
    r = warm.ctl("load", "narrow", "--path", str(tiny_hybrid_path()), *quantised)
    assert r.rc == 1 and "head size to be a multiple" in r.err and r.err.count("\n") == 1, r.err
    dump = warm.ctl("cache", "dump", "--model", "knobs", COLUMNS="250").out.splitlines()
    rows = [line for line in dump if "knobs" in line]
    assert "memory" in dump[2] and rows and all("full" in line for line in rows), dump


def test_live_turn_equals_restored_turn_after_restart() -> None:
    """Turn 2 served from the live sequence, and turn 2 served after a restart by restoring turn 1's
    finish checkpoint (its prompt: the reply is prefilled again), reply the same; and the same with the
    chunk rule forced (policy reuse_grain = the chunk), which reuses whole chunks only."""
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
        n1, n2 = first["tokens"]["prompt"], restored["tokens"]["prompt"]
        assert restored["cache"]["restored_tokens"] == full_rule(w).aligned(n1, n1, n2, None)
        assert restored["text"] == live["text"]
    with Sandbox.new(POLICY + f"reuse_grain = {CHUNK}\n") as w:
        w.start_daemon()
        assert complete(w, turn1)["text"] == first["text"]
        assert verdicts(w)["smollm2"]["grain"] == CHUNK
        coarse = complete(w, turn2)
        assert coarse["cache"]["path"] == "live" and coarse["cache"]["restored_tokens"] % CHUNK == 0
        assert coarse["text"] == live["text"]


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
    n1, n2 = first["tokens"]["prompt"], got["tokens"]["prompt"]
    assert got["cache"]["restored_tokens"] == full_rule(w).aligned(n1, n1, n2, None)  # its prompt only


def test_every_save_reason_lands_in_the_index() -> None:
    # Whole states: stored as blocks, the finish would supersede the cold and continued rows it extends.
    with Sandbox.new(POLICY + "\n[cache]\nblock_tokens = 0\n") as w:
        w.start_daemon()
        complete(w, doc(400, 700), "--max-tokens", "20")      # cold (at 512), continued (at 16), finish
        assert {"cold", "continued", "finish"} <= reasons(w)
    # flash attention off: with it, settling a reply shorter than 64 tokens cuts back into its prompt, and the
    # state is saved first (reason evict), so shutdown would find it stored
    with Sandbox.new(POLICY + '\n[[models]]\nname = "smollm2"\nflash_attn = false\n') as w:
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
    return str(bundled_model_path("smollm2"))

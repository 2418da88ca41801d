"""What the worker relies on from a backend, checked on FakeBackend and on llama.cpp with the real model.

The same assertions run on both, so the fake the engine tests use cannot drift from what llama.cpp does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from barreld.engine.backend import Backend, BackendError, BatchItem, ContextSettings
from barreld.engine.chat import Message, render
from barreld.engine.registry import bundled_model_path
from barreld.engine.sampler import Sampler
from barreld.engine.sampling import SamplingParams
from barreld.errors import InvalidArgument
from tests.fakes.backend import FakeBackend, write_gguf

TEXT = b"The quick brown fox jumps over the lazy dog, because the morning was cold and the river wide."
SETTINGS = ContextSettings(n_ctx=256, n_batch=128, n_seq_max=2, n_threads=1)


@pytest.fixture(params=["fake", pytest.param("llama", marks=pytest.mark.model)], scope="module")
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backend:
    if request.param == "fake":
        be: Backend = FakeBackend(write_gguf(tmp_path_factory.mktemp("m") / "fake.gguf"), SETTINGS)
    else:
        from barreld.engine.llama_backend import LlamaBackend

        path = bundled_model_path("smollm2")
        assert path is not None, "the bundled model is not installed"
        be = LlamaBackend(Path(path), SETTINGS)
    yield be
    be.close()


@pytest.fixture
def be(backend: Backend) -> Backend:
    """The module's backend with both sequences empty."""
    for seq in range(backend.n_seq_max):
        backend.seq_rm(seq, 0, -1)
    return backend


def prefill(be: Backend, seq: int, tokens: list[int], start: int = 0) -> np.ndarray:
    """Decodes tokens in one batch at positions start..; returns the last one's logits."""
    be.decode([BatchItem(t, start + i, seq, i == len(tokens) - 1) for i, t in enumerate(tokens)])
    return be.logits(len(tokens) - 1)


def test_logits_are_a_function_of_the_token_history(be: Backend) -> None:
    prompt = be.tokenize(TEXT)
    first = prefill(be, 0, prompt)
    assert np.array_equal(prefill(be, 1, prompt), first)
    be.seq_rm(1, 0, -1)
    other = be.tokenize(TEXT.replace(b"quick", b"slow"))
    assert other[-3:] == prompt[-3:]
    assert not np.array_equal(prefill(be, 1, other), first)


def test_a_row_read_in_place_holds_the_logits_a_copy_holds_until_the_next_decode(be: Backend) -> None:
    prompt = be.tokenize(TEXT)
    be.decode([BatchItem(t, i, 0, True) for i, t in enumerate(prompt)])
    copies = [be.logits(i) for i in range(len(prompt))]
    assert all(np.array_equal(be.row(i), c) for i, c in enumerate(copies))
    assert not np.array_equal(copies[0], copies[-1])
    with pytest.raises(BackendError):
        be.row(len(prompt))


def test_a_prefill_split_into_batches_of_two_or_more_matches_one_batch(be: Backend) -> None:
    prompt = be.tokenize(TEXT)
    whole = prefill(be, 0, prompt)
    for split in (2, len(prompt) // 2, len(prompt) - 2):
        be.seq_rm(1, 0, -1)
        prefill(be, 1, prompt[:split])
        assert np.array_equal(prefill(be, 1, prompt[split:], split), whole), split


def test_a_restored_state_and_a_cut_state_continue_as_a_cold_prefill(be: Backend) -> None:
    prompt = be.tokenize(TEXT)
    whole = prefill(be, 0, prompt)
    be.state_set(1, memoryview(bytes(be.state_get(0))))
    nxt = be.tokenize_tail(b" and")[0]
    be.decode([BatchItem(nxt, len(prompt), 0, True), BatchItem(nxt, len(prompt), 1, True)])
    assert np.array_equal(be.logits(0), be.logits(1))
    be.seq_rm(1, 5, -1)
    assert np.array_equal(prefill(be, 1, prompt[5:], 5), whole)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_foreign_or_damaged_state_is_refused_and_leaves_the_sequence_empty(be: Backend, damage: str) -> None:
    prompt = be.tokenize(TEXT)
    whole = prefill(be, 0, prompt)
    state = bytes(be.state_get(0))
    prefill(be, 1, prompt[:4])
    bad = b"\x17" * 64 if damage == "garbage" else state[: len(state) // 2]
    with pytest.raises(BackendError):
        be.state_set(1, memoryview(bad))
    assert np.array_equal(prefill(be, 1, prompt), whole)  # position 0 is next: nothing was left behind


def test_a_position_that_does_not_follow_the_sequence_is_refused(be: Backend) -> None:
    prompt = be.tokenize(TEXT)
    prefill(be, 0, prompt[:6])
    for start in (8, 3):
        with pytest.raises(BackendError):
            prefill(be, 0, prompt[6:9], start)
    prefill(be, 0, prompt[6:9], 6)


def test_text_can_retokenise_differently_from_the_tokens_that_made_it(be: Backend) -> None:
    apart = be.tokenize_tail(b"h") + be.tokenize_tail(b"ello")
    joined = b"".join(be.piece(t) for t in apart)
    assert joined == b"hello" and be.tokenize_tail(joined) != apart
    chat = render(be.chat_template, (Message("user", "hi"),), bos=be.bos_text, eos=be.eos_text, model="m")
    tokens = be.tokenize(chat)
    assert b"".join(be.piece(t) for t in tokens).endswith(chat)
    assert len(tokens) < len(chat) and any(be.is_eog(t) for t in range(be.n_vocab))


def test_positions_held_are_reported_after_a_prefill_a_cut_and_a_clear(be: Backend) -> None:
    """The check every warm start ends with: what llama.cpp says the sequence holds."""
    assert be.memory == "full" and be.swa_window == 0 and not be.swa_full
    prompt = be.tokenize(TEXT)
    assert be.seq_pos_range(0) == (-1, -1)
    prefill(be, 0, prompt)
    assert be.seq_pos_range(0) == (0, len(prompt) - 1)
    be.seq_rm(0, 5, -1)
    assert be.seq_pos_range(0) == (0, 4) and be.seq_pos_range(1) == (-1, -1)
    be.state_set(1, memoryview(bytes(be.state_get(0))))
    assert be.seq_pos_range(1) == (0, 4)
    be.seq_rm(0, 0, -1)
    assert be.seq_pos_range(0) == (-1, -1)


def test_a_grammar_is_matched_against_the_vocabulary_or_refused_without_one(be: Backend) -> None:
    """llama.cpp's backend hands its vocabulary to the grammar sampler; a backend without one (the fake)
    refuses a grammar instead of sampling unconstrained."""
    logits = prefill(be, 0, be.tokenize(TEXT))
    params = SamplingParams(grammar='root ::= " over the river"')
    if be.vocab is None:
        with pytest.raises(InvalidArgument, match="grammar"):
            Sampler(params, be.n_vocab, be.vocab)
        return
    token = Sampler(params, be.n_vocab, be.vocab).sample(logits)
    assert be.piece(token) and b" over the river".startswith(be.piece(token))
    # Logits that rule out every token the grammar allows: refused, never told to the grammar (an abort).
    for temperature in (0.0, 1.0):
        dead = np.full_like(logits, -np.inf)
        dead[token] = -np.inf
        dead[be.tokenize_tail(b"x")[0]] = 1.0
        with pytest.raises(InvalidArgument, match="allows no token"):
            Sampler(SamplingParams(temperature=temperature, grammar=params.grammar), be.n_vocab, be.vocab).sample(dead)


@pytest.mark.model
def test_with_flash_attention_a_chunk_beside_another_sequences_token_gets_other_floats() -> None:
    """Why the planner gives each prefill a llama.cpp call of its own (`barreld.engine.plan`): with several
    sequences llama.cpp cuts a batch into micro-batches of equally many tokens of each, so the chunk's first
    token goes in one of its own, and flash attention's CPU kernel computes a batch under 64 tokens otherwise."""
    from barreld.engine.llama_backend import LlamaBackend

    path = bundled_model_path("smollm2")
    assert path is not None, "the bundled model is not installed"
    be = LlamaBackend(Path(path), ContextSettings(n_ctx=512, n_batch=256, n_seq_max=2, n_threads=1,
                                                 flash_attn=True))
    try:
        tokens = (be.tokenize(TEXT) * 8)[:128]
        states = []
        for beside in (False, True):
            for seq in (0, 1):
                be.seq_rm(seq, 0, -1)
            prefill(be, 1, tokens[:8])
            prefill(be, 0, tokens[:64])
            chunk = [BatchItem(tokens[p], p, 0, p == len(tokens) - 1) for p in range(64, len(tokens))]
            be.decode(chunk + [BatchItem(tokens[8], 8, 1, True)] if beside else chunk)
            states.append(bytes(be.state_get(0)))
        assert states[0] != states[1]
    finally:
        be.close()


@pytest.mark.model
@pytest.mark.parametrize(("model", "swa_full", "shared"), [("smollm2", False, 3), ("gemma", True, 0),
                                                          ("recurrent", False, 0)])
def test_prefills_that_share_calls_end_in_the_states_each_gets_alone(model: str, swa_full: bool, shared: int) -> None:
    """The probe's verdict (`exactness._Probe.shared`), then checked on other prompts through the planner: three
    prompts of other lengths prefilled together, calls shared as the verdict allows, against each prefilled
    alone. SmolLM2 with flash attention (its default) shares; Gemma 3 Q4_K_M with full-length window caches and
    a Mamba do not, and forcing their runs of 7 tokens into one call shows why (measured here: Gemma's states
    differ; the Mamba's states match but its last logits do not, three output rows taking another kernel than
    one)."""
    from barreld.engine.exactness import measure
    from barreld.engine.llama_backend import LlamaBackend
    from barreld.engine.plan import Slot, plan_batch
    from barreld.engine.registry import model_memory
    from tests.support.sandbox_models import gemma_path, tiny_recurrent_path

    path = {"smollm2": lambda: Path(bundled_model_path("smollm2") or ""), "gemma": gemma_path,
            "recurrent": tiny_recurrent_path}[model]()
    be = LlamaBackend(path, ContextSettings(n_ctx=512, n_batch=256, n_seq_max=3, flash_attn=None, swa_full=swa_full))
    try:
        memory = model_memory(be, 64)
        verdict = measure(be, memory)
        assert verdict.shared == shared, verdict
        text = be.tokenize(TEXT * 12)
        prompts = {seq: text[3 * seq : 3 * seq + n] for seq, n in enumerate((200, 171, 230))}

        def prefilled(seqs: list[int], shared: int, runs: int = 0) -> tuple[dict[int, tuple[bytes, bytes]], int]:
            """Each of seqs prefilled from empty (its first `runs` tokens only, if given) as the planner
            plans ticks with `shared`; each one's state and last logits, and how many calls held several
            sequences."""
            pos, together, last = dict.fromkeys(seqs, 0), 0, {}
            targets = {s: prompts[s][: runs or None] for s in seqs}
            for seq in seqs:
                be.seq_rm(seq, 0, -1)
            while slots := [Slot(s, pos[s], targets[s], None) for s in seqs if pos[s] < len(targets[s])]:
                batch = plan_batch(slots, memory.chunk, be.n_batch, True, False, verdict.min_batch, verdict.spans,
                                   shared)
                for a, b in batch.calls:
                    be.decode(batch.items[a:b])
                    together += len({it.seq for it in batch.items[a:b]}) > 1
                    last |= {slots[i].seq: be.logits(idx - a).tobytes() for i, idx in batch.prefills if a <= idx < b}
                for it in batch.items:
                    pos[it.seq] = it.pos + 1
            return {s: (bytes(be.state_get(s)), last[s]) for s in seqs}, together

        if shared:
            alone = {seq: prefilled([seq], 0)[0][seq] for seq in prompts}
            states, together = prefilled(list(prompts), verdict.shared)
            assert together >= 2 and states == alone
        else:
            alone = {seq: prefilled([seq], 0, 7)[0][seq] for seq in prompts}
            states, together = prefilled(list(prompts), 3, 7)
            assert together == 1 and states != alone
    finally:
        be.close()

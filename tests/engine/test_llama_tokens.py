"""LlamaBackend keeps the tokens of recent prompts: the same bytes tokenise the same, so a prompt sent again
(an exact hit is one) skips llama.cpp's tokenizer, and one that extends a kept prompt tokenises only its new part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from barreld.engine import llama_backend
from barreld.engine.backend import ContextSettings
from barreld.engine.registry import bundled_model_path
from barreld.engine.token_prefix import Specials, extend

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def be():
    path = bundled_model_path("smollm2")
    assert path is not None, "the bundled model is not installed"
    backend = llama_backend.LlamaBackend(Path(path), ContextSettings(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1))
    yield backend
    backend.close()


def test_a_prompt_tokenised_again_gives_the_same_tokens_and_a_list_of_its_own(be) -> None:
    text = b"<|im_start|>user\nThe river was wide and the morning cold.<|im_end|>\n"
    first = be.tokenize(text)
    first.append(-1)  # the caller's list: the kept tokens do not change with it
    again = be.tokenize(text)
    assert again == first[:-1] == be._tokenize(text, True) and again is not first
    assert be.tokenize(bytearray(text)) == again
    assert be.tokenize_tail(text) == be._tokenize(text, False)  # not through the kept tokens


def test_the_kept_tokens_are_bounded(be, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_backend, "TOKENIZED_MEMO_TOKENS", 64)
    be._tokenized.clear()
    be._tokenized_count = 0
    texts = [b"prompt %d: " % i + b"the stone garden window letter " * 2 for i in range(20)]
    for t in texts:
        assert be.tokenize(t) == be._tokenize(t, True)
    assert 0 < be._tokenized_count <= 64
    assert be._tokenized_count == sum(len(v) for v in be._tokenized.values())
    assert (b"", texts[-1]) in be._tokenized and (b"", texts[0]) not in be._tokenized
    long = b"word " * 40  # more than a quarter of the bound: not kept at all
    assert be.tokenize(long) == be._tokenize(long, True) and (b"", long) not in be._tokenized


# ---- a prompt that extends a kept one (token_prefix) ------------------------------------------------------

GEMMA_PIECES = [b"<start_of_turn>", b"<end_of_turn>", b"<bos>", b"\n", b"\n\n", b"\n\n\n", b"  ", b"    ", b"<b>",
                b"</b>", b"<start_of", b"turn>", b"<end_of_turn", b"<", b">", b"user", b"model"]
SMOLLM2_PIECES = [b"<|im_start|>", b"<|im_end|>", b"<|endoftext|>", b"<|im_start", b"|>", b"<|", b"\n", b"\n\n",
                  b"system", b"assistant"]
PLAIN_PIECES = [b"The ", b"river ", b"was", b" wide", b" and", b"  cold", b".", b",", b"\t", b" ", b"\xc3\xa9t\xc3\xa9",
                b"\xe4\xb8\xad\xe6\x96\x87", b"\xf0\x9f\x8c\x8a", b"\xff", b"{\"name\": \"Bash\"}", b"123", b"'s"]


@pytest.fixture(scope="module")
def gemma():
    from tests.support.sandbox_models import gemma_path

    backend = llama_backend.LlamaBackend(gemma_path(), ContextSettings(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1))
    yield backend
    backend.close()


def _texts(pieces: list[bytes]) -> st.SearchStrategy[bytes]:
    return st.lists(st.sampled_from(pieces + PLAIN_PIECES), max_size=40).map(b"".join)


def _extensions(backend, pieces: list[bytes]) -> None:
    """Each example: a kept prompt, then one that shares some of it and goes on; the tokens must be llama.cpp's
    own for the whole text, whether or not the kept ones were used."""

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(head=_texts(pieces), kept_tail=_texts(pieces), tail=_texts(pieces), cut=st.integers(0, 12))
    def check(head: bytes, kept_tail: bytes, tail: bytes, cut: int) -> None:
        kept = head + kept_tail
        text = kept[: max(len(head), len(kept) - cut)] + tail
        assert backend.tokenize(kept) == backend._tokenize(kept, True)
        assert backend.tokenize(text) == backend._tokenize(text, True)

    check()


@pytest.mark.parametrize("model", ["gemma", "smollm2"])
def test_a_prompt_extending_a_kept_one_tokenises_as_llama_cpp_does_whole(model: str, request, monkeypatch) -> None:
    backend = request.getfixturevalue("gemma" if model == "gemma" else "be")
    pieces = GEMMA_PIECES if model == "gemma" else SMOLLM2_PIECES
    used = []
    real = llama_backend.extend

    def counted(*args: object) -> list[int] | None:
        tokens = real(*args)
        used.append(tokens is not None)
        return tokens

    monkeypatch.setattr(llama_backend, "extend", counted)
    _extensions(backend, pieces)
    assert sum(used) >= 30, f"kept tokens used in {sum(used)} of {len(used)} extensions"  # shown on enough cuts


def test_an_agent_session_tokenises_each_call_from_the_one_before(gemma) -> None:
    """A real Claude Code session's prompts, as barreld renders them: every call after the first extends the
    one before, and its tokens are llama.cpp's own for the whole text."""
    from bench.claude_session import SESSION, Renderer
    from tests.unit.test_tool_formats import dialogue_template

    renderer = Renderer(dialogue_template(), gemma.bos_text, gemma.eos_text)
    prompts = [renderer.prompt(body).encode() for body in json.loads(SESSION.read_text())["requests"]]
    tokenised = [gemma.tokenize(p) for p in prompts]
    assert tokenised == [gemma._tokenize(p, True) for p in prompts]
    assert all(extend([(q, t)], p, gemma._specials, gemma.tokenize_tail) is not None
               for q, t, p in zip(prompts[:-1], tokenised[:-1], prompts[1:], strict=True))


def test_a_tenant_s_prompt_is_never_tokenised_from_another_tenant_s(be, monkeypatch: pytest.MonkeyPatch) -> None:
    """How fast a prompt tokenises must not tell one tenant whether another sent a text like it: the kept
    prompts a new one is compared with, and the exact ones it may hit, are its own tenant's only."""
    alice = b"<|im_start|>system\nThe door code is 4711.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
    guess = alice + b"<|im_start|>assistant\nhi<|im_end|>\n"
    seen: list[list[bytes]] = []
    real = llama_backend.extend

    def spy(kept, *args: object) -> list[int] | None:
        seen.append([text for text, _ in kept])
        return real(kept, *args)

    monkeypatch.setattr(llama_backend, "extend", spy)
    be.tokenize(alice, b"alice")
    assert be.tokenize(guess, b"bob") == be._tokenize(guess, True) and alice not in seen[-1]
    assert be.tokenize(alice, b"bob") == be._tokenize(alice, True) and alice not in seen[-1]  # not her memo hit
    more = guess + b"<|im_start|>user\nmore"
    assert be.tokenize(more, b"alice") == be._tokenize(more, True) and alice in seen[-1]


def test_a_vocabulary_whose_special_tokens_strip_whitespace_is_not_cut() -> None:
    assert Specials.of([(1, b"<|end|>", True), (2, b"<s>", False)]) is None
    specials = Specials.of([(1, b"<|end|>", False), (2, b"\n", False), (3, b"\xe2\x96\x81", False),
                            (4, b"\xe2\x96", False), (5, b"<dup>", False), (6, b"<dup>", False)])
    assert specials is not None and set(specials.cuts) == {b"<|end|>", b"\n", b"\xe2\x96\x81"}


def test_a_cut_is_not_checked_where_the_kept_text_after_it_outweighs_the_saving() -> None:
    specials = Specials.of([(1, b"<s>", False), (2, b"<|end|>", False)])
    tails: list[bytes] = []

    def tail(text: bytes) -> list[int]:
        tails.append(text)
        return [ord(c) for c in text.decode()]

    kept = b"<s>" + b"x" * 100
    assert extend([(kept, [1, *range(100)])], b"<s>new", specials, tail) is None and tails == []
    kept = b"<s>" + b"a" * 50 + b"<|end|>" + b"b" * 10
    tokens = [1, *[ord("a")] * 50, 2, *[ord("b")] * 10]
    assert extend([(kept, tokens)], kept[:60] + b"c", specials, tail) == [*tokens[:52], ord("c")]
    assert tails == [b"b" * 10, b"c"]


def test_a_cut_is_refused_where_a_special_text_lies_across_it_or_its_token_start() -> None:
    specials = Specials.of([(1, b"<|end|>", False), (2, b"|>x", False), (3, b"d|", False), (4, b"\n", False),
                            (5, b"xyza<|en", False)])
    assert specials is not None
    assert specials.matched_before(b"a<|end|>b", b"a<|end|>c", 8) == 1
    assert specials.matched_before(b"xyza<|end|>b", b"xyza<|end|>c", 11) is None  # the longer one is matched first
    assert specials.matched_before(b"a<|end|>b", b"a<|end|>x", 8) is None  # "|>x" across the end
    assert specials.matched_before(b"a<|end|>\n", b"a<|end|>\n", 9) == 4
    assert specials.matched_before(b"ab\n", b"ab\n", 2) is None  # "b" is not special

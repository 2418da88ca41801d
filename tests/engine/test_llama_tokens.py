"""LlamaBackend keeps the tokens of recent prompts: the same bytes tokenise the same, so a prompt sent again
(an exact hit is one) skips llama.cpp's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from barreld.engine import llama_backend
from barreld.engine.backend import ContextSettings
from barreld.engine.registry import bundled_model_path

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
    assert texts[-1] in be._tokenized and texts[0] not in be._tokenized
    long = b"word " * 40  # more than a quarter of the bound: not kept at all
    assert be.tokenize(long) == be._tokenize(long, True) and long not in be._tokenized

"""Which context parameters change a sequence's KV state, measured on the real model.

This is the evidence behind barreld.cache.key.CtxParams: what changes the bytes or layout is in the
key, what does not is left out (so checkpoints are shared across those settings).
"""

from __future__ import annotations

import numpy as np
import pytest

from barreld.engine.backend import BackendError, BatchItem
from barreld.engine.llama_backend import ContextSettings, LlamaBackend
from barreld.engine.registry import bundled_model_path

pytestmark = pytest.mark.model
PROMPT = b"The quick brown fox jumps over the lazy dog. " * 6


def prefilled(settings: ContextSettings, seq: int = 0) -> tuple[LlamaBackend, int]:
    b = LlamaBackend(bundled_model_path("smollm2"), settings)
    tokens = b.tokenize(PROMPT)
    for start in range(0, len(tokens), settings.n_batch):
        chunk = tokens[start : start + settings.n_batch]
        b.decode([BatchItem(t, start + i, seq, False) for i, t in enumerate(chunk)])
    return b, len(tokens)


def state(settings: ContextSettings, seq: int = 0) -> bytes:
    b, _ = prefilled(settings, seq)
    try:
        return bytes(b.state_get(seq))
    finally:
        b.close()


def next_logits(b: LlamaBackend, seq: int, n: int) -> np.ndarray:
    b.decode([BatchItem(100, n, seq, False), BatchItem(200, n + 1, seq, True)])
    return b.logits(1)


BASE = ContextSettings(n_ctx=256)


@pytest.mark.parametrize(
    "other",
    [ContextSettings(n_ctx=256, n_batch=64), ContextSettings(n_ctx=256, n_threads=1), ContextSettings(n_ctx=512)],
    ids=["n_batch", "n_threads", "n_ctx"],
)
def test_scheduling_parameters_leave_the_state_bytes_unchanged(other: ContextSettings) -> None:
    assert state(other) == state(BASE)


@pytest.mark.parametrize(
    "other",
    [ContextSettings(n_ctx=256, type_k=8), ContextSettings(n_ctx=256, flash_attn=True)],
    ids=["type_k", "flash_attn"],
)
def test_kv_type_and_flash_attention_change_the_state(other: ContextSettings) -> None:
    assert state(other) != state(BASE)


def test_a_state_restores_exactly_into_another_context_with_the_same_stream_count() -> None:
    a, n = prefilled(BASE)
    saved = a.state_get(0)
    ref = next_logits(a, 0, n)
    a.close()
    b = LlamaBackend(bundled_model_path("smollm2"), ContextSettings(n_ctx=512, n_threads=1))
    try:
        b.state_set(0, memoryview(saved))
        assert np.array_equal(next_logits(b, 0, n), ref)
    finally:
        b.close()


def test_the_stream_count_is_part_of_the_layout() -> None:
    """n_seq_max > 1 gives one KV stream per sequence; llama.cpp refuses a state made with another count."""
    single = state(BASE)
    b = LlamaBackend(bundled_model_path("smollm2"), ContextSettings(n_ctx=256, n_seq_max=2))
    try:
        with pytest.raises(BackendError):
            b.state_set(1, memoryview(single))
    finally:
        b.close()

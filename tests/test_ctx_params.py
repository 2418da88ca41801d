"""Which context parameters change a sequence's KV state, measured on the real model.

This is the evidence behind barreld.cache.key.CtxParams: what changes the bytes or layout is in the
key, what does not is left out (so checkpoints are shared across those settings). The engine's side of the
same rule (each load knob changes the key exactly when it changes a state) is tests/engine/test_registry.py;
swa_full's effect on a sliding-window state is pinned in tests/test_model_kinds.py.
"""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest

from barreld.engine.backend import BackendError, BatchItem
from barreld.engine.llama_backend import ContextSettings, LlamaBackend
from barreld.engine.registry import bundled_model_path
from tests.support.sandbox_models import gemma_path

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


def test_a_quantised_v_cache_with_flash_attention_changes_the_state() -> None:
    flash = ContextSettings(n_ctx=256, flash_attn=True)
    assert state(ContextSettings(n_ctx=256, flash_attn=True, type_v=8)) != state(flash)


@pytest.mark.skipif(llama_cpp.llama_supports_gpu_offload(), reason="this build offloads layers to a GPU")
@pytest.mark.parametrize("n_gpu_layers", [0, 12])
def test_a_cpu_build_offloads_nothing_and_the_state_is_the_same(n_gpu_layers: int) -> None:
    """The key holds the layers actually offloaded: 0 here, whatever n_gpu_layers asks."""
    settings = ContextSettings(n_ctx=256, n_gpu_layers=n_gpu_layers)
    b, _ = prefilled(settings)
    try:
        assert b.gpu_layers == 0 and bytes(b.state_get(0)) == state(BASE)
    finally:
        b.close()


@pytest.mark.parametrize(
    ("path", "sensitive"),
    [(lambda: bundled_model_path("smollm2"), False), (gemma_path, True)],
    ids=["smollm2", "gemma"],
)
def test_the_prefill_split_changes_the_state_of_some_models(path, sensitive: bool) -> None:
    """Gemma's repacked Q4_K kernels give other floats when batches split elsewhere; SmolLM2's do not. So the
    chunk size every prefill splits at is in the key."""
    states = []
    for chunk in (64, 62):
        b = LlamaBackend(path(), ContextSettings(n_ctx=256, n_batch=64, n_threads=1))
        try:
            tokens = b.tokenize(PROMPT * 3)[:200]
            for start in range(0, len(tokens), chunk):
                part = tokens[start : start + chunk]
                b.decode([BatchItem(t, start + i, 0, False) for i, t in enumerate(part)])
            states.append(bytes(b.state_get(0)))
        finally:
            b.close()
    assert (states[0] != states[1]) is sensitive


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

"""The few llama.cpp operations the worker needs, as an interface a fake can stand in for in unit tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from barreld.names import MemoryKind


class BackendError(Exception):
    """llama.cpp refused an operation (decode failed, a state did not fit, ...)."""


class ModelLoadError(Exception):
    """The file is missing, is not a GGUF, or the backend could not load it."""


@dataclass(frozen=True)
class BatchItem:
    token: int
    pos: int
    seq: int
    logits: bool


@dataclass(frozen=True)
class ContextSettings:
    n_ctx: int = 4096  # cells per sequence
    n_batch: int = 512
    n_seq_max: int = 1
    n_threads: int = 0  # 0: the number of usable cores
    n_gpu_layers: int = -1  # layers to offload: -1 all that the build can, 0 none
    type_k: int = 1  # GGML_TYPE_F16
    type_v: int = 1
    flash_attn: bool | None = False  # None: as `resolve_flash_attn` chooses for the model's memory
    swa_full: bool = False  # keep every SWA cell in the live context, not just the last window
    n_ubatch: int = 0  # rows llama.cpp computes at once; 0: n_batch (bench.ubatch measures smaller ones)


def resolve_flash_attn(asked: bool | None, memory: MemoryKind, swa_full: bool) -> bool:
    """Flash attention as asked, or where nothing was asked, on for full attention and for a sliding-window
    model whose window layers keep full-length caches (swa_full); off for a window in a ring (swa_full off) and
    for recurrent and hybrid models (not measured). Measured here, one run each against llama-server (whose
    `auto` turns it on): SmolLM2 prefilled 8,000 tokens 1.2x faster with it; its CPU kernel's other path under
    64 rows is met by calls of 64 tokens at least (the probe's spans) and the logits a row keeps after each of
    its conversation's prompts, so its warm starts reuse as much as without it. Gemma 3 prefilled its
    12,000-token agent head 1.5x faster with it under swa_full; in a ring Gemma prefilled faster without it,
    the more so the longer the prompt (3,000 tokens 1.03x, 12,000 1.11x, 24,000 1.18x), its warm starts exact
    at the same points both ways."""
    if asked is not None:
        return asked
    return memory is MemoryKind.FULL or (memory is MemoryKind.SWA and swa_full)


class Backend(Protocol):
    n_ctx: int  # cells per sequence
    n_batch: int
    n_seq_max: int
    n_vocab: int
    vocab: Any  # llama.cpp's vocabulary (a pointer) for its grammar sampler; None where there is none
    chat_template: str | None  # the model's own Jinja chat template, if it has one
    bos_text: str  # how the template spells the begin- and end-of-sequence tokens
    eos_text: str
    # What the cache key needs from the loaded model beyond its file: the llama_ftype (quantisation)
    # and the RoPE parameters the context applies to K before caching it.
    ftype: int
    rope_freq_base: float
    rope_freq_scale: float
    # What the model keeps per token (see barreld.engine.memory), and what changes the floats it computes.
    memory: MemoryKind
    swa_window: int  # tokens a sliding-window layer sees; 0 without one
    swa_full: bool  # the whole SWA cache is kept in the live context (only meaningful with a window)
    flash_attn: bool  # as the context runs, settings' None resolved
    mrope: bool  # M-RoPE: each cell of a state carries extra position bytes
    gpu_layers: int  # layers actually offloaded: 0 on a build without GPU support, whatever was asked

    def tokenize(self, data: bytes, scope: bytes = b"") -> list[int]: ...

    def tokenize_tail(self, data: bytes) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def decode(self, items: list[BatchItem]) -> None:
        """Evaluate one batch; raises BackendError on failure. On an SWA ring, a call that prefills one sequence
        leaves its window cells in position order from the first cell (barreld.engine.memory)."""

    def logits(self, index: int) -> np.ndarray:
        """A copy of the logits of batch position `index` of the last decode."""

    def row(self, index: int) -> np.ndarray:
        """The same logits read in place, with no copy: valid only until the next decode."""

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None: ...

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """The smallest and largest position the sequence's memory reports holding; (-1, -1) when empty."""

    def state_get(self, seq: int) -> bytearray:
        """A copy of the sequence's state, the caller's to keep: a backend may fill the same buffer again only
        once nothing refers to it (StateBuffers)."""

    def state_set(self, seq: int, data: memoryview) -> None: ...

    def close(self) -> None: ...


BackendFactory = Callable[[Path, ContextSettings], Backend]
"""Opens a model file with a context; raises ModelLoadError when it cannot."""

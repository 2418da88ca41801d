"""The few llama.cpp operations the worker needs, as an interface a fake can stand in for in unit tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class BackendError(Exception):
    """llama.cpp refused an operation (decode failed, a state did not fit, ...)."""


@dataclass(frozen=True)
class BatchItem:
    token: int
    pos: int
    seq: int
    logits: bool


class Backend(Protocol):
    n_ctx: int  # cells per sequence
    n_batch: int
    n_seq_max: int
    n_vocab: int

    def tokenize(self, data: bytes) -> list[int]: ...

    def tokenize_tail(self, data: bytes) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def decode(self, items: list[BatchItem]) -> None:
        """Evaluate one batch; raises BackendError on failure."""

    def logits(self, index: int) -> np.ndarray:
        """A copy of the logits of batch position `index` of the last decode."""

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None: ...

    def state_get(self, seq: int) -> bytearray: ...

    def state_set(self, seq: int, data: memoryview) -> None: ...

    def render_chat(self, user_text: bytes) -> bytes: ...

    def close(self) -> None: ...

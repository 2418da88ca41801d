"""One llama.cpp sequence: the tokens whose KV it holds, and their rendering as bytes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from barreld.engine.request import Request


@dataclass(eq=False)
class Sequence:
    id: int
    tokens: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])  # offsets[i]: bytes rendered by tokens[:i]
    rendered: bytearray = field(default_factory=bytearray)
    request: Request | None = None
    last_used: float = field(default_factory=time.monotonic)
    stored_key: bytes | None = None  # a checkpoint of exactly this state is stored or being written
    logits: np.ndarray | None = None  # logits of the last position, when known
    prompt_len: int = 0  # the last request's prompt length: a save indexes that prefix too
    prompt_logits: np.ndarray | None = None  # logits after prompt_len tokens (its prefill's last row)

    @property
    def idle(self) -> bool:
        return self.request is None

    def append(self, token: int, piece: bytes) -> None:
        self.tokens.append(token)
        self.rendered += piece
        self.offsets.append(len(self.rendered))
        self.stored_key = None
        self.logits = None

    def truncate(self, n: int) -> None:
        if n < len(self.tokens):
            del self.tokens[n:]
            del self.offsets[n + 1 :]
            del self.rendered[self.offsets[-1] :]
            if n < self.prompt_len:
                self.prompt_len = n
                self.prompt_logits = None
            self.stored_key = None
            self.logits = None

    def clear(self) -> None:
        self.truncate(0)
        self.prompt_len = 0
        self.prompt_logits = None

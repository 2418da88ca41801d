"""One llama.cpp sequence: its tokens, their rendering as bytes, and how many of them are reusable."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from barreld.cache.key import DEFAULT_NAMESPACE, Namespace
from barreld.engine.request import Request

# Prompt ends whose logits a sequence keeps (and its saves store), the latest ones: a chat or agent session
# replayed after a restart resends its earlier prompts, each an exact hit in the conversation's latest row.
PROMPT_LOGITS_KEPT = 8


@dataclass(frozen=True)
class Snapshot:
    """A copy of a sequence's state when it held exactly its first `length` tokens, all prefilled, taken for a
    memory that cannot be cut back; `logits` follow those tokens when they were the whole prompt."""

    length: int
    state: bytes | bytearray
    logits: np.ndarray | None = None


@dataclass(eq=False)
class Sequence:
    """Its first `frontier` tokens were computed by prefill, split at the chunk boundaries every prefill uses,
    so their KV is exactly what a cold prefill gives and may be reused. Tokens past the frontier were generated
    one per batch (other KV than a prefill's) and are text only: the key of a save covers them, reuse never
    does, and the KV may even lack the last of them."""

    id: int
    tokens: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])  # offsets[i]: bytes rendered by tokens[:i]
    rendered: bytearray = field(default_factory=bytearray)
    request: Request | None = None
    last_used: float = field(default_factory=time.monotonic)
    stored_key: bytes | None = None  # a checkpoint of exactly this text is stored or being written
    origin: bytes | None = None  # the row this text was last saved as or restored from: a later save may supersede it
    frontier: int = 0
    frontier_logits: np.ndarray | None = None  # logits after the frontier's last token, when known
    prompt_len: int = 0  # the last request's prompt length: a save indexes that prefix too
    snapshot: Snapshot | None = None
    # The logits after each of its latest prompts (by their token counts), taken when each was prefilled: the
    # same prompt sent again samples from them once cut back to it, where the memory says the cut is its own.
    prompt_logits: dict[int, np.ndarray] = field(default_factory=dict)
    namespace: Namespace = DEFAULT_NAMESPACE  # whose text it holds: only that namespace's prompts reuse it

    def logits_at(self, n: int) -> int | None:
        """Where the logits that follow the first n tokens, or the frontier's, are known; None if nowhere."""
        if n in self.prompt_logits and n <= self.frontier:
            return n
        return self.frontier if self.frontier_logits is not None else None

    @property
    def idle(self) -> bool:
        return self.request is None

    def append(self, token: int, piece: bytes, prefilled: bool) -> None:
        """Adds a token; a prefilled one moves the frontier when every token before it is prefilled too."""
        if prefilled and self.frontier == len(self.tokens):
            self.frontier += 1
            self.frontier_logits = None
        self.tokens.append(token)
        self.rendered += piece
        self.offsets.append(len(self.rendered))
        self.stored_key = None

    def _keep_prompt_logits(self) -> None:
        if self.frontier_logits is not None and self.frontier == self.prompt_len:
            self.keep_logits({self.frontier: self.frontier_logits})

    def keep_logits(self, rows: dict[int, np.ndarray]) -> None:
        """Takes the logits after earlier prompts of its text (a restored row's), the latest ones kept."""
        self.prompt_logits.update(rows)
        for n in sorted(self.prompt_logits)[:-PROMPT_LOGITS_KEPT]:
            del self.prompt_logits[n]

    def extend_prefilled(self, tokens: list[int], pieces: list[bytes]) -> None:
        """Adds prefilled tokens in one step (a restore): what `append` does for each, without its per-token
        cost on a state of thousands."""
        if self.frontier == len(self.tokens):
            self.frontier += len(tokens)
            self.frontier_logits = None
        self.tokens.extend(tokens)
        self.offsets.extend(list(accumulate((len(p) for p in pieces), initial=len(self.rendered)))[1:])
        self.rendered += b"".join(pieces)
        self.stored_key = None

    def rewind(self, k: int) -> None:
        """Keeps the text but only the first k tokens as prefilled: the KV past them was removed."""
        if k < self.frontier:
            self._keep_prompt_logits()
            self.frontier = k
            self.frontier_logits = None
        if self.snapshot is not None and self.snapshot.length > k:
            self.snapshot = None

    def prefilled(self, end: int, logits: np.ndarray) -> None:
        """Tokens already in the text up to `end` are prefilled now (a reply settled)."""
        self._keep_prompt_logits()
        self.frontier = end
        self.frontier_logits = logits

    def truncate(self, n: int) -> None:
        if n < len(self.tokens):
            del self.tokens[n:]
            del self.offsets[n + 1 :]
            del self.rendered[self.offsets[-1] :]
            self.stored_key = None
        if n < self.frontier:
            self.frontier = n
            self.frontier_logits = None
        for p in [p for p in self.prompt_logits if p > n]:
            del self.prompt_logits[p]
        self.prompt_len = min(self.prompt_len, n)
        if self.snapshot is not None and self.snapshot.length > n:
            self.snapshot = None

    def take(self, tokens: list[int], piece: Callable[[int], bytes], text: bytes) -> int | None:
        """Holds `text`, tokenised as `tokens`, in place of its own tokens from the first that differs, the new
        ones text only, and returns where they start; None, and unchanged, where they do not render to `text`."""
        same = next((i for i, (a, b) in enumerate(zip(self.tokens, tokens, strict=False)) if a != b),
                    min(len(self.tokens), len(tokens)))
        pieces = [piece(t) for t in tokens[same:]]
        if bytes(self.rendered[:self.offsets[same]]) + b"".join(pieces) != text:
            return None
        self.truncate(same)
        for token, text_piece in zip(tokens[same:], pieces, strict=True):
            self.append(token, text_piece, prefilled=False)
        return same

    def clear(self) -> None:
        self.truncate(0)

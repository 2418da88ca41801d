"""A completion request as the worker sees it, and the events it streams back to the server."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from barreld.cache.key import DEFAULT_NAMESPACE, Namespace
from barreld.engine.chat import Message
from barreld.engine.divergence import Divergence
from barreld.engine.sampler import Sampler
from barreld.engine.sampling import SamplingParams
from barreld.engine.stops import StopScanner
from barreld.engine.tools import ToolSpec
from barreld.names import Route

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class CompletionParams:
    prompt: bytes
    chat: bool = False  # render `prompt` as one user turn through the chat template
    messages: tuple[Message, ...] = ()  # a conversation to render instead of `prompt`
    chat_template: str | None = None  # the request's own template, else the model's
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = SamplingParams()
    logprobs: int | None = None  # None: none; 0: each token's own; N: and the N likeliest tokens
    stop: tuple[bytes, ...] = ()
    explain: bool = False  # look up only: report what would be restored and where the prompt left the closest text
    turn_ends: tuple[bytes, ...] = ()  # the model's (a chat only): they end the reply as its end-of-turn token would
    parent_key: bytes | None = None
    tools: ToolSpec | None = None  # rendered into the prompt; a forced call adds its grammar
    message_ends: tuple[int, ...] = ()  # byte offsets in the rendered prompt where its messages end
    opening: bytes = b""  # what the template writes between the reply and a next user message (a chat)
    namespace: Namespace = DEFAULT_NAMESPACE  # the tenant (and salt) whose cached states it may reuse
    template_options: tuple[tuple[str, object], ...] = ()  # the request's variables for the chat template


@dataclass
class CacheReport:
    route: Route = Route.MISS
    restored_tokens: int = 0
    prefilled_tokens: int = 0
    tier: str | None = None
    divergence: Divergence | None = None  # on a miss or partial hit: where the closest live text stopped matching


@dataclass
class Timings:
    lookup: float = 0.0
    restore: float = 0.0
    prefill: float = 0.0
    ttft: float = 0.0
    total: float = 0.0


@dataclass
class Started:
    cache: CacheReport
    prompt_tokens: int
    prompt_key: bytes


@dataclass(frozen=True)
class Alternative:
    token: int
    text: bytes
    logprob: float  # natural log of the model's probability, before the sampler's cuts


@dataclass(frozen=True)
class TokenLogprob:
    chosen: Alternative
    top: tuple[Alternative, ...]  # the likeliest tokens, most likely first


@dataclass
class Token:
    text: bytes
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens this text completes, when asked for


@dataclass
class Done:
    text: bytes
    finish_reason: str  # a FinishReason
    key: bytes
    prompt_key: bytes
    cache: CacheReport
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    logprobs: tuple[TokenLogprob, ...] = ()  # every token the text holds, when asked for
    stop: bytes = b""  # the stop string that ended it, if one did
    # Set by a front end for a reply that called tools: whether it renders, resent in the history, to the bytes
    # it was generated from (so the next turn restores through it); None when not checked.
    prefix_kept: bool | None = None


@dataclass
class Failed:
    error: Exception


Event = Started | Token | Done | Failed


class EventSink(Protocol):
    """Where the worker puts a request's events: by default a queue a server thread blocks on; the HTTP API
    hands them straight to its event loop instead, which saves a thread hop per event."""

    def put(self, item: Event) -> None: ...


@dataclass(eq=False)
class Request:
    """Created by the server thread; from submission on, only the worker thread mutates it."""

    id: int
    params: CompletionParams
    events: EventSink = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    # Set by the worker once the request holds a sequence.
    seq: int = -1
    prompt_tokens: int = 0
    prompt_key: bytes = b""
    target: list[int] = field(default_factory=list)  # tokens the sequence must hold before sampling
    cache: CacheReport = field(default_factory=CacheReport)
    timings: Timings = field(default_factory=Timings)
    sampler: Sampler | None = None
    scanner: StopScanner | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # sampled tokens' entries, when asked for
    logprobs_sent: int = 0  # of which Token events carried this many
    pending: int | None = None  # sampled token not yet in the KV cache
    generated: int = 0
    cold_at: int | None = None  # prompt length at which to capture a cold checkpoint
    boundaries: frozenset[int] = frozenset()  # prompt lengths at which to store a snapshot as its own row
    snapshot_saves: list[Callable[[], object] | None] = field(default_factory=list)  # read; queued once a token is out
    snapshot_at: int = 0  # prompt length at which to copy the state of a memory that cannot be cut (0: none)
    stops: frozenset[int] = frozenset()  # the three above: where a prefill call that holds several chunks ends
    prefill_started: float = 0.0
    first_token_at: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def queue_snapshots(self) -> None:
        """The snapshots read during the prefill go to the writers: before the client hears the request end,
        so a next turn finds them stored or in flight."""
        for save in filter(None, self.snapshot_saves):
            save()
        self.snapshot_saves.clear()

    def unsent_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The entries of the tokens whose text goes out now (a stop string's held-back text waits)."""
        unsent = tuple(self.logprobs[self.logprobs_sent :])
        self.logprobs_sent = len(self.logprobs)
        return unsent

"""The one request every front end fills, whatever its wire format: a prompt or messages, tools, sampling, a
constraint on the reply, the cache keys it names, and its tenant's namespace."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from barreld.cache.key import DEFAULT_NAMESPACE, Namespace
from barreld.engine.chat import Message
from barreld.engine.reply import Echo
from barreld.engine.request import CompletionParams
from barreld.engine.sampling import SamplingParams
from barreld.engine.tools import ToolSpec
from barreld.service.calls import completion_params, constraint


@dataclass(frozen=True)
class CallRequest:
    """One completion request as Barrel runs it."""

    model: str
    stream: bool = False
    prompt: bytes = b""
    messages: tuple[Message, ...] = ()
    chat: bool = False  # render `prompt` as one user turn through the chat template
    chat_template: str | None = None  # the request's own template, else the model's
    max_tokens: int | None = None  # None: until a stop or the context is full with `until_full`, else 256
    until_full: bool = False
    capped: bool = False  # max_tokens above the model's n_ctx is cut to it, not refused
    sampling: SamplingParams = SamplingParams()  # without its grammar, which `params` adds off the event loop
    constraint: tuple[str, object, bool] = ("", None, False)  # GBNF, JSON schema, any JSON object
    logprobs: int | None = None  # None: not asked for; N: N alternatives per token
    stop: tuple[str, ...] = ()
    parent_key: str = ""
    tools: ToolSpec | None = None
    echo: Echo = Echo.TEXT  # how the route's clients send the reply's calls back
    explain: bool = False  # look up only: report what would be restored
    cache_salt: str = ""  # separates the caller's requests further within its tenant (vLLM's name)
    namespace: Namespace = DEFAULT_NAMESPACE  # the tenant and salt, set once the caller is known
    template_options: tuple[tuple[str, object], ...] = ()  # variables for the chat template (enable_thinking, ...)

    def params(self, n_ctx: int) -> CompletionParams:
        """The worker's parameters, checked against the model's n_ctx. A grammar is parsed here, on the call's
        own thread: a client's GBNF is parsed in a child process first."""
        return completion_params(
            n_ctx=n_ctx,
            prompt=self.prompt,
            messages=self.messages,
            chat=self.chat,
            chat_template=self.chat_template,
            max_tokens=self._max_tokens(n_ctx),
            sampling=dataclasses.replace(self.sampling, grammar=constraint(*self.constraint)),
            logprobs=self.logprobs,
            stop=self.stop,
            parent_key=self.parent_key,
            tools=self.tools,
            explain=self.explain,
            namespace=self.namespace,
            template_options=self.template_options,
        )

    def _max_tokens(self, n_ctx: int) -> int | None:
        """Above n_ctx: refused, unless `capped`."""
        if self.max_tokens is None:
            return n_ctx if self.until_full else None
        return min(self.max_tokens, n_ctx) if self.capped else self.max_tokens

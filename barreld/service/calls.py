"""What every front end (gRPC, HTTP) shares: the bounds on a completion's parameters, the model lookup, the
walk over the worker's events, and what a client is told of an error, so both refuse, count and cancel alike.

No gRPC or HTTP import here: each front end turns these values and errors into its own wire format.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from barreld.cache.errors import IndexWriteError
from barreld.cache.key import DEFAULT_NAMESPACE, Namespace
from barreld.engine.chat import Message
from barreld.engine.gbnf import check_gbnf
from barreld.engine.grammar import JSON_OBJECT, schema_grammar
from barreld.engine.registry import LoadedModel, ModelRegistry
from barreld.engine.reply import Echo, Finish, ReplyEvent, ReplyReader, reply_family
from barreld.engine.request import DEFAULT_MAX_TOKENS, CompletionParams, Done, Event, Failed, Started
from barreld.engine.sampling import SamplingParams, check_logprobs
from barreld.engine.tools import ToolSpec
from barreld.errors import BarrelError, FailedPrecondition, InvalidArgument
from barreld.names import MODEL_NAME_MAX, stops_problem

if TYPE_CHECKING:
    from barreld.service.metrics import Metrics
    from barreld.service.request import CallRequest

log = logging.getLogger("barreld.requests")

MAX_TEMPLATE = 256 << 10  # the largest templates models ship (tool-calling ones) are tens of KiB
SHOWN = 80


def client_error(exc: Exception) -> BarrelError | None:
    """What a client is told about `exc`: a domain error as it is, a failed index write as the operator's
    problem to fix; None for a bug (answered as an internal error, and logged)."""
    if isinstance(exc, IndexWriteError):
        return FailedPrecondition(f"{exc}; free space where the data dir lives, then retry")
    return exc if isinstance(exc, BarrelError) else None


def show(text: str) -> str:
    """A client's string as quoted in an error, cut short: a status message travels in gRPC metadata, which
    peers refuse beyond 16 KiB (the client would see RESOURCE_EXHAUSTED instead of our answer)."""
    return repr(text) if len(text) <= SHOWN else repr(text[:SHOWN]) + f"... ({len(text)} characters)"


def check_model_name(name: str) -> None:
    if len(name) > MODEL_NAME_MAX:
        raise InvalidArgument(f"bad model name {show(name)}: longer than {MODEL_NAME_MAX} characters")


def parse_key(text: str, what: str) -> bytes:
    if len(text) != 64:
        raise InvalidArgument(f"bad {what} {show(text)}: expected 64 hex digits")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise InvalidArgument(f"bad {what} {show(text)}: expected 64 hex digits") from None


def completion_params(
    *,
    n_ctx: int,
    prompt: bytes = b"",
    messages: tuple[Message, ...] = (),
    chat: bool = False,
    max_tokens: int | None = None,
    sampling: SamplingParams | None = None,
    logprobs: int | None = None,
    stop: Sequence[str] = (),
    parent_key: str = "",
    chat_template: str | None = None,
    tools: ToolSpec | None = None,
    explain: bool = False,
    namespace: Namespace = DEFAULT_NAMESPACE,
    template_options: tuple[tuple[str, object], ...] = (),
) -> CompletionParams:
    """A request's parameters checked against the model's n_ctx; InvalidArgument names the first bad one
    (the sampler's were checked when `sampling` was made)."""
    check_conversation(prompt, messages, chat, chat_template)
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not 1 <= max_tokens <= n_ctx:
        raise InvalidArgument(f"bad max_tokens {max_tokens}: expected 1..{n_ctx} (the model's n_ctx)")
    check_logprobs(logprobs)
    problem = stops_problem(stop)
    if problem:
        raise InvalidArgument(problem)
    stops = tuple(s.encode() for s in stop)
    return CompletionParams(
        prompt=prompt,
        chat=chat,
        messages=messages,
        chat_template=chat_template,
        max_tokens=max_tokens,
        sampling=sampling or SamplingParams(),
        logprobs=logprobs,
        stop=stops,
        parent_key=parse_key(parent_key, "parent key") if parent_key else None,
        tools=tools,
        explain=explain,
        namespace=namespace,
        template_options=check_template_options(template_options, bool(messages or chat)),
    )


TEMPLATE_OPTIONS_MAX = 4096  # bytes of JSON: a few switches, not a second prompt
RESERVED_OPTIONS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def check_template_options(options: tuple[tuple[str, object], ...], rendered: bool) -> tuple[tuple[str, object], ...]:
    """A request's variables for the chat template (`chat_template_kwargs`): names that are not the renderer's
    own, JSON values, small; only where a conversation is rendered, so a client never believes they applied."""
    if not options:
        return ()
    if not rendered:
        raise InvalidArgument("chat_template_kwargs apply only to messages or a chat prompt; send one of those")
    for name, _ in options:
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_OPTIONS:
            raise InvalidArgument(f"bad chat_template_kwargs name {show(str(name))}: a template variable other "
                                  f"than {', '.join(sorted(RESERVED_OPTIONS))}")
    if len(json.dumps(dict(options))) > TEMPLATE_OPTIONS_MAX:
        raise InvalidArgument(f"chat_template_kwargs is over {TEMPLATE_OPTIONS_MAX} bytes of JSON")
    return options


CACHE_SALT_MAX = 256


def check_cache_salt(salt: str) -> str:
    """A request's `cache_salt`: requests with different salts share nothing cached, within one tenant."""
    if len(salt) > CACHE_SALT_MAX or "\0" in salt:
        raise InvalidArgument(f"bad cache_salt: expected at most {CACHE_SALT_MAX} characters, no NUL")
    return salt


def constraint(grammar: str = "", json_schema: object = None, json_object: bool = False) -> str:
    """The GBNF a reply must match, from at most one of: GBNF text, a JSON schema, "any JSON object"; parsed
    safely (in a child process) before the daemon's llama.cpp sees it."""
    if sum((bool(grammar), json_schema is not None, json_object)) > 1:
        raise InvalidArgument("send at most one of a grammar, a JSON schema and a JSON object format")
    if json_object:
        grammar = schema_grammar(JSON_OBJECT)
    elif json_schema is not None:
        grammar = schema_grammar(json_schema)
    if grammar:
        check_gbnf(grammar)
    return grammar


def parse_schema(text: str) -> object:
    """A JSON schema sent as text (gRPC, the CLI)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"the JSON schema is not valid JSON: {str(exc)[:200]}") from None


def check_conversation(prompt: bytes, messages: tuple[Message, ...], chat: bool, template: str | None) -> None:
    """A prompt or messages, not both; a template only where something is rendered with it, so a client
    never believes it applied."""
    if messages and prompt:
        raise InvalidArgument("send either a prompt or messages, not both")
    if not messages and not prompt:
        raise InvalidArgument("the prompt is empty; pass some text")
    if template and not (messages or chat):
        raise InvalidArgument("a chat template applies only to messages or a chat prompt; send one of those")
    if template and len(template) > MAX_TEMPLATE:
        raise InvalidArgument(f"the chat template is {len(template)} characters; at most {MAX_TEMPLATE}")


Outcome = ReplyEvent | Exception
"""An event as a front end sees it: a failed request is its error."""

Deliver = Callable[["Call", Outcome], None]
"""Takes a call's events in order (the HTTP API passes them to its event loop): on the worker's thread, and the
Finish of a reply that called tools on a thread that checks it against its template."""

_settling = ThreadPoolExecutor(max_workers=1, thread_name_prefix="settle")  # prefix_kept renders, off the worker


def log_done(api: str, model: str, done: Done) -> None:
    """One line per ended request, as the operator reads a server's log: what the cache gave and what it cost."""
    c, t = done.cache, done.timings
    log.info("%s %s: %s, %d of %d prompt tokens restored%s, %d generated, ttft %.0f ms, total %.0f ms, %s",
             api, model, c.route, c.restored_tokens, done.prompt_tokens, f" from {c.tier}" if c.tier else "",
             done.completion_tokens, t.ttft, t.total, done.finish_reason)


class Call:
    """One completion in flight. Iterating yields its events (Started, text, reasoning) and ends with the
    Finish; a failure raises the worker's error. `cancel()` (the client went away) makes the worker stop
    generating and finish the request, so a thread blocked on the next event is released too.

    With `deliver`, each event is handed to it as it comes instead (not to be iterated then)."""

    def __init__(
        self,
        model: LoadedModel,
        params: CompletionParams,
        metrics: Metrics | None,
        api: str,
        deliver: Deliver | None = None,
        echo: Echo = Echo.TEXT,
    ) -> None:
        self.model = model
        self.metrics = metrics
        self.api = api
        self.finish: Finish | None = None
        family = reply_family(params.chat_template or model.worker.backend.chat_template, params)
        self.reader = ReplyReader(params, family, echo)
        self._ready: list[ReplyEvent] = []
        self.request = model.worker.submit(params, None if deliver is None else _Handoff(self, deliver))

    def outcome(self, ev: Event) -> list[Outcome]:
        """The front end's events for one of the worker's; counts the request once it has ended."""
        if isinstance(ev, Failed):
            if self.metrics is not None:
                self.metrics.failed(self.api, self.model.name)
            return [ev.error]
        if isinstance(ev, Started):
            return list(self.reader.read(ev, self.request.params.prompt))
        if not isinstance(ev, Done):
            return list(self.reader.read(ev))
        if self.metrics is not None:
            self.metrics.finished(self.api, self.model.name, ev, self.request.params.namespace.tenant)
        log_done(self.api, self.model.name, ev)
        worker = self.model.worker
        out = self.reader.finish(ev, self.request.params.prompt, worker.render,
                                 lambda text: worker.settle_as(self.request, text))
        self.finish = out[-1]  # type: ignore[assignment]
        return list(out)

    def next_event(self) -> ReplyEvent:
        """Blocks until the next event."""
        while not self._ready:
            for item in self.outcome(self.request.events.get()):
                if isinstance(item, Exception):
                    raise item
                self._ready.append(item)
        return self._ready.pop(0)

    def __iter__(self) -> Iterator[ReplyEvent]:
        while True:
            ev = self.next_event()
            yield ev
            if isinstance(ev, Finish):
                return

    def cancel(self) -> None:
        if self.finish is None:
            self.request.cancel()
            self.model.worker.wake()


class _Handoff:
    """The worker's event sink for a call with `deliver`. A Done that may need a template's render (a reply
    to a conversation with tools) is read on the settling thread, so the model's thread goes on decoding."""

    def __init__(self, call: Call, deliver: Deliver) -> None:
        self._call = call
        self._deliver = deliver

    def put(self, item: Event) -> None:
        if isinstance(item, Done) and self._call.reader.params.tools is not None:
            _settling.submit(self._hand, item)
        else:
            self._hand(item)

    def _hand(self, item: Event) -> None:
        try:
            outcomes = self._call.outcome(item)
        except Exception as exc:  # noqa: BLE001 - the front end answers it; the worker's thread goes on
            outcomes = [exc]
        for outcome in outcomes:
            self._deliver(self._call, outcome)


def start_call(
    registry: ModelRegistry,
    request: CallRequest,
    metrics: Metrics | None,
    api: str,
    deliver: Deliver | None = None,
) -> Call:
    """Finds the model (an empty name: the default, loaded if needed), builds the request's parameters against
    its n_ctx and submits them; a full queue raises ResourceExhausted here, before any event."""
    check_model_name(request.model)
    model = registry.get(request.model)
    return Call(model, request.params(model.options.n_ctx), metrics, api, deliver, request.echo)

"""OpenAI's request and reply shapes for /v1/completions and /v1/chat/completions, as pure functions over
dicts: the request body to a CompletionParams factory, the worker's events to reply documents and chunks.

Fields OpenAI has and Barrel does not use are ignored, as OpenAI ignores unknown ones; a field of the wrong
type is InvalidArgument (400). max_tokens defaults as OpenAI's does: 16 for completions, and no limit for chat
(generation ends at a stop or when the context is full). Temperature defaults to Barrel's 0 (greedy), not
OpenAI's 1. Beside OpenAI's sampling fields, llama.cpp's server's are read too (top_k, min_p, typical_p,
repeat_penalty, repeat_last_n, grammar); `response_format` and `grammar` constrain the reply.
"""

from __future__ import annotations

import codecs
import dataclasses
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from barreld.cache.key import DEFAULT_NAMESPACE, Namespace
from barreld.engine.chat import Message, messages_from
from barreld.engine.request import Alternative, CompletionParams, Done, Started, Token, TokenLogprob
from barreld.engine.sampling import KNOBS, SamplingParams
from barreld.engine.tools import CHOICES, CallStream, ToolCall, ToolSpec, split_calls, tool, tool_spec
from barreld.errors import InvalidArgument
from barreld.frontend.calls import check_cache_salt, completion_params, constraint

COMPLETIONS_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 0.0
DONE_LINE = b"data: [DONE]\n\n"
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


class Body:
    """A request body with typed reads: a present field of the wrong type is a 400 naming it."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.doc = doc

    def get(self, name: str, kind: type | tuple[type, ...], what: str) -> Any:
        value = self.doc.get(name)
        if value is None:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise InvalidArgument(f"{name} must be {what}, got {type(value).__name__}")
        return value


@dataclass(frozen=True)
class ApiRequest:
    """One completion request as Barrel runs it."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    prompt: bytes
    messages: tuple[Message, ...]
    max_tokens: int | None
    sampling: SamplingParams  # without its grammar, which `params` adds off the event loop
    constraint: tuple[str, object, bool]  # GBNF, JSON schema, any JSON object: calls.constraint's arguments
    logprobs: int | None  # None: not asked for; N: N alternatives per token
    stop: tuple[str, ...]
    parent_key: str
    tools: ToolSpec | None = None
    capped: bool = False  # max_tokens above the model's n_ctx is cut to it, not refused
    cache_salt: str = ""  # separates the caller's requests further within its tenant (vLLM's name)
    namespace: Namespace = DEFAULT_NAMESPACE  # the tenant and salt, set once the key is known

    def params(self, n_ctx: int) -> CompletionParams:
        """The worker's parameters, checked by the same rules as gRPC's against the model's n_ctx. A grammar is
        parsed here, on the call's own thread: a client's GBNF is parsed in a child process first."""
        return completion_params(
            n_ctx=n_ctx,
            prompt=self.prompt,
            messages=self.messages,
            max_tokens=self._max_tokens(n_ctx),
            sampling=dataclasses.replace(self.sampling, grammar=constraint(*self.constraint)),
            logprobs=self.logprobs,
            stop=self.stop,
            parent_key=self.parent_key,
            tools=self.tools,
            namespace=self.namespace,
        )


    def _max_tokens(self, n_ctx: int) -> int:
        """None: until a stop or the context is full; above n_ctx: refused, unless `capped`."""
        if self.max_tokens is None:
            return n_ctx
        return min(self.max_tokens, n_ctx) if self.capped else self.max_tokens


def parse_request(doc: Mapping[str, Any], chat: bool) -> ApiRequest:
    body = Body(doc)
    if body.get("n", int, "an integer") not in (None, 1):
        raise InvalidArgument("n must be 1: Barrel returns one choice per request")
    stream = bool(body.get("stream", bool, "true or false"))
    options = body.get("stream_options", dict, "an object")
    if options is not None and not stream:
        raise InvalidArgument("stream_options is only allowed with stream: true")
    include_usage = Body(options or {}).get("include_usage", bool, "true or false")
    max_tokens = body.get("max_tokens", int, "an integer")
    if chat:
        newer = body.get("max_completion_tokens", int, "an integer")
        max_tokens = max_tokens if newer is None else newer
    elif max_tokens is None:
        max_tokens = COMPLETIONS_MAX_TOKENS
    return ApiRequest(
        chat=chat,
        model=body.get("model", str, "a string") or "",
        stream=stream,
        include_usage=bool(include_usage),
        prompt=b"" if chat else _prompt(body),
        messages=_messages(body) if chat else (),
        max_tokens=max_tokens,
        sampling=sampling(body),
        constraint=(body.get("grammar", str, "a string of GBNF") or "", *_response_format(body)),
        logprobs=_logprobs(body, chat),
        stop=stop_strings(body),
        parent_key=body.get("parent_key", str, "a string of 64 hex digits") or "",
        tools=_tools(body) if chat else None,
        cache_salt=cache_salt(body),
    )


def cache_salt(body: Body) -> str:
    return check_cache_salt(body.get("cache_salt", str, "a string") or "")


def _tools(body: Body) -> ToolSpec | None:
    """OpenAI's tools ({type: function, function: {name, description, parameters}}), tool_choice and
    parallel_tool_calls."""
    tools = []
    for i, t in enumerate(body.get("tools", list, "a list of tools") or []):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict):
            raise InvalidArgument(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}")
        tools.append(tool(f.get("name"), f.get("description"), f.get("parameters"), f"tools[{i}].function"))
    parallel = body.get("parallel_tool_calls", bool, "true or false")
    return tool_spec(tools, _tool_choice(body), parallel is not False)


def _tool_choice(body: Body) -> str:
    choice = body.get("tool_choice", (str, dict), "auto, none, required or {type: function, function: {name}}")
    if choice is None or choice in CHOICES:
        return choice or "auto"
    named = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(named, dict) or not isinstance(named.get("name"), str):
        raise InvalidArgument("tool_choice must be auto, none, required or {type: function, function: {name}}")
    return named["name"]


NUMBER = ((int, float), "a number")
WHOLE = (int, "an integer")
SAMPLING_FIELDS = {name: WHOLE if kind is int else NUMBER for name, kind in KNOBS.items()}


def sampling(body: Body) -> SamplingParams:
    """The sampler's settings under OpenAI's names and llama.cpp's server's; absent ones at their defaults."""
    temperature = body.get("temperature", (int, float), "a number")
    given = {name: body.get(name, *kind) for name, kind in SAMPLING_FIELDS.items()}
    return SamplingParams(
        temperature=DEFAULT_TEMPERATURE if temperature is None else float(temperature),
        seed=body.get("seed", int, "an integer"),
        logit_bias=_logit_bias(body),
        **{name: value for name, value in given.items() if value is not None},
    )


def _logit_bias(body: Body) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias", dict, "an object mapping token ids to numbers") or {}
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise InvalidArgument(f"bad logit_bias key {key[:40]!r}: expected a token id (a whole number)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(f"bad logit_bias[{key}]: expected a number from -100 to 100")
        out.append((int(key), float(value)))
    return tuple(out)


def _response_format(body: Body) -> tuple[object, bool]:
    """(the JSON schema, or None; whether any JSON object will do) from OpenAI's response_format."""
    fmt = body.get("response_format", dict, "an object")
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return None, False
    if kind == "json_object":
        return None, True
    if kind != "json_schema":
        raise InvalidArgument(f"bad response_format type {str(kind)[:40]!r}: expected text, json_object or json_schema")
    spec = Body(fmt).get("json_schema", dict, "an object {name, schema, strict}")
    schema = None if spec is None else spec.get("schema")
    if schema is None:
        raise InvalidArgument("response_format.json_schema.schema is missing; send the JSON Schema there")
    return schema, False


def _logprobs(body: Body, chat: bool) -> int | None:
    """Chat: `logprobs` true, and `top_logprobs` alternatives; completions: `logprobs` alternatives."""
    if not chat:
        return body.get("logprobs", int, "an integer (alternatives per token)")
    wanted = body.get("logprobs", bool, "true or false")
    top = body.get("top_logprobs", int, "an integer")
    if top is not None and not wanted:
        raise InvalidArgument("top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _prompt(body: Body) -> bytes:
    prompt = body.get("prompt", (str, list), "a string")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise InvalidArgument("prompt must be a string (or a list of exactly one string)")
        prompt = prompt[0]
    if not prompt:
        raise InvalidArgument("prompt is missing or empty; send some text")
    return utf8(prompt, "prompt")


def utf8(text: str, what: str) -> bytes:
    """JSON can spell a lone UTF-16 surrogate (\\ud800), which no UTF-8 text holds: a 400, not a crash."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what} holds an unpaired surrogate (\\ud800-\\udfff); send valid Unicode") from None


def stop_strings(body: Body, name: str = "stop") -> tuple[str, ...]:
    stop = body.get(name, (str, list), "a string or a list of strings")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise InvalidArgument(f"{name} must be a string or a list of strings")
    for s in stops:
        utf8(s, name)
    return stops


def _messages(body: Body) -> tuple[Message, ...]:
    """OpenAI's messages, with content given as a list of text parts joined into one string."""
    messages = body.get("messages", list, "a list of messages")
    if messages is None:
        raise InvalidArgument("messages is missing; send a list of {role, content} objects")
    plain = []
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            role = m.get("role")
            role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
            m = {**m, "role": role, "content": _content(i, m.get("content"))}
        plain.append(m)
    return messages_from(plain)


def _content(i: int, content: object) -> object:
    if isinstance(content, str):
        utf8(content, f"messages[{i}].content")
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidArgument(f"messages[{i}].content: only text parts ({{type: text, text}}) are supported")
        texts.append(part["text"])
    return _content(i, "".join(texts))


def usage_doc(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cache.restored_tokens},
    }


def barrel_doc(done: Done) -> dict[str, Any]:
    """Barrel's own report beside `usage`: the lookup route, tier and keys (pass `key` back as
    `parent_key`), and where the time went."""
    c = done.cache
    return {
        "cache": {
            "path": c.route.value,
            "restored_tokens": c.restored_tokens,
            "prefilled_tokens": c.prefilled_tokens,
            "tier": c.tier,
            **({} if c.divergence is None else {"divergence": c.divergence.doc()}),
        },
        "key": done.key.hex(),
        "prompt_key": done.prompt_key.hex(),
        "timings_ms": dataclasses.asdict(done.timings),
        **({} if done.prefix_kept is None else {"prefix_kept": done.prefix_kept}),
    }


def _call_doc(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _token_doc(a: Alternative) -> dict[str, Any]:
    return {"token": a.text.decode("utf-8", "replace"), "logprob": a.logprob, "bytes": list(a.text)}


class Reply:
    """Shapes one request's events as OpenAI replies: one document, or SSE chunks as tokens arrive.

    Tokens are bytes and may split a UTF-8 character; an incremental decoder holds the part until the
    rest arrives, so every chunk is valid text and the chunks join to the whole reply.
    """

    def __init__(self, req: ApiRequest, model: str) -> None:
        self.req = req
        self.model = model
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.object = "chat.completion" if req.chat else "text_completion"
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._calls = CallStream(req.tools) if req.chat and req.tools is not None else None
        self._offset = 0  # characters of text before the next token, for text_offset

    def document(self, done: Done) -> dict[str, Any]:
        text = done.text.decode("utf-8", "replace")
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(done.logprobs),
                                  "finish_reason": done.finish_reason}
        if self.req.chat:
            choice["message"] = self._message(text, choice)
        else:
            choice["text"] = text
        return {**self._head(self.object), "choices": [choice], "usage": usage_doc(done), "barrel": barrel_doc(done)}

    def _message(self, text: str, choice: dict[str, Any]) -> dict[str, Any]:
        """The assistant's message; calls found in the reply become `tool_calls`."""
        content, calls = split_calls(text, self.req.tools) if self.req.tools is not None else (text, ())
        if not calls:
            return {"role": "assistant", "content": text}
        choice["finish_reason"] = "tool_calls"
        return {"role": "assistant", "content": content or None, "tool_calls": [_call_doc(c) for c in calls]}

    def chunks(self, ev: Started | Token | Done) -> list[dict[str, Any]]:
        """The SSE chunks one event becomes (none for a token that only begins a character, or text held
        back because it may begin a tool call)."""
        if isinstance(ev, Started):
            return [self._chunk({"role": "assistant", "content": ""})] if self.req.chat else []
        if isinstance(ev, Token):
            text = self._decoder.decode(ev.text)
            text = self._calls.feed(text) if self._calls is not None else text
            return [self._chunk(self._delta(text), logprobs=ev.logprobs)] if text or ev.logprobs else []
        rest = self._decoder.decode(b"", final=True)
        calls: tuple[ToolCall, ...] = ()
        if self._calls is not None:
            shown = self._calls.feed(rest)
            tail, calls = self._calls.finish()
            rest = shown + tail
        out = [self._chunk(self._delta(rest))] if rest else []
        for i, c in enumerate(calls):  # the id and name first, then the arguments
            head = {**_call_doc(c), "index": i, "function": {"name": c.name, "arguments": ""}}
            out.append(self._chunk({"tool_calls": [head]}))
            out.append(self._chunk({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]}))
        finish = "tool_calls" if calls else ev.finish_reason
        out.append(self._chunk({} if self.req.chat else {"text": ""}, finish))
        if self.req.include_usage:
            out.append({**self._head(), "choices": [], "usage": usage_doc(ev)})
        out[-1]["barrel"] = barrel_doc(ev)
        return out

    def _logprobs(self, entries: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        """OpenAI's logprobs object: chat's `content` list, or the completions API's parallel lists."""
        if self.req.logprobs is None:
            return None
        if self.req.chat:
            return {"content": [{**_token_doc(e.chosen), "top_logprobs": [_token_doc(a) for a in e.top]}
                                for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.chosen.text.decode("utf-8", "replace"))
        return {
            "tokens": [e.chosen.text.decode("utf-8", "replace") for e in entries],
            "token_logprobs": [e.chosen.logprob for e in entries],
            "top_logprobs": [{a.text.decode("utf-8", "replace"): a.logprob for a in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _delta(self, text: str) -> dict[str, str]:
        return {"content": text} if self.req.chat else {"text": text}

    def _head(self, kind: str | None = None) -> dict[str, Any]:
        kind = kind or ("chat.completion.chunk" if self.req.chat else "text_completion")
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        if self.req.stream and self.req.include_usage:
            head["usage"] = None  # OpenAI's chunks say "no usage yet" until the last one
        return head

    def _chunk(
        self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: tuple[TokenLogprob, ...] = ()
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(logprobs) if logprobs else None,
                                  "finish_reason": finish_reason}
        if self.req.chat:
            choice["delta"] = delta
        else:
            choice.update(delta)
        return {**self._head(), "choices": [choice]}

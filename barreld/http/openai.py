"""OpenAI's request and reply shapes for /v1/completions and /v1/chat/completions, as pure functions over
dicts: the request body to a CompletionParams factory, the worker's events to reply documents and chunks.

Fields OpenAI has and Barrel does not use are ignored, as OpenAI ignores unknown ones; a field of the wrong
type is InvalidArgument (400). max_tokens defaults as OpenAI's does: 16 for completions, and no limit for chat
(generation ends at a stop or when the context is full). Temperature defaults to Barrel's 0, not OpenAI's 1:
the sampler has no nucleus cut, so at 1 it samples the whole tail of the distribution, and greedy replies are
the ones a warm start reproduces byte for byte.
"""

from __future__ import annotations

import codecs
import dataclasses
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from barreld.engine.chat import Message, messages_from
from barreld.engine.request import CompletionParams, Done, Started, Token
from barreld.errors import InvalidArgument
from barreld.server.frontend import completion_params

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
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    parent_key: str

    def params(self, n_ctx: int) -> CompletionParams:
        """The worker's parameters, checked by the same rules as gRPC's against the model's n_ctx."""
        return completion_params(
            n_ctx=n_ctx,
            prompt=self.prompt,
            messages=self.messages,
            max_tokens=n_ctx if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            stop=self.stop,
            parent_key=self.parent_key,
        )


def parse_request(doc: Mapping[str, Any], chat: bool) -> ApiRequest:
    body = Body(doc)
    if body.get("n", int, "an integer") not in (None, 1):
        raise InvalidArgument("n must be 1: Barrel returns one choice per request")
    top_p = body.get("top_p", (int, float), "a number")
    if top_p not in (None, 1):
        raise InvalidArgument("top_p must be 1: Barrel samples from the whole distribution (use temperature)")
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
    temperature = body.get("temperature", (int, float), "a number")
    return ApiRequest(
        chat=chat,
        model=body.get("model", str, "a string") or "",
        stream=stream,
        include_usage=bool(include_usage),
        prompt=b"" if chat else _prompt(body),
        messages=_messages(body) if chat else (),
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if temperature is None else float(temperature),
        seed=body.get("seed", int, "an integer"),
        stop=_stop(body),
        parent_key=body.get("parent_key", str, "a string of 64 hex digits") or "",
    )


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


def _stop(body: Body) -> tuple[str, ...]:
    stop = body.get("stop", (str, list), "a string or a list of strings")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop must be a string or a list of strings")
    for s in stops:
        utf8(s, "stop")
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
        },
        "key": done.key.hex(),
        "prompt_key": done.prompt_key.hex(),
        "timings_ms": dataclasses.asdict(done.timings),
    }


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

    def document(self, done: Done) -> dict[str, Any]:
        text = done.text.decode("utf-8", "replace")
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": done.finish_reason}
        if self.req.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(self.object), "choices": [choice], "usage": usage_doc(done), "barrel": barrel_doc(done)}

    def chunks(self, ev: Started | Token | Done) -> list[dict[str, Any]]:
        """The SSE chunks one event becomes (none for a token that only begins a character)."""
        if isinstance(ev, Started):
            return [self._chunk({"role": "assistant", "content": ""})] if self.req.chat else []
        if isinstance(ev, Token):
            text = self._decoder.decode(ev.text)
            return [self._chunk(self._delta(text))] if text else []
        rest = self._decoder.decode(b"", final=True)
        out = [self._chunk(self._delta(rest))] if rest else []
        out.append(self._chunk({} if self.req.chat else {"text": ""}, ev.finish_reason))
        if self.req.include_usage:
            out.append({**self._head(), "choices": [], "usage": usage_doc(ev)})
        out[-1]["barrel"] = barrel_doc(ev)
        return out

    def _delta(self, text: str) -> dict[str, str]:
        return {"content": text} if self.req.chat else {"text": text}

    def _head(self, kind: str | None = None) -> dict[str, Any]:
        kind = kind or ("chat.completion.chunk" if self.req.chat else "text_completion")
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        if self.req.stream and self.req.include_usage:
            head["usage"] = None  # OpenAI's chunks say "no usage yet" until the last one
        return head

    def _chunk(self, delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.req.chat:
            choice["delta"] = delta
        else:
            choice.update(delta)
        return {**self._head(), "choices": [choice]}

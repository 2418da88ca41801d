"""OpenAI's chat and completions APIs (/v1/chat/completions, /v1/completions): the request body to the one
request type, the engine's reply events to OpenAI's documents and SSE chunks.

max_tokens defaults as OpenAI's does: 16 for completions, and no limit for chat (generation ends at a stop or
when the context is full). Temperature defaults to Barrel's 0 (greedy), not OpenAI's 1. Beside OpenAI's
sampling fields, llama.cpp's server's are read too (top_k, min_p, typical_p, repeat_penalty, repeat_last_n,
grammar); `response_format` and `grammar` constrain the reply.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from barreld.engine.chat import Message, messages_from
from barreld.engine.registry import LoadedModel
from barreld.engine.reply import Finish, ReasoningDelta, ReplyEvent, TextDelta
from barreld.engine.request import Alternative, Started, TokenLogprob
from barreld.engine.tools import CHOICES, SchemaChecks, ToolCall, ToolSpec, tool_spec
from barreld.errors import InvalidArgument
from barreld.http.body import Body, cache_salt, function_tool, sampling, stop_strings, template_options, utf8
from barreld.http.errors import ApiError
from barreld.http.report import barrel_doc, system_fingerprint
from barreld.http.streaming import sse_line
from barreld.service.request import CallRequest

COMPLETIONS_MAX_TOKENS = 16
DONE_LINE = b"data: [DONE]\n\n"
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


@dataclass(frozen=True)
class OpenAIRequest:
    """A chat or completions request: the call, and what shapes its reply."""

    call: CallRequest
    chat: bool
    include_usage: bool


def parse_request(doc: Mapping[str, Any], chat: bool, checks: SchemaChecks | None = None) -> OpenAIRequest:
    body = Body(doc, checks)
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
    call = CallRequest(
        model=body.get("model", str, "a string") or "",
        stream=stream,
        prompt=b"" if chat else _prompt(body),
        messages=_messages(body) if chat else (),
        max_tokens=max_tokens,
        until_full=True,
        sampling=sampling(body),
        constraint=(body.get("grammar", str, "a string of GBNF") or "", *_response_format(body)),
        logprobs=_logprobs(body, chat),
        stop=stop_strings(body),
        parent_key=body.get("parent_key", str, "a string of 64 hex digits") or "",
        tools=_tools(body) if chat else None,
        cache_salt=cache_salt(body),
        template_options=template_options(body, reasoning_effort=body.get("reasoning_effort", str, "a string"))
        if chat else (),
    )
    return OpenAIRequest(call, chat, bool(include_usage))


def _tools(body: Body) -> ToolSpec | None:
    """OpenAI's tools ({type: function, function: {name, description, parameters}}), tool_choice and
    parallel_tool_calls."""
    tools = []
    for i, t in enumerate(body.get("tools", list, "a list of tools") or []):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict):
            raise InvalidArgument(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}")
        tools.append(function_tool(f, f"tools[{i}].function", body.checks))
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


def usage_doc(finish: Finish) -> dict[str, Any]:
    done = finish.done
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cache.restored_tokens},
        "completion_tokens_details": {"reasoning_tokens": finish.reasoning_tokens},
    }


def _call_doc(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _token_doc(a: Alternative) -> dict[str, Any]:
    return {"token": a.text.decode("utf-8", "replace"), "logprob": a.logprob, "bytes": list(a.text)}


class Reply:
    """Shapes one request's reply events as OpenAI replies: one document, or SSE chunks as they arrive."""

    ping = b": keep-alive\n\n"
    tail = DONE_LINE

    def __init__(self, req: OpenAIRequest, model: LoadedModel) -> None:
        self.req = req
        self.model = model.name
        self.fingerprint = system_fingerprint(model)
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.object = "chat.completion" if req.chat else "text_completion"
        self._offset = 0  # characters of text before the next token, for text_offset

    def document(self, finish: Finish) -> dict[str, Any]:
        done = finish.done
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(done.logprobs),
                                  "finish_reason": finish.reason.value}
        if self.req.chat:
            choice["message"] = self._message(finish)
        else:
            choice["text"] = done.text.decode("utf-8", "replace")
        return {**self._head(self.object), "choices": [choice], "usage": usage_doc(finish),
                "barrel": barrel_doc(finish)}

    @staticmethod
    def _message(finish: Finish) -> dict[str, Any]:
        """The assistant's message; calls the engine found become `tool_calls`, reasoning `reasoning_content`."""
        message: dict[str, Any] = {"role": "assistant", "content": finish.content}
        if finish.reasoning:
            message["reasoning_content"] = finish.reasoning
        if finish.calls:
            message.update(content=finish.content or None, tool_calls=[_call_doc(c) for c in finish.calls])
        return message

    def frames(self, ev: ReplyEvent) -> list[bytes]:
        return [sse_line(chunk) for chunk in self.chunks(ev)]

    @staticmethod
    def error(error: ApiError) -> bytes:
        return sse_line(error.doc())

    def chunks(self, ev: ReplyEvent) -> list[dict[str, Any]]:
        """The SSE chunks one event becomes (none for a token whose text is held back)."""
        if isinstance(ev, Started):
            return [self._chunk({"role": "assistant", "content": ""})] if self.req.chat else []
        if isinstance(ev, TextDelta):
            return [self._chunk(self._delta(ev.text), logprobs=ev.logprobs)] if ev.text or ev.logprobs else []
        if isinstance(ev, ReasoningDelta):
            return [self._chunk({"reasoning_content": ev.text})] if self.req.chat else []
        out = []
        for i, c in enumerate(ev.calls):  # the id and name first, then the arguments
            head = {**_call_doc(c), "index": i, "function": {"name": c.name, "arguments": ""}}
            out.append(self._chunk({"tool_calls": [head]}))
            out.append(self._chunk({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]}))
        out.append(self._chunk({} if self.req.chat else {"text": ""}, ev.reason.value))
        if self.req.include_usage:
            out.append({**self._head(), "choices": [], "usage": usage_doc(ev)})
        out[-1]["barrel"] = barrel_doc(ev)
        return out
    def _logprobs(self, entries: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        """OpenAI's logprobs object: chat's `content` list, or the completions API's parallel lists."""
        if self.req.call.logprobs is None:
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
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}
        if self.req.call.stream and self.req.include_usage:
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

"""Anthropic's Messages API shapes (/v1/messages, /v1/messages/count_tokens) as pure functions over dicts: the
request body to the same ApiRequest the OpenAI routes run, the worker's events to a message document or to
Anthropic's SSE events. Tool calls are found by the engine's parser (barreld.engine.tools), as for OpenAI.

Fields that steer Anthropic's own service (cache_control, thinking, context_management, output_config,
metadata, service_tier) are accepted and ignored: Barrel caches every prompt. `max_tokens` above the context
is a cap. `usage.input_tokens` counts the tokens prefilled; `cache_read_input_tokens` those restored. Barrel's own
report (`barrel`: route, tier, keys, timings, why a miss missed) rides beside, as on the OpenAI routes.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

from barreld.engine.chat import MAX_MESSAGES, Message, check_tool_history
from barreld.engine.registry import LoadedModel
from barreld.engine.reply import Echo, Finish, ReasoningDelta, ReplyEvent, TextDelta
from barreld.engine.request import Started
from barreld.engine.tools import SchemaChecks, ToolCall, ToolSpec, tool, tool_spec
from barreld.errors import InvalidArgument
from barreld.http.body import Body, cache_salt, sampling, stop_strings, template_options, utf8
from barreld.http.errors import ApiError
from barreld.http.report import barrel_doc
from barreld.service.request import CallRequest

ROLES = ("user", "assistant", "system")  # Claude Code sends system turns inside messages
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and {type: tool, name}: that tool
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")
IGNORED_BLOCKS = ("thinking", "redacted_thinking")
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
# An HTTP status -> Anthropic's error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error"}


def error_doc(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def parse_messages(doc: Mapping[str, Any], counting: bool = False, checks: SchemaChecks | None = None
                   ) -> CallRequest:
    """A Messages request as Barrel runs it; count_tokens sends no max_tokens."""
    body = Body(doc, checks)
    max_tokens = body.get("max_tokens", int, "an integer")
    if max_tokens is None and not counting:
        raise InvalidArgument("max_tokens is missing; send the most tokens the reply may have")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be at least 1, got {max_tokens}")
    model = body.get("model", str, "a string")
    if not model:
        raise InvalidArgument("model is missing; send a model's name or one of its aliases")
    return CallRequest(
        model=model,
        stream=bool(body.get("stream", bool, "true or false")),
        messages=messages_of(body),
        max_tokens=max_tokens,
        until_full=True,
        capped=True,
        sampling=sampling(body),
        constraint=(body.get("grammar", str, "a string of GBNF") or "", None, False),
        stop=stop_strings(body, "stop_sequences"),
        tools=tools_of(body),
        echo=Echo.OBJECT,
        cache_salt=cache_salt(body),
        template_options=template_options(body, enable_thinking=_thinking(body)),
    )


def _thinking(body: Body) -> bool | None:
    """`thinking` ({type: enabled | adaptive | disabled}) onto the templates' switch; None when not sent."""
    thinking = body.get("thinking", dict, "an object {type, budget_tokens}")
    return None if thinking is None else thinking.get("type") != "disabled"


def messages_of(body: Body) -> tuple[Message, ...]:
    """`system` (a string or text blocks), then each message's blocks as Barrel's messages: a user turn's
    tool_result blocks become tool messages, an assistant's tool_use blocks its tool calls."""
    items = body.get("messages", list, "a list of messages")
    if not items:
        raise InvalidArgument("messages is missing or empty; send at least one message")
    if len(items) > MAX_MESSAGES:
        raise InvalidArgument(f"too many messages; at most {MAX_MESSAGES}")
    system = doc_text(body.doc.get("system"), "system") if body.doc.get("system") is not None else ""
    out = [Message("system", system)] if system else []
    for i, m in enumerate(items):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidArgument(f"messages[{i}] must be {{role: user or assistant, content}}")
        out += _turn(f"messages[{i}]", m["role"], m.get("content"))
    check_tool_history(out)
    return tuple(out)


def _turn(where: str, role: str, content: object) -> list[Message]:
    if isinstance(content, str):
        return [Message(role, utf8(content, f"{where}.content").decode())]
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}.content must be a string or a list of content blocks")
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(doc_text([block], at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(Message("tool", doc_text(block.get("content") or "", f"{at}.content"), (),
                                   _string(block, "tool_use_id", at)))
        elif kind in UNSUPPORTED_BLOCKS:
            raise InvalidArgument(f"{at}: {kind} blocks are not supported; Barrel serves text-only models")
        elif kind not in IGNORED_BLOCKS:
            raise InvalidArgument(f"{at}: a {role} message cannot hold a block of type {str(kind)[:40]!r}")
    turn = [Message(role, "\n\n".join(texts), tuple(calls))] if texts or calls or not results else []
    return results + turn


def _tool_use(block: dict, at: str) -> ToolCall:
    given = block.get("input")
    if not isinstance(given, dict):
        raise InvalidArgument(f"{at}.input must be an object")
    return ToolCall(_string(block, "id", at), _string(block, "name", at), _arguments(given))


def _arguments(given: dict) -> str:
    return json.dumps(given, ensure_ascii=False)


def _string(block: dict, name: str, at: str) -> str:
    value = block.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{at}.{name} must be a non-empty string")
    return value


def doc_text(value: object, where: str) -> str:
    """A string, or text blocks joined by blank lines (their cache_control ignored)."""
    if isinstance(value, str):
        return utf8(value, where).decode()
    if not isinstance(value, list):
        raise InvalidArgument(f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in UNSUPPORTED_BLOCKS:
            raise InvalidArgument(f"{where}[{j}]: {kind} blocks are not supported; Barrel serves text-only models")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise InvalidArgument(f"{where}[{j}] must be a text block {{type: text, text}}")
        texts.append(utf8(block["text"], f"{where}[{j}].text").decode())
    return "\n\n".join(texts)


def tools_of(body: Body) -> ToolSpec | None:
    """Anthropic's tools ({name, description, input_schema}) and tool_choice."""
    tools = []
    for i, t in enumerate(body.get("tools", list, "a list of tools") or []):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or "input_schema" not in t:
            raise InvalidArgument(f"tools[{i}] must be a custom tool {{name, description, input_schema}}")
        tools.append(tool(t.get("name"), t.get("description"), t["input_schema"], f"tools[{i}]", body.checks))
    choice = body.get("tool_choice", dict, "an object {type: auto, any, tool or none}") or {"type": "auto"}
    kind = choice.get("type")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidArgument("tool_choice {type: tool} needs the tool's name")
    elif kind in CHOICES:
        name = CHOICES[kind]
    else:
        raise InvalidArgument(f"tool_choice.type must be auto, any, tool or none, got {str(kind)[:40]!r}")
    return tool_spec(tools, name, choice.get("disable_parallel_tool_use") is not True)


def usage(prompt_tokens: int, restored: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens - restored, "output_tokens": output_tokens,
            "cache_read_input_tokens": restored, "cache_creation_input_tokens": 0}


def event(name: str, doc: dict[str, Any]) -> bytes:
    data = json.dumps({"type": name, **doc}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()


def _tool_block(c: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}


class MessagesReply:
    """Shapes one request's reply events as Anthropic's message, whole or as SSE events: a thinking block while
    the model reasons, a text block while text comes, then one tool_use block per call (its input as one
    input_json_delta)."""

    ping = PING
    tail = b""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model.name
        self.id = "msg_" + secrets.token_hex(12)
        self._blocks = 0  # content blocks opened
        self._open: str | None = None  # the kind of the block open now

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    @staticmethod
    def stop(finish: Finish) -> dict[str, Any]:
        done = finish.done
        if finish.calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if done.stop:
            return {"stop_reason": "stop_sequence", "stop_sequence": done.stop.decode("utf-8", "replace")}
        return {"stop_reason": "max_tokens" if done.finish_reason == "length" else "end_turn", "stop_sequence": None}

    def document(self, finish: Finish) -> dict[str, Any]:
        done = finish.done
        thinking = [{"type": "thinking", "thinking": finish.reasoning, "signature": ""}] if finish.reasoning else []
        text = [{"type": "text", "text": finish.content}] if finish.content or not finish.calls else []
        return {**self._head(), "content": thinking + text + [_tool_block(c) for c in finish.calls],
                **self.stop(finish), "usage": usage(done.prompt_tokens, done.cache.restored_tokens,
                                                     done.completion_tokens), "barrel": barrel_doc(finish)}

    @staticmethod
    def error(error: ApiError) -> bytes:
        return event("error", {"error": error_doc(error.status, error.message)["error"]})

    def frames(self, ev: ReplyEvent) -> list[bytes]:
        if isinstance(ev, Started):
            message = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": usage(ev.prompt_tokens, ev.cache.restored_tokens, 0)}
            return [event("message_start", {"message": message})]
        if isinstance(ev, TextDelta):
            return self._delta("text", ev.text)
        if isinstance(ev, ReasoningDelta):
            return self._delta("thinking", ev.text)
        return self._end(ev)

    def _delta(self, kind: str, text: str) -> list[bytes]:
        """A text or thinking delta, in a block of its kind (the open one, or a new one after closing it)."""
        if not text:
            return []
        out = []
        if self._open != kind:
            out += self._close()
            self._open = kind
            block = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}  # as the whole message's block has it
            out.append(event("content_block_start", {"index": self._blocks, "content_block": block}))
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        out.append(event("content_block_delta", {"index": self._blocks, "delta": delta}))
        return out

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        self._blocks += 1
        return [event("content_block_stop", {"index": self._blocks - 1})]

    def _end(self, finish: Finish) -> list[bytes]:
        out = self._close()
        for c in finish.calls:
            i, self._blocks = self._blocks, self._blocks + 1
            out.append(event("content_block_start", {"index": i, "content_block": {**_tool_block(c), "input": {}}}))
            out.append(event("content_block_delta", {"index": i, "delta": {"type": "input_json_delta",
                                                                            "partial_json": c.arguments}}))
            out.append(event("content_block_stop", {"index": i}))
        done = finish.done
        counts = usage(done.prompt_tokens, done.cache.restored_tokens, done.completion_tokens)
        out.append(event("message_delta", {"delta": self.stop(finish), "usage": counts, "barrel": barrel_doc(finish)}))
        out.append(event("message_stop", {}))
        return out

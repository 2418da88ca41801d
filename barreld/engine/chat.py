"""Conversations to prompt bytes: the one renderer that gRPC's `messages`, `complete --chat` and the HTTP
chat endpoint all use, so the same conversation renders to the same bytes (and the same cache keys)
whichever way it arrives.

Templates are the model's own Jinja chat template (the GGUF's `tokenizer.chat_template`), run in Jinja's
immutable sandbox: a template comes from a file or a client, and must not reach anything else.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from jinja2.ext import Extension

from barreld.engine import calllayout
from barreld.engine.callformats import GENERIC as GENERIC_FAMILY
from barreld.engine.callformats import family_of
from barreld.engine.tools import GENERIC, ToolCall, ToolSpec, generic_description, knows_tools, template_tools
from barreld.errors import FailedPrecondition, InvalidArgument

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 4096


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str = ""  # a tool message: the call it answers


def messages_from(items: Iterable[object]) -> tuple[Message, ...]:
    """Messages from OpenAI-shaped dicts ({"role", "content"}, other keys ignored); InvalidArgument naming
    the first bad one. Shared by every front end, so each refuses exactly the same conversations."""
    out: list[Message] = []
    for i, item in enumerate(items):
        if i >= MAX_MESSAGES:
            raise InvalidArgument(f"too many messages; at most {MAX_MESSAGES}")
        if not isinstance(item, Mapping):
            raise InvalidArgument(f"messages[{i}] is not an object with a role and a content")
        out.append(_message(i, item))
    if not out:
        raise InvalidArgument("messages is empty; send at least one message")
    check_tool_history(out)
    return tuple(out)


def _message(i: int, item: Mapping) -> Message:
    calls = _tool_calls(i, item.get("tool_calls"))
    missing = [key for key in ("role", "content") if key not in item and not (key == "content" and calls)]
    if missing:
        raise InvalidArgument(f"messages[{i}] has no {' and no '.join(missing)}")
    role, content = item["role"], item.get("content")
    if role not in ROLES:
        shown = repr(role)[:40]
        raise InvalidArgument(f"messages[{i}].role {shown} is not one of {', '.join(ROLES)}")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise InvalidArgument(f"messages[{i}].content must be a string, got {type(content).__name__}")
    if calls and role != "assistant":
        raise InvalidArgument(f"messages[{i}] has tool_calls, which only an assistant message may have")
    call_id = item.get("tool_call_id", "") if role == "tool" else ""
    if not isinstance(call_id, str):
        raise InvalidArgument(f"messages[{i}].tool_call_id must be a string")
    return Message(role, content, calls, call_id)


def _tool_calls(i: int, items: object) -> tuple[ToolCall, ...]:
    """OpenAI's {id, type: function, function: {name, arguments}}; arguments a JSON object as text."""
    if items is None:
        return ()
    if not isinstance(items, list):
        raise InvalidArgument(f"messages[{i}].tool_calls must be a list")
    calls = []
    for j, c in enumerate(items):
        f = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(f, Mapping) or not all(isinstance(x, str) for x in (c.get("id"), f.get("name"))):
            raise InvalidArgument(f"messages[{i}].tool_calls[{j}] must be {{id, type, function: {{name, arguments}}}}")
        arguments = f.get("arguments")
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(c["id"], f["name"], _arguments(f"messages[{i}].tool_calls[{j}]", arguments)))
    return tuple(calls)


def _arguments(where: str, arguments: object) -> str:
    try:
        if isinstance(arguments, str) and isinstance(json.loads(arguments), dict):
            return arguments
    except ValueError:
        pass
    raise InvalidArgument(f"{where}: arguments must be a JSON object (as text)")


def check_tool_history(messages: Iterable[Message]) -> None:
    """Each tool result that names a call answers one an earlier assistant message made."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        made.update(c.id for c in m.tool_calls)
        if m.tool_call_id and m.tool_call_id not in made:
            raise InvalidArgument(f"messages[{i}] answers tool call {m.tool_call_id[:64]!r}, which no earlier "
                                  "assistant message made")


def render(
    template: str | None,
    messages: tuple[Message, ...],
    *,
    bos: str,
    eos: str,
    model: str,
    tools: ToolSpec | None = None,
    options: Mapping[str, Any] | None = None,
) -> bytes:
    """The conversation rendered by `template`, ending with the cue for the assistant's next turn. `options`:
    the request's own variables for the template (`chat_template_kwargs`: `enable_thinking`, `reasoning_effort`).

    No template (a base model) is FailedPrecondition naming the model; a template that fails on these
    messages (many refuse a system role, or turns out of order) is InvalidArgument with its own words.
    """
    return _Renderer(template, messages, bos=bos, eos=eos, model=model, tools=tools, options=options).whole()


@dataclass(frozen=True)
class Rendering:
    """A conversation rendered as a prompt, with what the cache may use of its shape (empty where not asked
    for or not found): the byte offsets where its messages end, and the opening of its next turn."""

    text: bytes
    ends: tuple[int, ...] = ()
    opening: bytes = b""
    call: calllayout.CallLayout | None = None


def render_conversation(
    template: str | None, messages: tuple[Message, ...], *, ends: bool = False, opening: bool = False,
    call: bool = False, **options: Any,
) -> Rendering:
    """`render` (with its keyword arguments), and as asked:

    - `ends`: where the rendered messages end (where agents' prompts part: after the system prompt and tools,
      after each turn). A message's end is where the conversation cut after it renders to a prefix of the
      whole; templates that render earlier turns by what follows them give fewer ends. A long conversation
      gives the first and the last ends only, so the cost stays bounded.
    - `opening`: what the template writes between the reply to these messages and a next user message, so
      that a chat that goes on sends the prompt, the reply and this first. Found by rendering the
      conversation with a placeholder reply and user message; none where the template does not write the
      reply as it is right after the prompt.
    - `call`: how the next turn will write a call of the reply (calllayout), for a forced call's grammar."""
    renderer = _Renderer(template, messages, **options)
    text = renderer.whole()
    family = family_of(template)
    layout = renderer.call_layout(text, family.call_end, family.think) if call else None
    return Rendering(text, renderer.ends(text) if ends else (), renderer.opening(text) if opening else b"", layout)


MESSAGE_ENDS_HEAD, MESSAGE_ENDS_TAIL = 8, 24
_REPLY, _NEXT = "BarrelReplyPlaceholder", "BarrelNextTurnPlaceholder"  # stand-ins a template writes as they are
_RESULT = "BarrelToolResultPlaceholder"


def _ends_tried(n_messages: int) -> list[int]:
    """The message counts whose ends are looked for: all of them, or the first and the last in a long
    conversation (each look renders the conversation up to there)."""
    counts = range(1, n_messages + 1)
    if n_messages <= MESSAGE_ENDS_HEAD + MESSAGE_ENDS_TAIL:
        return list(counts)
    return [*counts[:MESSAGE_ENDS_HEAD], *counts[-MESSAGE_ENDS_TAIL:]]


class _Renderer:
    """One conversation and its template, compiled once: the whole rendering, where its messages end, and the
    opening of a next turn."""

    def __init__(self, template: str | None, messages: tuple[Message, ...], *, bos: str, eos: str, model: str,
                 tools: ToolSpec | None = None, options: Mapping[str, Any] | None = None) -> None:
        if not template:
            raise FailedPrecondition(
                f"model {model} has no chat template; send a plain prompt, or give a template with the request"
            )
        self._template = compiled(template)
        self._source, self._given, self._tools = template, messages, tools
        self._text_arguments = writes_text_arguments(template)
        self.messages = self._messages(messages)
        self._extra = {**(options or {}), "bos_token": bos, "eos_token": eos}
        if tools is not None and knows_tools(template):
            self._extra["tools"] = template_tools(tools.tools)

    def _messages(self, messages: tuple[Message, ...]) -> list[dict]:
        return template_messages(self._source, messages, self._tools, self._text_arguments)

    def whole(self) -> bytes:
        return self._render(self.messages, cue=True)

    def ends(self, text: bytes) -> tuple[int, ...]:
        found = []
        for n in _ends_tried(len(self.messages)):
            try:
                head = self._render(self.messages[:n], cue=False)
            except InvalidArgument:
                continue
            if 0 < len(head) < len(text) and text.startswith(head):
                found.append(len(head))
        return tuple(sorted(set(found)))

    def opening(self, text: bytes) -> bytes:
        turns = [*self.messages, {"role": "assistant", "content": _REPLY}, {"role": "user", "content": _NEXT}]
        try:
            after = self._render(turns, cue=False)
        except InvalidArgument:
            return b""
        reply = text + _REPLY.encode()
        start = len(reply)
        end = after.find(_NEXT.encode(), start)
        return after[start:end] if after.startswith(reply) and end > start else b""

    def call_layout(self, text: bytes, call_end: str,
                    think: tuple[str, str] | None = None) -> calllayout.CallLayout | None:
        """How the next turn will write a call of the reply: read after this conversation, else after a lone
        user message (for templates that move the system prompt into the last user turn, Mistral's)."""
        layout = calllayout.derive(self._probe(self._given), text.decode(), call_end, think)
        if layout is not None:
            return layout
        question = (Message("user", _NEXT),)
        prompt = self._render(self._messages(question), cue=True)
        layout = calllayout.derive(self._probe(question), prompt.decode(), call_end, think)
        return None if layout is None else dataclasses.replace(layout, cut=None)

    def _probe(self, given: tuple[Message, ...]) -> calllayout.Render:
        def render(arguments: object) -> str | None:
            call = ToolCall(calllayout.PROBE_ID, calllayout.PROBE_NAME, json.dumps(arguments))
            result = Message("tool", _RESULT, tool_call_id=calllayout.PROBE_ID)
            turns = (*given, Message("assistant", "", (call,)), result)
            try:
                return self._render(self._messages(turns), cue=True).decode()
            except InvalidArgument:
                return None

        return render

    def _render(self, messages: list[dict], cue: bool) -> bytes:
        return _rendered(self._template, messages, add_generation_prompt=cue, **self._extra)


def _rendered(template: Any, messages: list[dict], **context: Any) -> bytes:
    import jinja2

    try:
        text = template.render(messages=messages, **context)
    except InvalidArgument:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise InvalidArgument(f"the chat template failed: {exc}") from None  # its own error on these messages
    return text.encode("utf-8", "replace")


@functools.lru_cache(maxsize=32)
def compiled(template: str) -> Any:
    """A template compiled once in Jinja's immutable sandbox, with what Hugging Face's renderer gives templates
    (loop controls, `{% generation %}`, `raise_exception`, `strftime_now`, its `tojson`)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _Generation])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise InvalidArgument(f"the chat template failed: {exc}") from None


def _raise_exception(message: str) -> None:
    raise InvalidArgument(f"the chat template refused the messages: {message}")


@functools.lru_cache(maxsize=32)
def writes_text_arguments(template: str) -> bool:
    """Whether the template writes a call's arguments as a string: it fails on them as an object and renders
    them as text (Functionary's). Hugging Face's renderer passes what the client sent; llama.cpp's server, like
    Barrel, gives objects unless the template needs text."""
    if "tool_calls" not in template:
        return False
    call = ToolCall(calllayout.PROBE_ID, calllayout.PROBE_NAME, '{"a": 1}')
    turns = (Message("user", _NEXT), Message("assistant", "", (call,)))
    for text in (False, True):
        try:
            _rendered(compiled(template), template_messages(template, turns, None, text), add_generation_prompt=False,
                      bos_token="", eos_token="")
            return text
        except InvalidArgument:
            continue
    return False


def strftime_now(fmt: str) -> str:
    """Today's date or time as a template asks for it (gpt-oss, Llama 3.x and others write the date into the system
    turn), as Hugging Face and llama.cpp's server give it: so such a prompt, and its cache key, change daily."""
    return datetime.datetime.now().strftime(fmt)


def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON as Hugging Face's renderer writes it for templates: Jinja's own filter escapes < > & ' for HTML,
    so a tool's schema or a call's arguments would render to other bytes than the model was trained on.
    Jinja's `map` and `select` give generators, which are written as the lists they yield."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_listed)


def _listed(value: object) -> list:
    if isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _Generation(Extension):
    """Hugging Face's `{% generation %}` block (it marks the assistant's text for training masks): renders its
    body as it is."""

    tags = {"generation"}  # noqa: RUF012 - Jinja's own protocol

    def parse(self, parser: Any) -> Any:
        from jinja2 import nodes

        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def template_messages(template: str, messages: tuple[Message, ...], tools: ToolSpec | None,
                      text_arguments: bool = False) -> list[dict]:
    """Messages as Hugging Face templates take them. A template that writes calls in a family's layout (or
    knows tools) is given them as calls; one that knows no tools has each call written into the assistant's
    content as the model wrote it, so a reply renders back to its own bytes. Tools a template does not render
    are described in the system turn. `text_arguments`: calls' arguments go as the JSON text they came in (for
    templates that write them as strings, Functionary's), not as objects."""
    if knows_tools(template) or family_of(template) is not GENERIC_FAMILY:
        out = [_template_message(m, text_arguments) for m in messages]
    else:
        out = [{"role": m.role, "content": m.content + GENERIC.text(m.tool_calls) if m.tool_calls else m.content}
               for m in messages]
    if tools is not None and not knows_tools(template):
        described = generic_description(tools.tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + described
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _template_message(m: Message, text_arguments: bool = False) -> dict:
    doc: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        doc["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments if text_arguments else json.loads(c.arguments)}}
                             for c in m.tool_calls]
    if m.role == "tool":
        doc["tool_call_id"] = m.tool_call_id
    return doc

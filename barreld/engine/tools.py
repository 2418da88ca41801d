"""Tool calls, once for every front end: the tools a request offers, how a model's chat template writes a
call, the grammar that forces one, and the parser that finds calls in a reply (whole or as it streams).

A template that knows tools (it mentions `tools`) is given them as Hugging Face templates expect; one that
does not (SmolLM2, Gemma 3) gets the generic format: the tools described in the system turn, and a call
written as one JSON object `{"name": ..., "arguments": {...}}`. A call is rendered back into history as the
very bytes the grammar lets the model write, and `arguments` is returned as the model wrote it, so the next
turn's prompt starts with this turn's prompt and reply and the cache restores through them.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from barreld.errors import InvalidArgument

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
CHOICES = ("auto", "none", "required")  # and a tool's name: that tool must be called
MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")  # text that starts a call, by family
LONGEST_MARKER = max(map(len, MARKERS))
SKIPPED = (*MARKERS, "</tool_call>", ";", ",", "[", "]")  # between calls
ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
GENERIC_INTRO = (
    "You can call tools. To call one, reply with only a JSON object "
    '{"name": <the tool\'s name>, "arguments": <its arguments>} and nothing else. The tools, one per line:'
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any] = field(compare=False)  # a JSON Schema of type object


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, as the model wrote it


@dataclass(frozen=True)
class ToolSpec:
    """The tools a request offers and what it asks of them: `choice` is auto, none, required or a name."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """A call must come: the reply is constrained to one by a grammar."""
        return self.choice not in ("auto", "none")

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def offered(self) -> tuple[Tool, ...]:
        """The tools a forced call may name."""
        if self.choice in CHOICES:
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)


def tool_spec(tools: Sequence[Tool], choice: str = "auto", parallel: bool = True) -> ToolSpec | None:
    """Checked once at the edge: names unique, a named choice among them; None when no tool is offered."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"too many tools ({len(tools)}); at most {MAX_TOOLS}")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidArgument("two tools have the same name; each tool's name must be unique")
    if choice not in CHOICES and choice not in names:
        raise InvalidArgument(f"tool_choice names {choice[:64]!r}, which is not among the tools offered")
    if not tools:
        if choice not in ("auto", "none"):
            raise InvalidArgument(f"tool_choice {choice[:64]!r} needs tools; send at least one")
        return None
    return ToolSpec(tuple(tools), choice, parallel)


def tool(name: object, description: object, parameters: object, where: str) -> Tool:
    """One tool, checked: a name llama.cpp's grammar and every template can carry, and a JSON Schema object."""
    import jsonschema

    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidArgument(f"{where}.name must be 1-64 letters, digits, _ . or -, got {str(name)[:64]!r}")
    if name in CHOICES:  # a choice naming it would read as that mode
        raise InvalidArgument(f"{where}.name {name!r} is reserved: tool_choice uses it; rename the tool")
    if description is not None and not isinstance(description, str):
        raise InvalidArgument(f"{where}.description must be a string")
    parameters = {"type": "object", "properties": {}} if parameters is None else parameters
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidArgument(f"{where}: the parameters schema must be a JSON Schema object of type object")
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as exc:
        raise InvalidArgument(f"{where}: not a valid JSON Schema: {exc.message[:200]}") from None
    return Tool(name, description or "", parameters)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class Format:
    """How a family writes calls: around all of them, around each, between them, and the arguments' key."""

    name: str
    start: str = ""
    end: str = ""
    each_open: str = ""
    each_close: str = ""
    separator: str = "\n"
    args_key: str = "arguments"

    def envelope(self, name: str, arguments: str) -> str:
        return f'{self.each_open}{{"name": {json.dumps(name)}, "{self.args_key}": {arguments}}}{self.each_close}'

    def text(self, calls: Sequence[ToolCall]) -> str:
        """The calls as the model writes them (and as a forced call's grammar lets it)."""
        return self.start + self.separator.join(self.envelope(c.name, c.arguments) for c in calls) + self.end


GENERIC = Format("generic")
HERMES = Format("hermes", each_open="<tool_call>\n", each_close="\n</tool_call>")
MISTRAL = Format("mistral", start="[TOOL_CALLS][", end="]", separator=", ")
LLAMA3 = Format("llama3", separator="; ", args_key="parameters")


def knows_tools(template: str | None) -> bool:
    """The template renders `tools` itself; otherwise the generic format describes them in the system turn."""
    return bool(template) and "tools" in template


def format_of(template: str | None) -> Format:
    if not knows_tools(template):
        return GENERIC
    assert template is not None
    for marker, fmt in (("<tool_call>", HERMES), ("[TOOL_CALLS]", MISTRAL), ("<|start_header_id|>", LLAMA3)):
        if marker in template:
            return fmt
    return GENERIC


def generic_description(tools: Sequence[Tool]) -> str:
    """The system turn's text for a template that knows no tools; the same bytes whatever the tool_choice,
    so turns that change it still share their prefix."""
    lines = [
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False)
        for t in tools
    ]
    return "\n".join([GENERIC_INTRO, *lines])


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Tools as Hugging Face chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in tools]


def forced_grammar(spec: ToolSpec, fmt: Format) -> str:
    """GBNF for exactly one call to an offered tool, its arguments valid against the tool's schema (a schema
    the grammar cannot enforce is held to any JSON object), written as `fmt` writes it."""
    from barreld.engine.grammar import JSON_OBJECT, check_schema, schemas_grammar

    named: list[tuple[str, object]] = []
    alternatives = []
    for i, t in enumerate(spec.offered()):
        try:
            check_schema(t.parameters)
            schema: object = t.parameters
        except InvalidArgument:
            schema = JSON_OBJECT
        named.append((f"tool{i}", schema))
        head = f'{json.dumps(t.name)}, "{fmt.args_key}": '
        alternatives.append(f"{_literal(head)} tool{i}")
    body = " | ".join(alternatives)
    opening = _literal(fmt.start + fmt.each_open + '{"name": ')
    return schemas_grammar(named, f'{opening} ({body}) {_literal("}" + fmt.each_close + fmt.end)}')


def _literal(text: str) -> str:
    """A GBNF string literal (its escapes are JSON's)."""
    return json.dumps(text, ensure_ascii=False)


def marker_at(text: str, start: int = 0) -> int | None:
    """Where the first family's marker at or after `start` begins."""
    found = [i for i in (text.find(m, start) for m in MARKERS) if i >= 0]
    return min(found) if found else None


def call_start(text: str) -> int | None:
    """Where a tool call begins in a reply: a family's marker, or a reply that opens with a JSON object."""
    at = marker_at(text)
    if at is not None:
        return at
    body = text.lstrip()
    return len(text) - len(body) if body.startswith("{") else None


def split_calls(text: str, spec: ToolSpec) -> tuple[str, tuple[ToolCall, ...]]:
    """(the text before the calls, the calls) of a whole reply; a reply whose call region does not parse
    as calls to the offered tools is all text."""
    at = call_start(text) if spec.parses else None
    if at is None:
        return text, ()
    calls = _parse_calls(text[at:], {t.name: t for t in spec.tools})
    if not calls:
        return text, ()
    return text[:at], calls if spec.parallel else calls[:1]


def _parse_calls(region: str, tools: dict[str, Tool]) -> tuple[ToolCall, ...]:
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while (pos := _skip(region, pos)) < len(region):
        if region[pos] != "{":
            return ()
        try:
            obj, end = decoder.raw_decode(region, pos)
        except ValueError:
            return ()
        call = _call(obj, region[pos:end], tools)
        if call is None:
            return ()
        calls.append(call)
        pos = end
    return tuple(calls)


def _skip(region: str, pos: int) -> int:
    while True:
        while pos < len(region) and region[pos].isspace():
            pos += 1
        skipped = next((s for s in SKIPPED if region.startswith(s, pos)), None)
        if skipped is None:
            return pos
        pos += len(skipped)


def _call(obj: object, raw: str, tools: dict[str, Tool]) -> ToolCall | None:
    """A call from one JSON object, when its arguments validate against the tool's schema (an unconstrained
    reply may name a tool with arguments the tool cannot take: that is text, not a call). The arguments are
    kept as the model wrote them, trailing spaces included."""
    import jsonschema

    if not isinstance(obj, dict) or obj.get("name") not in tools:
        return None
    given = obj.get("arguments", obj.get("parameters"))
    try:
        args = json.loads(given) if isinstance(given, str) else given
        jsonschema.validate(args, tools[obj["name"]].parameters)
    except (ValueError, jsonschema.ValidationError):
        return None
    if not isinstance(args, dict):  # a schema may leave `type` out
        return None
    return ToolCall(new_call_id(), obj["name"], given if isinstance(given, str) else _raw_arguments(raw, args))


def _raw_arguments(raw: str, args: dict) -> str:
    """The arguments' text as the model wrote them (trailing spaces included); re-encoded if not found."""
    m = ARGS_KEY.search(raw)
    if m:
        value, end = json.JSONDecoder().raw_decode(raw, m.end())
        if value == args:
            return raw[m.end():-1] if raw[end:].strip() == "}" else raw[m.end():end]
    return json.dumps(args, ensure_ascii=False)


class CallStream:
    """A streamed reply split into text to show now and calls found at the end. Text that may begin a call
    (a marker's first characters, or leading spaces before a `{`) is held back, so no client sees part of one."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.text = ""
        self._shown = 0
        self._calling = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self._calling or not self.spec.parses:
            return "" if self._calling else self._show(len(self.text))
        if self._shown == 0:  # nothing shown yet: the text is short (spaces, the start of a marker)
            at = call_start(self.text)
            if at is None and not self.text.strip():
                return ""
        else:  # text was shown, so the reply did not open with "{": only a marker not yet shown can start a call
            at = marker_at(self.text, max(0, self._shown - LONGEST_MARKER + 1))
        if at is not None:
            self._calling = True
            return self._show(at)
        return self._show(len(self.text) - _held(self.text))

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(the text not yet shown, the calls)."""
        content, calls = split_calls(self.text, self.spec)
        if not calls:
            return self._show(len(self.text)), ()
        return self._show(len(content)), calls

    def _show(self, upto: int) -> str:
        out = self.text[self._shown:upto]
        self._shown = max(self._shown, upto)
        return out


def _held(text: str) -> int:
    """How many trailing characters might begin a marker."""
    return max((n for m in MARKERS for n in range(1, len(m)) if text.endswith(m[:n])), default=0)

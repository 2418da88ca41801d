"""Tool calls, once for every front end: the tools a request offers, the grammar that forces a call, and the
reading of calls from a reply (whole or as it streams) in the format of the model's family (callformats).

A template that knows tools (it mentions `tools`) is given them as Hugging Face templates expect; one that
does not (SmolLM2, Gemma 3) gets them described in the system turn. A forced call is held to the very bytes the
template writes back for it (calllayout), so the next turn's prompt starts with this turn's prompt and reply
and the cache restores through them; where no layout can be read off the template, to the generic format's
JSON object, written into the history as the model wrote it.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from barreld.engine import calllayout
from barreld.engine.callformats import Family, ParsedCall
from barreld.errors import InvalidArgument

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
CHOICES = ("auto", "none", "required")  # and a tool's name: that tool must be called
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


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why a tool's parameters are not a valid JSON Schema, or None."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc.message[:200]
    return None


def _text_problem(text: str) -> str | None:
    return schema_problem(json.loads(text))


class SchemaChecks:
    """One tenant's verdicts on the tool schemas it sent, by their canonical JSON. Agents send the same tools
    with every request, and checking a schema against its metaschema is slow (Claude Code's 14 tools, drafts of
    2020-12: 26 ms a request here, against 0.1 ms to write them out as the key). One per tenant: a memo shared
    would let a tenant time whether another had sent the same tools, or evict another's verdicts."""

    def __init__(self, size: int = 256) -> None:
        self._problem = functools.lru_cache(maxsize=size)(_text_problem)

    def problem(self, schema: dict[str, Any]) -> str | None:
        return self._problem(json.dumps(schema, sort_keys=True))


def tool(name: object, description: object, parameters: object, where: str,
         checks: SchemaChecks | None = None) -> Tool:
    """One tool, checked: a name llama.cpp's grammar and every template can carry, and a JSON Schema object
    (`checks` remembers the verdicts of the schemas a tenant sent before)."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidArgument(f"{where}.name must be 1-64 letters, digits, _ . or -, got {str(name)[:64]!r}")
    if name in CHOICES:  # a choice naming it would read as that mode
        raise InvalidArgument(f"{where}.name {name!r} is reserved: tool_choice uses it; rename the tool")
    if description is not None and not isinstance(description, str):
        raise InvalidArgument(f"{where}.description must be a string")
    parameters = {"type": "object", "properties": {}} if parameters is None else parameters
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidArgument(f"{where}: the parameters schema must be a JSON Schema object of type object")
    problem = schema_problem(parameters) if checks is None else checks.problem(parameters)
    if problem is not None:
        raise InvalidArgument(f"{where}: not a valid JSON Schema: {problem}")
    return Tool(name, description or "", parameters)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class Format:
    """The generic format's calls as text: one JSON object each, a new line between them."""

    name: str
    separator: str = "\n"
    args_key: str = "arguments"

    def envelope(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "{self.args_key}": {arguments}}}'

    def text(self, calls: Sequence[ToolCall]) -> str:
        """The calls as the model writes them (and as a forced call's grammar lets it)."""
        return self.separator.join(self.envelope(c.name, c.arguments) for c in calls)


GENERIC = Format("generic")


def knows_tools(template: str | None) -> bool:
    """The template renders `tools` itself; otherwise they are described in the system turn."""
    return bool(template) and "tools" in template


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


def forced_grammar(spec: ToolSpec, layout: calllayout.CallLayout | None, seed: bytes) -> str:
    """GBNF for exactly one call to an offered tool, its arguments valid against the tool's schema (a schema
    the grammar cannot enforce is held to any JSON object): in the template's own bytes where `layout` was read
    off it (an id where it writes one, fixed by `seed`, the prompt), else as the generic format writes it."""
    from barreld.engine.grammar import JSON_OBJECT, check_schema, schemas_grammar

    if layout is not None:
        offered = [calllayout.Offered(t.name, t.parameters, calllayout.call_id(seed, t.name)) for t in spec.offered()]
        return calllayout.grammar(layout, offered)
    named: list[tuple[str, object]] = []
    alternatives = []
    for i, t in enumerate(spec.offered()):
        try:
            check_schema(t.parameters)
            schema: object = t.parameters
        except InvalidArgument:
            schema = JSON_OBJECT
        named.append((f"tool{i}", schema))
        head = f'{json.dumps(t.name)}, "{GENERIC.args_key}": '
        alternatives.append(f"{_literal(head)} tool{i}")
    body = " | ".join(alternatives)
    opening = _literal('{"name": ')
    return schemas_grammar(named, f'{opening} ({body}) {_literal("}")}')


def _literal(text: str) -> str:
    """A GBNF string literal (its escapes are JSON's)."""
    return json.dumps(text, ensure_ascii=False)


def split_calls(text: str, spec: ToolSpec | None, family: Family) -> tuple[str, tuple[ToolCall, ...], str]:
    """(the content, the calls, any reasoning still in it) of a whole reply (its opening reasoning already set
    apart), read in the family's format. Calls are read only where the request offers tools and lets them be
    called; a reply whose calls do not all name an offered tool with arguments its schema validates is all
    text: an unconstrained reply may name a tool with arguments the tool cannot take."""
    tools = {t.name: t for t in spec.tools} if spec is not None else {}
    parsed = family.parse(text, tuple(tools))
    if not parsed.calls:
        return parsed.content, (), parsed.reasoning
    calls = [_checked(c, tools, family) for c in parsed.calls] if spec is not None and spec.parses else [None]
    if None in calls:
        return text, (), ""
    found = tuple(c for c in calls if c is not None)
    return parsed.content, found if spec is None or spec.parallel else found[:1], parsed.reasoning


def _checked(call: ParsedCall, tools: dict[str, Tool], family: Family) -> ToolCall | None:
    import jsonschema

    if call.name not in tools:
        return None
    arguments = call.arguments
    try:
        args = json.loads(arguments)
        if family.bare_values and isinstance(args, dict):
            arguments = _as_text_where_declared(args, tools[call.name].parameters) or arguments
            args = json.loads(arguments)
        jsonschema.validate(args, tools[call.name].parameters)
    except (ValueError, jsonschema.ValidationError):
        return None
    if not isinstance(args, dict):  # a schema may leave `type` out
        return None
    return ToolCall(call.id or new_call_id(), call.name, arguments)


def _as_text_where_declared(args: dict, schema: dict) -> str | None:
    """Arguments read from bare text between tags (the XML layouts), where the tool's schema declares a
    property a string: read back as the text it was written as ("12", "true"), as llama.cpp reads them with
    the schema; None when nothing changes."""
    properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
    text = {key for key, value in args.items()
            if not isinstance(value, str) and isinstance(properties.get(key), dict)
            and properties[key].get("type") == "string"}
    if not text:
        return None
    return json.dumps({key: json.dumps(value, ensure_ascii=False) if key in text else value
                       for key, value in args.items()}, ensure_ascii=False)


class CallStream:
    """A streamed reply split into text to show now and, at the end, the rest of its content and its calls.
    Text from where the family writes something other than content (a call's marker, or its first characters;
    a reply that opens with `{` where bare JSON is a call) is held back, so no client sees part of one."""

    def __init__(self, spec: ToolSpec | None, family: Family) -> None:
        self.spec = spec
        self.family = family
        self.text = ""
        self._shown = 0
        self._holding = False
        self._longest = max(map(len, family.markers), default=0)

    def feed(self, piece: str) -> str:
        self.text += piece
        self._holding = self._holding or self.family.recipient_first
        if self._holding:
            return ""
        at = self._marker_at(max(0, self._shown - self._longest + 1))
        body = self.text.lstrip()
        if self._shown == 0 and body.startswith("{") and self.family.bare_json and self.spec is not None \
                and self.spec.parses:  # nothing shown yet: the reply may open with a call
            at = len(self.text) - len(body)
        if at is not None:
            self._holding = True
            if not self.text[self._shown:at].strip() and self._shown == 0:
                self._shown = at  # only spaces came before the call: not content
            return self._show(at)
        return self._show(len(self.text) - self._held())

    def finish(self) -> tuple[str, tuple[ToolCall, ...], str]:
        """(the content not yet shown, the calls, reasoning found in what was held). What was shown stands,
        spaces around it aside (a parser trims the content); a reply whose content does not go on from it is
        shown whole, as text."""
        content, calls, reasoning = split_calls(self.text, self.spec, self.family)
        shown = self.text[:self._shown]
        if not content.startswith(shown):
            content, shown = content.strip(), shown.strip()
        if not content.startswith(shown):
            return self._show(len(self.text)), (), ""
        self._shown = len(self.text)
        return content[len(shown):], calls, reasoning

    def _marker_at(self, start: int) -> int | None:
        found = [i for i in (self.text.find(m, start) for m in self.family.markers) if i >= 0]
        return min(found) if found else None

    def _show(self, upto: int) -> str:
        out = self.text[self._shown:upto]
        if self._shown == 0 and not out.strip():
            return ""  # spaces at the start wait: they may come before a call, which they are not content of
        self._shown = max(self._shown, upto)
        return out

    def _held(self) -> int:
        """How many trailing characters might begin a marker."""
        return max((n for m in self.family.markers for n in range(1, len(m)) if self.text.endswith(m[:n])),
                   default=0)

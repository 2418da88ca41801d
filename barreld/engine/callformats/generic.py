"""The generic format, for templates that know no tools (SmolLM2, Gemma 3) or whose layout Barrel does not
know: a call is one JSON object `{"name": ..., "arguments": {...}}`, several separated by new lines, and the
reply's text before the first of them is its content."""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from barreld.engine.callformats.base import Family, Parsed, ParsedCall, dumps, split_reasoning

ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
SEPARATORS = (",", ";")


class Generic(Family):
    bare_json = True

    def parse(self, text: str, tools: Collection[str] = (), *, reasoning_open: bool = False) -> Parsed:
        reasoning, rest = split_reasoning(text, self.think, reasoning_open)
        at = json_start(rest)
        calls = json_calls(rest[at:], tools) if at is not None else ()
        return Parsed(rest[:at] if calls else rest, reasoning, calls)


def json_start(text: str) -> int | None:
    """Where a reply's calls start: it opens (after whitespace) with a JSON object."""
    body = text.lstrip()
    return len(text) - len(body) if body.startswith("{") else None


def json_calls(region: str, tools: Collection[str] = ()) -> tuple[ParsedCall, ...]:
    """The calls of a region that is JSON objects naming a tool (one of `tools` when given) and its arguments
    (`arguments` or `parameters`), separated by whitespace, commas or semicolons; none unless all of it is."""
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    pos = 0
    while (pos := _skip(region, pos)) < len(region):
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
    while pos < len(region) and (region[pos].isspace() or region[pos] in SEPARATORS):
        pos += 1
    return pos


def _call(obj: object, raw: str, tools: Collection[str]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (tools and obj["name"] not in tools):
        return None
    given = obj.get("arguments", obj.get("parameters"))
    if isinstance(given, str):
        return ParsedCall(obj["name"], given)
    if not isinstance(given, dict):
        return None
    return ParsedCall(obj["name"], raw_arguments(raw, given))


def raw_arguments(raw: str, args: dict) -> str:
    """The arguments' text as the model wrote them in `raw` (one call's JSON object), trailing spaces included;
    written out again where they cannot be found."""
    m = ARGS_KEY.search(raw)
    if m:
        value, end = json.JSONDecoder().raw_decode(raw, m.end())
        if value == args:
            return raw[m.end():-1] if raw[end:].strip() == "}" else raw[m.end():end]
    return dumps(args)


FAMILY = Generic()

"""Mistral's first tool-calling generation (Nemo, 7B v0.3): `[TOOL_CALLS]` then a JSON array of
`{"name": ..., "arguments": {...}, "id": "abcdefghi"}` objects, the id nine characters the model makes up."""

from __future__ import annotations

import json

from barreld.engine.callformats._b_common import RegionFamily, whole_json
from barreld.engine.callformats.base import ParsedCall, json_value_at, skip_space

MARKER = "[TOOL_CALLS]"


def _members(text: str, pos: int) -> tuple[dict[str, str], int] | None:
    """The members of the JSON object at `pos`, each value as the model wrote it, and where the object ends;
    None when no object starts there. Arguments are kept as their own text, not as a re-encoding."""
    pos = skip_space(text, pos)
    if not text.startswith("{", pos):
        return None
    members: dict[str, str] = {}
    pos = skip_space(text, pos + 1)
    if text.startswith("}", pos):
        return members, pos + 1
    while True:
        key = json_value_at(text, pos)
        if key is None or not isinstance(key[0], str) or not text.startswith(":", pos := skip_space(text, key[1])):
            return None
        start = skip_space(text, pos + 1)
        value = json_value_at(text, start)
        if value is None:
            return None
        members[key[0]] = text[start:value[1]]
        pos = skip_space(text, value[1])
        if not text.startswith(",", pos):
            return (members, pos + 1) if text.startswith("}", pos) else None
        pos = skip_space(text, pos + 1)


def _call(members: dict[str, str]) -> ParsedCall | None:
    """A call from its object's members; its arguments an object, or a string holding one."""
    name = json.loads(members.get("name", "null"))
    arguments = members.get("arguments", "{}")
    if arguments.startswith('"'):
        arguments = json.loads(arguments)
    arguments = whole_json(arguments)
    call_id = json.loads(members.get("id", '""'))
    if not isinstance(name, str) or arguments is None or not isinstance(call_id, str):
        return None
    return ParsedCall(name, arguments, call_id)


class Mistral(RegionFamily):
    name = "mistral"
    label = "Mistral [TOOL_CALLS] JSON array"
    priority = 30
    markers = (MARKER,)
    call_end = "]"

    def detects(self, template: str) -> bool:
        """The array layout's templates; the next generation's write `[ARGS]` after each name."""
        return MARKER in template and "[ARGS]" not in template

    def read_calls(self, text: str, start: int) -> tuple[list[ParsedCall], int] | None:
        pos = skip_space(text, start + len(MARKER))
        if not text.startswith("[", pos):
            return None
        calls = []
        pos = skip_space(text, pos + 1)
        while (found := _members(text, pos)) is not None and (call := _call(found[0])) is not None:
            calls.append(call)
            pos = skip_space(text, found[1])
            if text.startswith("]", pos):
                return calls, pos + 1
            if not text.startswith(",", pos):
                return None
            pos += 1
        return None


FAMILY = Mistral()

"""Meta Llama 3.1 / 3.2 / 3.3's format: a call is the JSON object `{"name": ..., "parameters": {...}}` as the
whole reply (Llama 3.2 may write several, separated by ";"), or follows <|python_tag|>, which also opens a
built-in tool's call `brave_search.call(query="...")`. A bare JSON object is a call only when it names an
offered tool: the model may answer in JSON."""

from __future__ import annotations

import re
from collections.abc import Collection

from barreld.engine.callformats._a_calls import CallFamily, Calls, offered
from barreld.engine.callformats._a_json import json_calls
from barreld.engine.callformats.base import ParsedCall, dumps, json_value_at, skip_space

PYTHON_TAG = "<|python_tag|>"
BUILTIN = re.compile(r"([A-Za-z_]\w*)\.call\(")
ARGUMENT = re.compile(r"\s*([A-Za-z_]\w*)\s*=")


class Llama3(CallFamily):
    name = "llama3"
    label = "Llama 3.x"
    priority = 40
    markers = (PYTHON_TAG,)
    bare_json = True

    def detects(self, template: str) -> bool:
        return 'Respond in the format {"name": function name, "parameters"' in template

    def call_start(self, text: str) -> int | None:
        bare = skip_space(text, 0)
        if text.startswith("{", bare):
            return bare
        return super().call_start(text)

    def read(self, text: str, pos: int, tools: Collection[str]) -> Calls | None:
        pos = skip_space(text, pos)
        if text.startswith(";", pos):
            pos += 1
        pos = skip_space(text, pos)
        if text.startswith(PYTHON_TAG, pos):
            pos += len(PYTHON_TAG)
            return _builtin_call(text, skip_space(text, pos), tools) or json_calls(text, pos, tools)
        return json_calls(text, pos, tools) if tools else None


def _builtin_call(text: str, pos: int, tools: Collection[str]) -> Calls | None:
    """A built-in tool's call `NAME.call(key=JSON, ...)` at `pos`, as the template writes it."""
    builtin = BUILTIN.match(text, pos)
    if builtin is None or not offered(builtin[1], tools):
        return None
    args: dict[str, object] = {}
    pos = builtin.end()
    while (argument := ARGUMENT.match(text, pos)) is not None:
        found = json_value_at(text, argument.end())
        if found is None:
            return None
        args[argument[1]], pos = found
        pos = skip_space(text, pos)
        if not text.startswith(",", pos):
            break
        pos += 1
    pos = skip_space(text, pos)
    if not text.startswith(")", pos):
        return None
    return (ParsedCall(builtin[1], dumps(args)),), pos + 1


FAMILY = Llama3()

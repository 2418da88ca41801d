"""Calls written as JSON objects (or arrays of them) between a family's marks, as Hermes, Qwen, Granite,
Nemotron and Command R7B write them. The arguments are kept as the model's own JSON text."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

from barreld.engine.callformats._a_calls import CallFamily, Calls, offered
from barreld.engine.callformats.base import ParsedCall, raw_json_at, skip_space


@dataclass(frozen=True)
class Keys:
    """The members of a call object that hold its name, its arguments (the first present of `args`) and its id."""

    name: str = "name"
    args: tuple[str, ...] = ("arguments", "parameters")
    id: str = ""


NAMED = Keys()


def members(text: str, pos: int) -> tuple[dict[str, tuple[object, str]], int] | None:
    """The members of the JSON object at `pos` (after whitespace), each as (its value, the value's own text),
    and where the object ends; None when no JSON object starts there."""
    found = raw_json_at(text, pos)
    if found is None:
        return None
    raw, end = found
    decode = json.JSONDecoder().raw_decode
    out: dict[str, tuple[object, str]] = {}
    i = skip_space(raw, 1)
    while raw[i] != "}":  # the object parsed, so each member is a string, a colon, a value and a comma or "}"
        key, i = decode(raw, i)
        start = skip_space(raw, skip_space(raw, i) + 1)
        value, i = decode(raw, start)
        out[key] = (value, raw[start:i])
        i = skip_space(raw, i)
        if raw[i] == ",":
            i = skip_space(raw, i + 1)
    return out, end


def json_call(text: str, pos: int, tools: Collection[str], keys: Keys = NAMED) -> tuple[ParsedCall, int] | None:
    """The call object at `pos` (after whitespace) and where it ends; None when there is none, it names a tool
    not offered, or its arguments are not an object. Arguments given as a string of JSON are taken as that
    string; a call without arguments has none ({})."""
    found = members(text, pos)
    if found is None:
        return None
    fields, end = found
    name = fields.get(keys.name, (None, ""))[0]
    if not isinstance(name, str) or not offered(name, tools):
        return None
    value, raw = next((fields[k] for k in keys.args if k in fields), ({}, "{}"))
    if isinstance(value, str):
        try:
            value, raw = json.loads(value), value
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    call_id = fields.get(keys.id, ("", ""))[0] if keys.id else ""
    return ParsedCall(name, raw, str(call_id)), end


def json_calls(text: str, pos: int, tools: Collection[str], keys: Keys = NAMED) -> Calls | None:
    """A call object, or a non-empty array of them, at `pos` (after whitespace), and where it ends."""
    pos = skip_space(text, pos)
    if not text.startswith("[", pos):
        found = json_call(text, pos, tools, keys)
        return None if found is None else ((found[0],), found[1])
    calls = []
    pos += 1
    while (found := json_call(text, pos, tools, keys)) is not None:
        calls.append(found[0])
        pos = skip_space(text, found[1])
        if text.startswith("]", pos):
            return tuple(calls), pos + 1
        if not text.startswith(",", pos):
            return None
        pos += 1
    return None


def wrapped_calls(text: str, pos: int, tools: Collection[str], opening: str, closing: str = "",
                  keys: Keys = NAMED) -> Calls | None:
    """The calls between `opening` (at `pos`, after whitespace) and `closing`, and where the block ends. A
    closing mark may be missing at the very end of the reply, where a stop may have cut it."""
    pos = skip_space(text, pos)
    if not text.startswith(opening, pos):
        return None
    found = json_calls(text, pos + len(opening), tools, keys)
    if found is None:
        return None
    calls, end = found
    end = skip_space(text, end)
    if closing and text.startswith(closing, end):
        return calls, end + len(closing)
    return (calls, end) if not closing or end == len(text) else None


class JsonBlocks(CallFamily):
    """A family whose call blocks are JSON between one of `blocks`' (opening, closing) marks."""

    blocks: tuple[tuple[str, str], ...] = ()
    keys = NAMED

    def read(self, text: str, pos: int, tools: Collection[str]) -> Calls | None:
        for opening, closing in self.blocks:
            found = wrapped_calls(text, pos, tools, opening, closing, self.keys)
            if found is not None:
                return found
        return None

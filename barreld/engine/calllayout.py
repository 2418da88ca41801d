"""How a chat template writes a tool call back into the next turn, read off the template itself, and the grammar
that holds a forced call to exactly those bytes.

The template is asked to render the conversation going on after a call to a probe tool (a probe id, name and
arguments, then the probe tool's result). Where that rendering starts with the prompt, what follows the prompt is
the call as the next turn will show it: literal text around the id, the name and the arguments. The arguments
are written either as one JSON object (`tojson`: Hermes, Llama 3, gpt-oss, DeepSeek, Kimi, Mistral) or as one
element per parameter (Qwen3-Coder's `<parameter=KEY>`, GLM's `<arg_key>`, MiniMax's `<parameter name=...>`),
which a second probe with two parameters tells apart. A reply generated through this grammar renders back to
its own bytes, so the next turn restores through the call: `prefix_kept` by construction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from barreld.engine.grammar import check_schema, schemas_grammar, tojson_grammar
from barreld.errors import InvalidArgument

PROBE_ID, PROBE_NAME = "BarrelId9", "BarrelProbeTool"  # nine letters and digits: Mistral's templates check ids
KEY_A, VALUE_A, KEY_B, VALUE_B = "BarrelKeyA", "BarrelValueA", "BarrelKeyB", "BarrelValueB"
NUMBER = 12345
ID_ALPHABET = string.ascii_letters + string.digits
RAW_TEXT = "[^<]*"  # a parameter's text written as it is: it cannot run into the element that closes it


@dataclass(frozen=True)
class Parameters:
    """Arguments written one element per parameter: `first` before the first one's key, `between` from a value
    to the next key, `is_text` from a key to a text value and `is_json` to any other, `last` after the last
    value, `none` when there are none. Text values are written as they are, other values as JSON."""

    first: str
    is_text: str
    is_json: str
    between: str
    last: str
    none: str


@dataclass(frozen=True)
class CallLayout:
    """A call as the next turn shows it: `parts` alternate literal text and the slots "id", "name" and "args"
    (a JSON object), or end with `parameters`, which then hold the arguments and all that follows them.

    `cut`: where the next turn departs from the prompt, in bytes, when the prompt ends with reasoning marks that
    the next turn writes otherwise (a `<think>` the generation prompt opens, an empty `<think></think>`); a
    forced call's prompt is cut there and its reply written as the next turn writes it, so it is kept whole."""

    parts: tuple[str, ...]
    parameters: Parameters | None = None
    cut: int | None = None


Render = Callable[[object], str | None]
"""Renders the conversation, then a call to the probe tool with these arguments and its result, as the next
turn's prompt; None where the template refuses it."""


def derive(render: Render, prompt: str, call_end: str,
           think: tuple[str, str] | None = None) -> CallLayout | None:
    """The layout of a call after `prompt`, or None where the template writes it in a way not described here.
    `call_end`: the family's text that closes a call region; the call is cut after it (or after the arguments
    when it is not there), since what follows is the template's, not the model's. `think`: the family's
    reasoning marks, which the prompt may end with and the next turn write otherwise."""
    first = render({KEY_A: VALUE_A})
    start = None if first is None else _reply_start(prompt, first, think)
    if first is None or start is None:
        return None

    def after(arguments: object) -> str | None:
        rendered = render(arguments)
        return rendered[start:] if rendered is not None and rendered[:start] == first[:start] else None

    one = first[start:]
    as_json = json.dumps({KEY_A: VALUE_A})
    if as_json in one:
        layout = _json_layout(one, as_json, call_end)
    else:
        two, number, none = after({KEY_A: VALUE_A, KEY_B: VALUE_B}), after({KEY_A: NUMBER}), after({})
        if two is None or number is None or none is None:
            return None
        layout = _parameters_layout(one, two, number, none, call_end)
    if layout is None or start == len(prompt):
        return layout
    return dataclasses.replace(layout, cut=len(prompt[:start].encode()))


def _reply_start(prompt: str, rendered: str, think: tuple[str, str] | None) -> int | None:
    """Where the call's turn departs from the prompt: its end, where the rendering starts with it; else, where
    what the prompt has beyond the shared part is reasoning marks only, the end of the shared part."""
    if rendered.startswith(prompt):
        return len(prompt)
    if think is None:
        return None
    shared = 0
    while rendered[shared] == prompt[shared]:
        shared += 1
    shared -= max((k for m in think for k in range(1, len(m)) if prompt[:shared].endswith(m[:k])), default=0)
    beyond = prompt[shared:]
    for mark in think:
        beyond = beyond.replace(mark, "")
    return None if beyond.strip() else shared


def _slots(text: str) -> list[str] | None:
    """`text` split into literals and the id and name slots: literal, slot, literal, ...; None where a probe
    is written twice (the layout would be ambiguous)."""
    parts = [text]
    for slot, probe in (("id", PROBE_ID), ("name", PROBE_NAME)):
        out = []
        for i, part in enumerate(parts):
            if i % 2 or probe not in part:
                out.append(part)
                continue
            head, tail = part.split(probe, 1)
            if probe in tail:
                return None
            out += [head, slot, tail]
        parts = out
    return parts


def _cut(text: str, call_end: str) -> str:
    at = text.find(call_end) if call_end else -1
    return text[:at + len(call_end)] if at >= 0 else ""


def _json_layout(one: str, as_json: str, call_end: str) -> CallLayout | None:
    head, tail = one.split(as_json, 1)
    before, after = _slots(head), _slots(_cut(tail, call_end))
    if before is None or after is None or "name" not in before or "name" in after:
        return None
    return CallLayout((*before, "args", *after))


def _parameters_layout(one: str, two: str, number: str, none: str, call_end: str) -> CallLayout | None:
    """Read off the renders with one text parameter, two, one number and none; None unless they agree."""
    name_end = one.find(PROBE_NAME) + len(PROBE_NAME)
    head, rest = one[:name_end], one[name_end:]
    if not (two.startswith(head) and number.startswith(head) and none.startswith(head)):
        return None
    key_a, value_a = rest.find(KEY_A), rest.find(VALUE_A)
    if not 0 <= key_a < value_a:
        return None
    first, is_, last = rest[:key_a], rest[key_a + len(KEY_A):value_a], rest[value_a + len(VALUE_A):]
    value_end = f"{first}{KEY_A}{is_}{VALUE_A}"
    between = two[name_end + len(value_end):].split(KEY_B, 1)[0]
    is_json = number[name_end + len(first) + len(KEY_A):].split(str(NUMBER), 1)[0]
    shapes = {two[name_end:]: f"{value_end}{between}{KEY_B}{is_}{VALUE_B}{last}",
              number[name_end:]: f"{first}{KEY_A}{is_json}{NUMBER}{last}"}
    parts = _slots(head)
    if any(got != want for got, want in shapes.items()) or parts is None or "name" not in parts:
        return None
    params = Parameters(first, is_, is_json, between, _cut(last, call_end), _cut(none[name_end:], call_end))
    return CallLayout(tuple(parts), params)


@dataclass(frozen=True)
class Offered:
    """A tool a forced call may name: its name, its arguments' schema, and the id its call will carry."""

    name: str
    parameters: dict
    call_id: str


def call_id(seed: bytes, name: str) -> str:
    """The id a forced call writes where the template writes ids: nine letters and digits, fixed by the prompt
    and the tool, so a warm reply is the cold one byte for byte and ids differ from turn to turn."""
    digest = int.from_bytes(hashlib.sha256(seed + b"\0" + name.encode()).digest(), "big")
    return "".join(ID_ALPHABET[(digest >> (6 * i)) % len(ID_ALPHABET)] for i in range(9))


def grammar(layout: CallLayout, tools: Sequence[Offered]) -> str:
    """GBNF for exactly one call to one of `tools`, in the layout's bytes; its arguments valid against the
    tool's schema (a schema the grammar cannot enforce holds them to any JSON object)."""
    named: list[tuple[str, object]] = []
    alternatives = []
    for i, tool in enumerate(tools):
        rule = [_literal(p) if j % 2 == 0 else _slot(p, tool, f"tool{i}", named) for j, p in enumerate(layout.parts)]
        if layout.parameters is not None:
            rule.append(_parameters(layout.parameters, tool, i, named))
        alternatives.append(" ".join(rule))
    return tojson_grammar(schemas_grammar(named, " | ".join(f"({a})" for a in alternatives)))


def _literal(text: str) -> str:
    """A GBNF string literal (its escapes are JSON's); `""` matches nothing."""
    return json.dumps(text, ensure_ascii=False)


def _enforceable(schema: object) -> object:
    try:
        check_schema(schema)
    except InvalidArgument:
        return {"type": "object"}
    return schema


def _slot(slot: str, tool: Offered, rule: str, named: list[tuple[str, object]]) -> str:
    if slot == "id":
        return _literal(tool.call_id)
    if slot == "name":
        return _literal(tool.name)
    named.append((rule, _enforceable(tool.parameters)))
    return rule


def _parameters(layout: Parameters, tool: Offered, index: int, named: list[tuple[str, object]]) -> str:
    """Each property in the schema's order, the required ones always: `first` before the first written,
    `between` before each other one, `last` after them; `none` when the call has no arguments."""
    schema = _enforceable(tool.parameters)
    props = list(schema.get("properties", {}).items()) if isinstance(schema, dict) else []
    required = set(schema.get("required", ())) if isinstance(schema, dict) else set()
    items = [f"{_literal(key)} {_value(value, layout, f't{index}p{j}', named)}" for j, (key, value) in enumerate(props)]
    alternatives = [f"{_literal(layout.first)} {items[j]} {_rest(items, props, required, j + 1, layout.between)} "
                    f"{_literal(layout.last)}"
                    for j in range(len(props)) if all(k not in required for k, _ in props[:j])]
    if not required:
        alternatives.append(_literal(layout.none))
    return "(" + " | ".join(f"({a})" for a in alternatives) + ")"


def _rest(items: list[str], props: list, required: set, start: int, between: str) -> str:
    """The properties after the first written one, each optional unless required, in order."""
    out = []
    for j in range(start, len(items)):
        item = f"{_literal(between)} {items[j]}"
        out.append(item if props[j][0] in required else f"({item})?")
    return " ".join(out)


def _value(schema: object, layout: Parameters, rule: str, named: list[tuple[str, object]]) -> str:
    """What follows a parameter's key: its value, text as it is (one of its enum's where it has one), anything
    else as JSON."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
            return f"{_literal(layout.is_text)} (" + " | ".join(_literal(v) for v in schema["enum"]) + ")"
        return f"{_literal(layout.is_text)} ({RAW_TEXT})"
    named.append((rule, _enforceable(schema) if isinstance(schema, dict) else {}))
    return f"{_literal(layout.is_json)} {rule}"

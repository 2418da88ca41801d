"""What a model family's format is to Barrel: where a reply's tool calls start, how its reasoning is set apart,
and how a whole reply parses into content, reasoning and calls. Plain text in, plain values out: no template
is rendered and no model is asked here, so every family's parser is tested on the model outputs alone."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as text: as the model wrote it where it wrote JSON, else written out
    id: str = ""  # where the format carries one (Mistral's nine characters, Kimi's functions.NAME:0)


@dataclass(frozen=True)
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: tuple[ParsedCall, ...] = ()


class Family:
    """The generic family's behaviour, which each family's module overrides where its format differs.

    `priority` orders detection (lower first), so a family whose markers another's template also holds is
    tried before it. `markers`: text that opens a call region (a stream holds text back from the first of
    them). `call_end`: the text that closes a call region, where a forced call ends (empty: right after its
    arguments). `think`: the opening and closing marks of the reasoning, or None. `bare_json`: a reply that
    opens with a JSON object is a call (the generic format, Llama 3's). `recipient_first`: every reply opens by
    naming whom it is for, a tool or the user (Functionary's), so a stream holds it back whole.
    `calls_end_reasoning`: the model may call a tool straight from an unclosed reasoning (Kimi, DeepSeek V3.2,
    the XML layouts), so a marker ends the reasoning too. `bare_values`: arguments are written as bare text
    between tags, so a string that looks like a number reads as one until the tool's schema says otherwise."""

    name = "generic"
    label = "generic JSON object"
    priority = 1000
    markers: tuple[str, ...] = ()
    call_end = "}"
    think: tuple[str, str] | None = None
    bare_json = False
    recipient_first = False
    calls_end_reasoning = False
    bare_values = False

    def detects(self, template: str) -> bool:
        """Whether `template` (a chat template's source) is this family's."""
        return False

    def parse(self, text: str, tools: Collection[str] = (), *, reasoning_open: bool = False) -> Parsed:
        """A whole reply as content, reasoning and calls. `tools`: the names offered (empty: any name).
        `reasoning_open`: the prompt ended inside the reasoning (its opening mark was the prompt's last text),
        so the reply starts with reasoning. Text that does not parse as calls stays content."""
        reasoning, rest = split_reasoning(text, self.think, reasoning_open)
        return Parsed(rest, reasoning, ())


def split_reasoning(text: str, think: tuple[str, str] | None, reasoning_open: bool = False) -> tuple[str, str]:
    """(reasoning, the rest) of a reply that may open with reasoning between `think`'s marks, or with the
    closing mark alone (its prompt opened the reasoning). An unclosed reasoning is all reasoning; whitespace
    around the marks is not part of either."""
    if think is None:
        return "", text
    opening, closing = think
    body = text.lstrip()
    if not reasoning_open:
        if body.startswith(opening):
            body = body[len(opening):]
        elif not body.startswith(closing):
            return "", text
    end = body.find(closing)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(closing):].lstrip()


def skip_space(text: str, pos: int) -> int:
    """The first position from `pos` that is not whitespace."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def tagged_value(text: str) -> object:
    """An argument the model wrote as bare text between tags: a number, boolean, null, list or object where the
    text is one in JSON (the templates write non-string values with `tojson`), else the text itself, since
    string values are written unquoted. Without the tools' schemas a string such as "12" reads as a number;
    NaN and Infinity, which are not JSON, stay text."""
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError:
        return text
    return text if isinstance(value, str) else value


def _not_json(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def dumps(value: object) -> str:
    """JSON as Barrel writes arguments it did not get as JSON text (Python's separators, as `tojson` writes)."""
    return json.dumps(value, ensure_ascii=False)


def json_value_at(text: str, pos: int) -> tuple[object, int] | None:
    """(a JSON value, where it ends) starting at `pos` after any whitespace; None when none starts there."""
    decoder = json.JSONDecoder()
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return decoder.raw_decode(text, pos)
    except ValueError:
        return None


def raw_json_at(text: str, pos: int) -> tuple[str, int] | None:
    """(the JSON object's own text, where it ends) starting at `pos` after any whitespace; None when no JSON
    object starts there. The text is kept as written, so arguments reach the client byte for byte."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    found = json_value_at(text, pos)
    if found is None or not isinstance(found[0], dict):
        return None
    return text[pos:found[1]], found[1]

"""What the tagged call formats of group B share: a reply is reasoning, then content, then one region of calls
opened by one of the family's markers; a family reads only that region, and this module does the rest, so
every family treats the text around its calls, unoffered names and unreadable regions alike."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable

from barreld.engine.callformats.base import (
    Family,
    Parsed,
    ParsedCall,
    dumps,
    raw_json_at,
    skip_space,
    split_reasoning,
)


def first_of(text: str, marks: Iterable[str]) -> int:
    """Where the earliest of `marks` starts in `text`; -1 when none does."""
    found = [i for i in (text.find(mark) for mark in marks) if i >= 0]
    return min(found, default=-1)


def whole_json(text: str) -> str | None:
    """The JSON object that is all of `text`, whitespace aside, as written; None when `text` is anything else."""
    found = raw_json_at(text, 0)
    return found[0] if found and not text[found[1]:].strip() else None


def run(pattern: re.Pattern[str], text: str, pos: int = 0) -> tuple[list[re.Match[str]], int]:
    """The matches of `pattern` that follow each other from `pos`, whitespace between them, and where the last
    one ends (`pos` when none matches)."""
    matches: list[re.Match[str]] = []
    while (match := pattern.match(text, skip_space(text, pos))) is not None:
        matches.append(match)
        pos = match.end()
    return matches, pos


def tiled(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """The matches of `pattern` that make up all of `text`, whitespace aside; None when other text remains."""
    matches, end = run(pattern, text)
    return matches if not text[end:].strip() else None


def invoke_calls(body: str, invoke: re.Pattern[str], parameter: re.Pattern[str],
                 value: Callable[[re.Match[str]], object]) -> list[ParsedCall] | None:
    """The calls of a region written as invokes of named parameters (GLM's <arg_key>, MiniMax's and DeepSeek
    DSML's <invoke>): `invoke` captures a call's name and its parameters' text, `parameter` a parameter's name
    first, and `value` reads a parameter's value from its match. None when `body` is not all such calls."""
    invokes = tiled(invoke, body)
    if not invokes:
        return None
    calls = []
    for call in invokes:
        params = tiled(parameter, call.group(2))
        if params is None:
            return None
        calls.append(ParsedCall(call.group(1), dumps({param.group(1): value(param) for param in params})))
    return calls


def block_calls(block: re.Pattern[str], text: str, start: int, invoke: re.Pattern[str], parameter: re.Pattern[str],
                value: Callable[[re.Match[str]], object]) -> tuple[list[ParsedCall], int] | None:
    """The invokes of the block that `block` matches at `start` (its group `calls` holding them), read as in
    `invoke_calls`, and where the block ends; None when no block of calls starts there."""
    found = block.match(text, start)
    calls = invoke_calls(found.group("calls"), invoke, parameter, value) if found else None
    return (calls, found.end()) if found and calls else None


class RegionFamily(Family):
    """A family whose calls follow the content in one region starting at the first of its `markers`.

    `calls_end_reasoning`: the model may call a tool straight from an unclosed reasoning (Kimi, DeepSeek's
    DSML), so a marker ends the reasoning too, as llama.cpp's parsers for those formats read it."""


    def read_calls(self, text: str, start: int) -> tuple[list[ParsedCall], int] | None:
        """The calls of the region starting at `start` and where the region ends; None when it does not read
        as calls. Each family overrides this with its own layout."""
        return None

    def parse(self, text: str, tools: Collection[str] = (), *, reasoning_open: bool = False) -> Parsed:
        """Reasoning, the content around the call region and the region's calls. A region that does not read
        as calls, or that names a tool not offered, stays content, as a reply without calls would."""
        reasoning, rest = self.split(text, reasoning_open)
        start = first_of(rest, self.markers)
        found = self.read_calls(rest, start) if start >= 0 else None
        if not found or not found[0] or any(tools and call.name not in tools for call in found[0]):
            return Parsed(rest, reasoning)
        calls, end = found
        content = "\n".join(part for part in (rest[:start].strip(), rest[end:].strip()) if part)
        return Parsed(content, reasoning, tuple(calls))

    def split(self, text: str, reasoning_open: bool) -> tuple[str, str]:
        """(reasoning, the rest): the reasoning ends at its closing mark, or at a call marker that comes first
        where `calls_end_reasoning`."""
        cut = first_of(text, self.markers) if self.calls_end_reasoning and self.think else -1
        if cut >= 0 and self.think and self.think[1] not in text[:cut]:
            reasoning, rest = split_reasoning(text[:cut], self.think, reasoning_open)
            if not rest:
                return reasoning, text[cut:]
        return split_reasoning(text, self.think, reasoning_open)

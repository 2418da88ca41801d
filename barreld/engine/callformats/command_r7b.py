"""Cohere Command R7B's format: reasoning between <|START_THINKING|> and <|END_THINKING|>, then either the
answer between <|START_RESPONSE|> and <|END_RESPONSE|> or the calls as a JSON array of
`{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}` between <|START_ACTION|> and <|END_ACTION|>."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from barreld.engine.callformats._a_json import JsonBlocks, Keys
from barreld.engine.callformats.base import Parsed

RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")


class CommandR7B(JsonBlocks):
    name = "command_r7b"
    label = "Cohere Command R7B"
    priority = 30
    markers = ("<|START_ACTION|>", "<|START_RESPONSE|>")  # the answer's wrapper is held back with the calls
    call_end = "<|END_ACTION|>"
    blocks = (("<|START_ACTION|>", "<|END_ACTION|>"),)
    keys = Keys(name="tool_name", args=("parameters",), id="tool_call_id")
    think = ("<|START_THINKING|>", "<|END_THINKING|>")

    def detects(self, template: str) -> bool:
        return "<|START_ACTION|>" in template and RESPONSE[0] in template

    def parse(self, text: str, tools: Collection[str] = (), *, reasoning_open: bool = False) -> Parsed:
        parsed = super().parse(text, tools, reasoning_open=reasoning_open)
        return dataclasses.replace(parsed, content=_unwrapped(parsed.content))


def _unwrapped(content: str) -> str:
    """The answer without the marks around it; text the model wrote outside them stays as it is."""
    opening, closing = RESPONSE
    body = content.strip()
    if not body.startswith(opening):
        return content
    body = body[len(opening):]
    end = body.find(closing)
    return body if end < 0 else body[:end]


FAMILY = CommandR7B()

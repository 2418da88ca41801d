"""MiniMax-M2's calls: a `<minimax:tool_call>` block of `<invoke name="NAME">` elements, each of
`<parameter name="KEY">VALUE</parameter>`, values plain text for strings and JSON for the rest. Reasoning in
<think>, which the generation prompt always opens."""

from __future__ import annotations

import re

from barreld.engine.callformats._b_common import RegionFamily, block_calls
from barreld.engine.callformats.base import ParsedCall, tagged_value

BLOCK = re.compile(r"<minimax:tool_call>(?P<calls>.*?)(?:</minimax:tool_call>|\Z)", re.S)
INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.S)
PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.S)


class MiniMaxM2(RegionFamily):
    name = "minimax_m2"
    label = "MiniMax-M2 <invoke> calls"
    priority = 20
    markers = ("<minimax:tool_call>",)
    call_end = "</minimax:tool_call>"
    think = ("<think>", "</think>")
    bare_values = True

    def detects(self, template: str) -> bool:
        return "<minimax:tool_call>" in template

    def read_calls(self, text: str, start: int) -> tuple[list[ParsedCall], int] | None:
        return block_calls(BLOCK, text, start, INVOKE, PARAMETER, lambda param: tagged_value(param.group(2)))


FAMILY = MiniMaxM2()

"""DeepSeek V3.2's DSML: a `<｜DSML｜function_calls>` block of `<｜DSML｜invoke name="NAME">` elements, each of
`<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`, where string="true" marks a value
written as plain text and "false" one written as JSON. V4 writes the same markup in a `tool_calls` block.
Reasoning in <think>, which the generation prompt opens when thinking is on; a call may end it."""

from __future__ import annotations

import re

from barreld.engine.callformats._b_common import RegionFamily, block_calls
from barreld.engine.callformats.base import ParsedCall, tagged_value

DSML = "｜DSML｜"
BLOCK = re.compile(rf"<{DSML}(function_calls|tool_calls)>(?P<calls>.*?)(?:</{DSML}\1>|\Z)", re.S)
INVOKE = re.compile(rf'<{DSML}invoke name="([^"]+)">(.*?)</{DSML}invoke>', re.S)
PARAMETER = re.compile(rf'<{DSML}parameter name="([^"]+)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


def _value(parameter: re.Match[str]) -> object:
    """A parameter's value: its text where the model marked it a string, else the JSON it wrote."""
    text = parameter.group(3)
    return text if parameter.group(2) == "true" else tagged_value(text)


class DeepSeekV32(RegionFamily):
    name = "deepseek_v3_2"
    label = "DeepSeek DSML invokes"
    priority = 20
    markers = (f"<{DSML}function_calls>", f"<{DSML}tool_calls>")
    call_end = "</｜DSML｜function_calls>"
    think = ("<think>", "</think>")
    calls_end_reasoning = True

    def detects(self, template: str) -> bool:
        return DSML in template

    def read_calls(self, text: str, start: int) -> tuple[list[ParsedCall], int] | None:
        return block_calls(BLOCK, text, start, INVOKE, PARAMETER, _value)


FAMILY = DeepSeekV32()

"""GLM 4.5 to 4.7's calls: `<tool_call>NAME` then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs
(newlines between them in 4.6, none in 4.7) then `</tool_call>`; values are plain text for strings and JSON
for the rest. Reasoning in <think>, which GLM-4.7's generation prompt opens when thinking is on. Spark 2.5 and
Poolside's Laguna write the same layout; Ling 3.0's <role> turns are its own format."""

from __future__ import annotations

import re

from barreld.engine.callformats._b_common import RegionFamily, invoke_calls, run
from barreld.engine.callformats.base import ParsedCall, tagged_value

CALL = re.compile(r"<tool_call>\s*([^\s<]+)(.*?)</tool_call>", re.S)
ARGUMENT = re.compile(r"<arg_key>\s*(.*?)\s*</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm(RegionFamily):
    name = "glm"
    label = "GLM <arg_key>/<arg_value> calls"
    priority = 40
    markers = ("<tool_call>",)
    call_end = "</tool_call>"
    think = ("<think>", "</think>")
    bare_values = True

    def detects(self, template: str) -> bool:
        return "<arg_key>" in template and "<role>ASSISTANT</role>" not in template

    def read_calls(self, text: str, start: int) -> tuple[list[ParsedCall], int] | None:
        _, end = run(CALL, text, start)
        calls = invoke_calls(text[start:end], CALL, ARGUMENT, lambda arg: tagged_value(arg.group(2)))
        return (calls, end) if calls else None


FAMILY = Glm()

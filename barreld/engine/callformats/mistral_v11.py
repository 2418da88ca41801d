"""Mistral's tokenizer v11 on (Small 3.2, Devstral, Magistral, Ministral 3): each call as
`[TOOL_CALLS]NAME[ARGS]{arguments}`, Small 3.2 writing `[CALL_ID]ID` before `[ARGS]`; the reasoning models
think in `[THINK]...[/THINK]` first, and a `[TOOL_CALLS]` inside that reasoning is only reasoning."""

from __future__ import annotations

import re

from barreld.engine.callformats._b_common import RegionFamily
from barreld.engine.callformats.base import ParsedCall, raw_json_at, skip_space

MARKER = "[TOOL_CALLS]"
CALL = re.compile(r"\[TOOL_CALLS\]\s*([^\s\[]+)\s*(?:\[CALL_ID\]\s*([^\s\[]+)\s*)?\[ARGS\]")


class MistralV11(RegionFamily):
    name = "mistral_v11"
    label = "Mistral [TOOL_CALLS]NAME[ARGS] calls"
    priority = 20
    markers = (MARKER,)
    call_end = ""
    think = ("[THINK]", "[/THINK]")

    def detects(self, template: str) -> bool:
        return MARKER in template and "[ARGS]" in template

    def read_calls(self, text: str, start: int) -> tuple[list[ParsedCall], int] | None:
        calls = []
        pos = start
        while (call := CALL.match(text, skip_space(text, pos))) is not None:
            arguments = raw_json_at(text, call.end())
            if arguments is None:
                return None
            calls.append(ParsedCall(call.group(1), arguments[0], call.group(2) or ""))
            pos = arguments[1]
        return calls, pos


FAMILY = MistralV11()

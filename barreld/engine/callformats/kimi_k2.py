"""Moonshot's Kimi K2: `<|tool_calls_section_begin|>`, then each call as
`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{arguments}<|tool_call_end|>`, then
`<|tool_calls_section_end|>`; the call's id is `functions.NAME:IDX`. K2 Thinking reasons in <think> and may
call straight from an unclosed reasoning, leaving out the section and end marks, which llama.cpp accepts."""

from __future__ import annotations

import re

from barreld.engine.callformats._b_common import RegionFamily
from barreld.engine.callformats.base import ParsedCall, raw_json_at, skip_space

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_END = "<|tool_call_end|>"
CALL = re.compile(r"<\|tool_call_begin\|>\s*((?:functions\.)?([^\s<:]+)(?::\d+)?)\s*<\|tool_call_argument_begin\|>")


class KimiK2(RegionFamily):
    name = "kimi_k2"
    label = "Kimi K2 tool-call sections"
    priority = 20
    markers = (SECTION_BEGIN, "<|tool_call_begin|>")
    call_end = "<|tool_calls_section_end|>"
    think = ("<think>", "</think>")
    calls_end_reasoning = True

    def detects(self, template: str) -> bool:
        return SECTION_BEGIN in template

    def read_calls(self, text: str, start: int) -> tuple[list[ParsedCall], int] | None:
        pos = start + len(SECTION_BEGIN) if text.startswith(SECTION_BEGIN, start) else start
        calls = []
        while (call := CALL.match(text, skip_space(text, pos))) is not None:
            arguments = raw_json_at(text, call.end())
            if arguments is None:
                return None
            calls.append(ParsedCall(call.group(2), arguments[0], call.group(1)))
            pos = skip_space(text, arguments[1])
            pos += len(CALL_END) if text.startswith(CALL_END, pos) else 0
        pos = skip_space(text, pos)
        return calls, pos + len(SECTION_END) if text.startswith(SECTION_END, pos) else pos


FAMILY = KimiK2()

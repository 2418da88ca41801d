"""Calls in Qwen3-Coder's XML layout, which Nemotron 3 Nano, Qwen 3.5 and StepFun 3.5 share:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is written bare: the templates write strings as they are and other values with `tojson`. llama.cpp types
a value by the tool's schema; without it a value reads as JSON where it is a JSON number, boolean, null, array
or object, else as the text itself (what llama.cpp does for a parameter whose schema allows a string and
another type). So a string parameter whose value is, say, "12" reads as the number 12."""

from __future__ import annotations

import re
from collections.abc import Collection

from barreld.engine.callformats._a_calls import CallFamily, Calls, offered
from barreld.engine.callformats.base import ParsedCall, dumps, skip_space, split_reasoning, tagged_value

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
PARAMETER_END, FUNCTION_END = "</parameter>", "</function>"


def value_of(text: str) -> object:
    """A parameter's value from the text between its tags, less the newline the layout puts at each end."""
    return tagged_value(text.removeprefix("\n").removesuffix("\n"))


def xml_call(text: str, pos: int, tools: Collection[str]) -> Calls | None:
    """The call at `pos` (after whitespace) and where it ends. Its <tool_call> may be missing, as Qwen3-Coder
    models sometimes leave it out; its </tool_call> too, at the very end of the reply."""
    pos = skip_space(text, pos)
    if text.startswith(OPEN, pos):
        pos = skip_space(text, pos + len(OPEN))
    function = FUNCTION.match(text, pos)
    if function is None or not offered(function[1], tools):
        return None
    args: dict[str, object] = {}
    pos = function.end()
    while (parameter := PARAMETER.match(text, skip_space(text, pos))) is not None:
        end = text.find(PARAMETER_END, parameter.end())
        if end < 0:
            return None
        args[parameter[1]] = value_of(text[parameter.end():end])
        pos = end + len(PARAMETER_END)
    pos = skip_space(text, pos)
    if not text.startswith(FUNCTION_END, pos):
        return None
    pos = skip_space(text, pos + len(FUNCTION_END))
    if text.startswith(CLOSE, pos):
        pos += len(CLOSE)
    elif pos < len(text):
        return None
    return (ParsedCall(function[1], dumps(args)),), pos


def writes_xml_calls(template: str) -> bool:
    """Whether a chat template writes its calls in this layout (its instructions show the layout, and the
    Qwen-style turns it writes them in tell it apart from Seed-OSS's)."""
    return all(mark in template for mark in ("<|im_start|>", OPEN, "<function=", "<parameter=", FUNCTION_END))


class XmlCalls(CallFamily):
    """A family writing calls in the XML layout. A call ends the reasoning it opens in, as llama.cpp reads
    these templates (the model may start calling without closing its thinking)."""

    markers = (OPEN,)
    call_end = "</tool_call>"
    calls_end_reasoning = True
    bare_values = True

    def split(self, text: str, reasoning_open: bool) -> tuple[str, str]:
        cut = text.find(OPEN)
        cut = len(text) if cut < 0 else cut
        reasoning, rest = split_reasoning(text[:cut], self.think, reasoning_open)
        return reasoning, rest + text[cut:]

    def read(self, text: str, pos: int, tools: Collection[str]) -> Calls | None:
        return xml_call(text, pos, tools)

"""Qwen3-Coder's format: XML calls (see _a_xml), without reasoning. Its models sometimes leave out the first
<tool_call>, so a bare <function= starts a call too."""

from __future__ import annotations

from barreld.engine.callformats._a_xml import OPEN, XmlCalls, writes_xml_calls


class Qwen3Coder(XmlCalls):
    name = "qwen3_coder"
    label = "Qwen3-Coder"
    priority = 40
    markers = (OPEN, "<function=")

    def detects(self, template: str) -> bool:
        return writes_xml_calls(template) and "<think>" not in template


FAMILY = Qwen3Coder()

"""IBM Granite's formats: Granite 4 writes Hermes' <tool_call> JSON objects, Granite 3.3 a JSON array of calls
after <|tool_call|>; both reason between <think> and </think> when asked to."""

from __future__ import annotations

from barreld.engine.callformats._a_json import JsonBlocks


class Granite(JsonBlocks):
    name = "granite"
    label = "IBM Granite"
    priority = 40
    markers = ("<tool_call>", "<|tool_call|>")
    call_end = "</tool_call>"
    blocks = (("<tool_call>", "</tool_call>"), ("<|tool_call|>", ""))
    think = ("<think>", "</think>")

    def detects(self, template: str) -> bool:
        return "<|start_of_role|>" in template and any(mark in template for mark in self.markers)


FAMILY = Granite()

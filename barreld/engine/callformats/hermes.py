"""Hermes 2 Pro's format, which Hermes 3, Qwen 2.5, QwQ, Qwen 3 and MiMo-VL keep: each call a JSON object
`{"name": ..., "arguments": {...}}` between <tool_call> and </tool_call>, several in a row for parallel calls;
the Qwen thinking models reason between <think> and </think> (QwQ's prompt opens it)."""

from __future__ import annotations

from barreld.engine.callformats._a_json import JsonBlocks


class Hermes(JsonBlocks):
    name = "hermes"
    label = "Hermes 2 Pro / Qwen 2.5 / Qwen 3"
    priority = 90  # the layout other formats build on: the families that add to it are tried first
    markers = ("<tool_call>",)
    call_end = "</tool_call>"
    blocks = (("<tool_call>", "</tool_call>"),)
    think = ("<think>", "</think>")

    def detects(self, template: str) -> bool:
        return all(mark in template for mark in ("<|im_start|>", "<tool_call>", '"arguments"'))


FAMILY = Hermes()

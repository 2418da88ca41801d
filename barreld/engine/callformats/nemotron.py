"""NVIDIA Nemotron Nano v2's format: the calls as one JSON array `[{"name": ..., "arguments": {...}}, ...]`
between <TOOLCALL> and </TOOLCALL>, after reasoning between <think> and </think> (the prompt opens it unless
the conversation says /no_think)."""

from __future__ import annotations

from barreld.engine.callformats._a_json import JsonBlocks


class Nemotron(JsonBlocks):
    name = "nemotron"
    label = "NVIDIA Nemotron Nano v2"
    priority = 30
    markers = ("<TOOLCALL>",)
    call_end = "</TOOLCALL>"
    blocks = (("<TOOLCALL>", "</TOOLCALL>"),)
    think = ("<think>", "</think>")

    def detects(self, template: str) -> bool:
        return "<TOOLCALL>" in template and "<SPECIAL_11>" in template


FAMILY = Nemotron()

"""NVIDIA Nemotron 3 Nano's format, which Qwen 3.5 and StepFun 3.5 share: Qwen3-Coder's XML calls (see
_a_xml) after reasoning between <think> and </think>, which the prompt opens when thinking is on."""

from __future__ import annotations

from barreld.engine.callformats._a_xml import XmlCalls, writes_xml_calls


class Nemotron3(XmlCalls):
    name = "nemotron3"
    label = "NVIDIA Nemotron 3 / Qwen 3.5 (XML calls, thinking)"
    priority = 40
    think = ("<think>", "</think>")

    def detects(self, template: str) -> bool:
        return writes_xml_calls(template) and "<think>" in template


FAMILY = Nemotron3()

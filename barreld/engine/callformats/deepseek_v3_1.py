"""DeepSeek V3.1: `NAME<｜tool▁sep｜>{arguments}` inside DeepSeek's call region; reasoning in <think>, which the
generation prompt opens when thinking is on (and closes at once when it is off)."""

from __future__ import annotations

from barreld.engine.callformats._b_common import whole_json
from barreld.engine.callformats._b_deepseek import DeepSeekFamily
from barreld.engine.callformats.base import ParsedCall


class DeepSeekV31(DeepSeekFamily):
    name = "deepseek_v3_1"
    label = "DeepSeek V3.1 tool calls"
    priority = 30

    def detects(self, template: str) -> bool:
        """V3.1's template writes the arguments bare after the separator; R1's fence them."""
        return super().detects(template) and "```json" not in template

    def read_call(self, head: str, tail: str) -> ParsedCall | None:
        arguments = whole_json(tail)
        return ParsedCall(head.strip(), arguments) if head.strip() and arguments is not None else None


FAMILY = DeepSeekV31()

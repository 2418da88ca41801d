"""DeepSeek R1 (and its distills): `function<｜tool▁sep｜>NAME` then the arguments in a ```json fence, inside
DeepSeek's call region; reasoning in <think>, which the templates' generation prompt opens."""

from __future__ import annotations

from barreld.engine.callformats._b_common import whole_json
from barreld.engine.callformats._b_deepseek import DeepSeekFamily
from barreld.engine.callformats.base import ParsedCall


class DeepSeekR1(DeepSeekFamily):
    name = "deepseek_r1"
    label = "DeepSeek R1 tool calls (fenced JSON)"
    priority = 30

    def detects(self, template: str) -> bool:
        """R1's templates fence the arguments; V3.1's write them bare after the separator."""
        return super().detects(template) and "```json" in template

    def read_call(self, head: str, tail: str) -> ParsedCall | None:
        name, _, arguments = tail.partition("\n")
        arguments = whole_json(arguments.strip().removeprefix("```json").removesuffix("```"))
        return ParsedCall(name.strip(), arguments) if name.strip() and arguments is not None else None


FAMILY = DeepSeekR1()

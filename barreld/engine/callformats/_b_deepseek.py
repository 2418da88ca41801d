"""DeepSeek's call region before DSML (R1 and V3.1): `<｜tool▁calls▁begin｜>`, then each call between
`<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>` with a `<｜tool▁sep｜>` in it, then `<｜tool▁calls▁end｜>`. The
generations differ only in what stands either side of the separator, which each family's module reads."""

from __future__ import annotations

from barreld.engine.callformats._b_common import RegionFamily
from barreld.engine.callformats.base import ParsedCall, skip_space

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class DeepSeekFamily(RegionFamily):
    markers = (CALLS_BEGIN, CALL_BEGIN)
    call_end = "<｜tool▁calls▁end｜>"
    think = ("<think>", "</think>")

    def read_call(self, head: str, tail: str) -> ParsedCall | None:
        """A call from the text before and after its separator; None when it does not read as one."""
        return None

    def detects(self, template: str) -> bool:
        return CALLS_BEGIN in template and SEP in template

    def read_calls(self, text: str, start: int) -> tuple[list[ParsedCall], int] | None:
        """The calls from `start`; the section's opening and closing marks may be missing, and so may the last
        call's end mark when the reply stops there."""
        pos = start + len(CALLS_BEGIN) if text.startswith(CALLS_BEGIN, start) else start
        calls = []
        while text.startswith(CALL_BEGIN, pos := skip_space(text, pos)):
            end = text.find(CALL_END, pos)
            head, sep, tail = text[pos + len(CALL_BEGIN):end if end >= 0 else len(text)].partition(SEP)
            call = self.read_call(head, tail) if sep else None
            if call is None:
                return None
            calls.append(call)
            pos = end + len(CALL_END) if end >= 0 else len(text)
        if text.startswith(CALLS_END, pos):
            pos += len(CALLS_END)
        return calls, pos

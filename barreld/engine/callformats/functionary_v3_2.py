"""MeetKai Functionary v3.2's format: the reply is a run of messages, each `>>>RECIPIENT\n` then its body;
`all` is the answer, any other recipient a call to that tool with a JSON object as its arguments (`python`
may get raw code instead). The prompt ends with the first `>>>`, so a reply starts with its recipient."""

from __future__ import annotations

import re
from collections.abc import Collection

from barreld.engine.callformats._a_calls import offered
from barreld.engine.callformats.base import Family, Parsed, ParsedCall, dumps, raw_json_at

SEPARATOR = ">>>"
RECIPIENT = re.compile(r"([\w.-]+)\n")


class FunctionaryV32(Family):
    name = "functionary_v3_2"
    label = "Functionary v3.2"
    priority = 30
    markers = (SEPARATOR,)
    call_end = ""
    recipient_first = True

    def detects(self, template: str) -> bool:
        return ">>>all" in template and ">>>${recipient}" in template

    def parse(self, text: str, tools: Collection[str] = (), *, reasoning_open: bool = False) -> Parsed:
        """Each message in turn; a reply in which one does not read (no recipient, a tool not offered,
        arguments that are not JSON) is all content."""
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = len(SEPARATOR) if text.startswith(SEPARATOR) else 0
        while pos < len(text):
            recipient = RECIPIENT.match(text, pos)
            if recipient is None or not (recipient[1] == "all" or offered(recipient[1], tools)):
                return Parsed(text)
            pos = recipient.end()
            if recipient[1] == "all":
                end = _next_message(text, pos)
                content.append(text[pos:end])
                pos = end + len(SEPARATOR)
                continue
            args = raw_json_at(text, pos)
            end = _next_message(text, pos if args is None else args[1])
            if args is not None and not text[args[1]:end].strip():
                calls.append(ParsedCall(recipient[1], args[0]))
            elif recipient[1] == "python":
                calls.append(ParsedCall("python", dumps({"code": text[pos:end]})))
            else:
                return Parsed(text)
            pos = end + len(SEPARATOR)
        return Parsed("".join(content), "", tuple(calls))


def _next_message(text: str, pos: int) -> int:
    """Where the message after `pos` starts (its `>>>`), or the reply's end."""
    end = text.find(SEPARATOR, pos)
    return len(text) if end < 0 else end


FAMILY = FunctionaryV32()

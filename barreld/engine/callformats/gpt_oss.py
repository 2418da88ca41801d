"""OpenAI gpt-oss's harmony format: a reply is a run of messages, each a header naming its channel (and, for a
call, its recipient) then `<|message|>` and a body. The analysis channel is reasoning, final and commentary
are content, and a message addressed `to=functions.NAME` is a call whose body is its JSON arguments."""

from __future__ import annotations

import re
from collections.abc import Collection

from barreld.engine.callformats._b_common import first_of, whole_json
from barreld.engine.callformats.base import Family, Parsed, ParsedCall

START = "<|start|>"
MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL = re.compile(r"<\|channel\|>(\w+)")
FUNCTIONS = "functions."


class GptOss(Family):
    name = "gpt_oss"
    label = "harmony channels (gpt-oss)"
    priority = 10
    # A call's recipient, and the headers of the messages after the analysis: a stream shows none of them (the
    # final channel's text comes whole, once the reply is read).
    markers = (" to=functions.", "<|channel|>", "<|start|>")
    call_end = "<|call|>"
    think = ("<|channel|>analysis<|message|>", "<|end|>")

    def detects(self, template: str) -> bool:
        return "<|channel|>" in template and MESSAGE in template

    def parse(self, text: str, tools: Collection[str] = (), *, reasoning_open: bool = False) -> Parsed:
        """The reply read after the generation prompt `<|start|>assistant` (a reply may go on with that role's
        header, ` to=functions.NAME`). A message to any other recipient (a builtin tool such as `python`, or a
        function not offered, or one whose arguments are not JSON) is dropped, as llama.cpp drops it: its body
        is for no reader. A stray header before the real one (`<|channel|>commentary to=assistant`) is ignored:
        the last channel of a header is the message's."""
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ParsedCall] = []
        opening = "<|start|>assistant" + (self.think[0] if reasoning_open and self.think else "")
        for message in (opening + text).split(START):
            header, found, body = message.partition(MESSAGE)
            if not found:
                continue
            end = first_of(body, ENDS)
            body = body[:end] if end >= 0 else body
            recipient = RECIPIENT.search(header)
            if recipient and recipient.group(1) != "assistant":
                target = recipient.group(1)
                name = target.removeprefix(FUNCTIONS)
                arguments = whole_json(body)
                if target.startswith(FUNCTIONS) and arguments is not None and (not tools or name in tools):
                    calls.append(ParsedCall(name, arguments))
                continue
            channels = CHANNEL.findall(header)
            (reasoning if channels and channels[-1] == "analysis" else content).append(body.strip())
        return Parsed("\n".join(filter(None, content)), "\n".join(filter(None, reasoning)), tuple(calls))


FAMILY = GptOss()

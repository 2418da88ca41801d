"""llama.cpp's parse cases again, streamed: each model output fed to the reply reader a character at a time, as the
worker hands tokens over, for the family its real template is read as. A stream never shows a thought marker or a
call's text, and its finish holds what the whole reply parses to."""

from __future__ import annotations

import json

import pytest

from barreld.engine.callformats import family_of
from barreld.engine.chat import Message
from barreld.engine.reply import Finish, ReasoningDelta, ReplyReader, TextDelta
from barreld.engine.request import CacheReport, CompletionParams, Done, Started, Timings, Token
from barreld.engine.tools import tool, tool_spec
from tests.support.llama_sources import template
from tests.unit.test_chat_parse_cases import _cases

ANY_OBJECT = {"type": "object"}


def streamed(family: object, case: dict, prompt: str) -> tuple[str, str, Finish]:
    """(the text shown, the reasoning shown, the finish) of the case's output, streamed."""
    tools = tool_spec([tool(name, None, ANY_OBJECT, "t") for name in case.get("tools", ())]) if case.get("tools") \
        else None
    params = CompletionParams(prompt=b"", messages=(Message("user", "x"),), tools=tools)
    reader = ReplyReader(params, family)  # type: ignore[arg-type]
    events = reader.read(Started(CacheReport(), 1, b"p"), prompt.encode())
    for ch in case["output"]:
        events += reader.read(Token(ch.encode()))
    done = Done(case["output"].encode(), "stop", b"k", b"p", CacheReport(), 1, 1, Timings())
    events += reader.finish(done, prompt.encode(), lambda p: b"")
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    thought = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    finish = events[-1]
    assert isinstance(finish, Finish)
    return text, thought, finish


@pytest.mark.parametrize(("template_name", "family", "case"), _cases())
def test_a_streamed_reply_shows_no_marker_and_finishes_as_it_parses(template_name: str, family: str,
                                                                    case: dict) -> None:
    fam = family_of(template(template_name))
    opening = fam.think[0] if fam.think and case.get("reasoning_open") else ""
    text, thought, finish = streamed(fam, case, "prompt" + opening)
    expect = case["expect"]
    assert finish.content.strip() == text.strip() == expect.get("content", "").strip()
    assert finish.reasoning.strip() == thought.strip() == expect.get("reasoning", "").strip()
    assert [(c.name, json.loads(c.arguments)) for c in finish.calls] == \
        [(c["name"], c["arguments"]) for c in expect.get("tool_calls", [])]

"""Whether a reply that called tools, resent in the history as a route's clients resend it, renders to the bytes
it was generated from (`barrel.prefix_kept`), as the engine's reply reader decides it: OpenAI's clients keep the
model's arguments text, Anthropic's send an object back, so arguments the model wrote in another spacing no
longer match."""

from __future__ import annotations

import dataclasses

import pytest

from barreld.engine.callformats import GENERIC
from barreld.engine.chat import render
from barreld.engine.reply import Echo, Finish, ReplyReader, resent
from barreld.engine.request import CompletionParams, Done, Token
from barreld.http.anthropic import parse_messages
from barreld.http.openai import parse_request
from tests.unit.test_tool_formats import smollm2_template

TOOL = {"name": "get_weather", "description": "The weather now",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
FUNCTION = {"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                             "parameters": TOOL["input_schema"]}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
TEMPLATE = smollm2_template()


def rendered(p: CompletionParams) -> bytes:
    return render(TEMPLATE, p.messages, bos="", eos="", model="m", tools=p.tools)


def finish(params: CompletionParams, reply: str, echo: Echo) -> Finish:
    reader = ReplyReader(params, GENERIC, echo=echo)
    reader.read(Token(reply.encode()))
    done = Done(reply.encode(), "stop", b"k", b"p", None, 10, 5, None)  # type: ignore[arg-type]
    last = reader.finish(done, rendered(params), rendered)[-1]
    assert isinstance(last, Finish)
    return last


@pytest.mark.parametrize(("reply", "openai", "anthropic"), [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True, True),  # as json.dumps writes it
    ('{"name": "get_weather", "arguments": {"city":"Oslo"}}', True, False),  # another spacing: only text survives
    ("Just text.", None, None),  # no call: nothing to check
])
def test_a_tool_reply_keeps_the_prefix_when_it_comes_back_as_it_was_written(reply: str, openai: bool | None,
                                                                            anthropic: bool | None) -> None:
    as_openai = parse_request({"model": "m", "messages": ASK, "tools": [FUNCTION]}, chat=True).call
    assert as_openai.echo is Echo.TEXT
    assert finish(as_openai.params(4096), reply, as_openai.echo).prefix_kept is openai
    as_anthropic = parse_messages({"model": "m", "max_tokens": 8, "messages": ASK, "tools": [TOOL]})
    assert as_anthropic.echo is Echo.OBJECT
    assert finish(as_anthropic.params(4096), reply, as_anthropic.echo).prefix_kept is anthropic


def test_a_call_resent_as_an_object_reads_back_as_any_tool_use_block_does() -> None:
    body = {"model": "m", "max_tokens": 8, "tools": [TOOL], "messages": [
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                 "input": {"city": "Oslo"}}]}]}
    read = parse_messages(body).messages[-1].tool_calls[0]
    assert resent(dataclasses.replace(read, arguments='{"city":"Oslo"}'), Echo.OBJECT) == read

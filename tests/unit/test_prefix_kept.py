"""Whether a reply that called tools, resent in the history as a route's clients resend it, renders to the bytes
it was generated from (`barrel.prefix_kept`): the OpenAI route keeps the model's arguments text, Anthropic's
clients send an object back, so arguments the model wrote in another spacing no longer match."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from barreld.engine.chat import render
from barreld.engine.request import CompletionParams, Done
from barreld.http.anthropic import parse_messages, resent_tool_use
from barreld.http.app import prefix_kept
from barreld.http.openai import parse_request
from tests.unit.test_tool_formats import smollm2_template

TOOL = {"name": "get_weather", "description": "The weather now",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
FUNCTION = {"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                             "parameters": TOOL["input_schema"]}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def model() -> SimpleNamespace:
    template = smollm2_template()

    def rendered(p: CompletionParams) -> bytes:
        return render(template, p.messages, bos="", eos="", model="m", tools=p.tools)

    return SimpleNamespace(options=SimpleNamespace(n_ctx=4096), worker=SimpleNamespace(render=rendered))


def done(text: str) -> Done:
    return Done(text.encode(), "stop", b"k", b"p", None, 10, 5, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("reply", "openai", "anthropic"), [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True, True),  # as json.dumps writes it
    ('{"name": "get_weather", "arguments": {"city":"Oslo"}}', True, False),  # another spacing: only text survives
    ("Just text.", None, None),  # no call: nothing to check
])
def test_a_tool_reply_keeps_the_prefix_when_it_comes_back_as_it_was_written(reply: str, openai: bool | None,
                                                                            anthropic: bool | None) -> None:
    m = model()
    as_openai = parse_request({"model": "m", "messages": ASK, "tools": [FUNCTION]}, chat=True)
    prompt = m.worker.render(as_openai.params(4096))
    assert prefix_kept(m, as_openai, prompt, done(reply), lambda c: c) is openai
    as_anthropic = parse_messages({"model": "m", "max_tokens": 8, "messages": ASK, "tools": [TOOL]})
    prompt = m.worker.render(as_anthropic.params(4096))
    assert prefix_kept(m, as_anthropic, prompt, done(reply), resent_tool_use) is anthropic


def test_a_call_resent_through_anthropic_reads_back_as_any_tool_use_block_does() -> None:
    body = {"model": "m", "max_tokens": 8, "tools": [TOOL], "messages": [
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                 "input": {"city": "Oslo"}}]}]}
    read = parse_messages(body).messages[-1].tool_calls[0]
    assert resent_tool_use(dataclasses.replace(read, arguments='{"city":"Oslo"}')) == read

"""OpenAI tool calls with the real `openai` SDK on the bundled model, whose template knows no tools (the
generic format): a forced call validates against its tool's schema, a three-turn conversation restores each
earlier prompt, streamed and not, and bad tool requests are refused in OpenAI's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.support.sandbox import Sandbox
from tests.test_cache_paths import CHUNK, POLICY, doc
from tests.test_http import MODEL, Daemon

pytestmark = pytest.mark.model

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
SYSTEM = {"role": "system", "content": "You help travellers. Notes: " + doc(7, 300)}


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Sandbox.new(POLICY + MODEL, label="tools") as box:
        yield Daemon(box)


def ask(client: openai.OpenAI, messages: list, choice: object, stream: bool) -> tuple[dict, str, int, int]:
    """(the assistant message as history takes it, the finish reason, prompt tokens, cached tokens)."""
    args = {"model": "smollm2", "messages": messages, "tools": TOOLS, "tool_choice": choice, "max_tokens": 60,
            "temperature": 0}
    if not stream:
        r = client.chat.completions.create(**args)
        message = r.choices[0].message.model_dump(exclude_none=True)
        return message, r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id:  # the id and name come first, the arguments after
                    assert d.index not in calls and d.function.name
                    calls[d.index] = {"id": d.id, "type": "function",
                                      "function": {"name": d.function.name, "arguments": ""}}
                calls[d.index]["function"]["arguments"] += d.function.arguments or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def check_calls(message: dict) -> list[dict]:
    """Every call names an offered tool and its arguments validate against that tool's schema."""
    calls = message.get("tool_calls", [])
    for call in calls:
        assert call["id"] and call["type"] == "function"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    return calls


def answer(message: dict) -> list[dict]:
    """The tool results for each call the message made."""
    return [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"temperature": 21, "sky": "clear"})}
            for c in check_calls(message)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_three_turn_tool_conversation_parses_validates_and_restores_each_earlier_prompt(
    daemon: Daemon, stream: bool
) -> None:
    client = daemon.sdk()
    messages = [SYSTEM, {"role": "user", "content": f"What is the weather in Paris? ({stream})"}]
    message, finish, prompt1, _ = ask(client, messages, "required", stream)
    assert finish == "tool_calls" and len(check_calls(message)) == 1
    assert message.get("content") is None
    messages += [message, *answer(message)]
    message, finish, prompt2, cached2 = ask(client, messages, "auto", stream)
    assert cached2 >= prompt1 - CHUNK
    assert finish == ("tool_calls" if check_calls(message) else "stop")
    messages += [message, *answer(message), {"role": "user", "content": "And what time is it in Rome?"}]
    message, finish, _, cached3 = ask(client, messages, "auto", stream)
    assert cached3 >= prompt2 - CHUNK
    check_calls(message)


def test_a_named_tool_choice_calls_that_tool(daemon: Daemon) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Weather in Oslo, please."}]
    choice = {"type": "function", "function": {"name": "get_time"}}
    message, finish, _, _ = ask(daemon.sdk(), messages, choice, False)
    assert finish == "tool_calls"
    assert [c["function"]["name"] for c in check_calls(message)] == ["get_time"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_resent_as_given_keeps_the_prefix_and_the_reply_says_so(daemon: Daemon, stream: bool) -> None:
    args = {"model": "smollm2", "messages": [SYSTEM, {"role": "user", "content": f"Time in Rome? ({stream})"}],
            "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 0}
    if stream:
        chunks = list(daemon.sdk().chat.completions.create(**args, stream=True))
        barrel = chunks[-1].model_extra["barrel"]
    else:
        barrel = daemon.sdk().chat.completions.create(**args).model_extra["barrel"]
    assert barrel["prefix_kept"] is True  # the generic format renders a call back as the model wrote it
    plain = daemon.sdk().chat.completions.create(model="smollm2", messages=args["messages"], max_tokens=4)
    assert "prefix_kept" not in plain.model_extra["barrel"]  # checked only for replies that called tools


def test_tool_choice_none_answers_in_text(daemon: Daemon) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Say hello."}]
    message, finish, _, _ = ask(daemon.sdk(), messages, "none", False)
    assert "tool_calls" not in message and message["content"] and finish in ("stop", "length")


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "parameters schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "parameters schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": TOOLS, "messages": [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "no earlier assistant message made"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "arguments must be a JSON object"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text parts"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
]


@pytest.mark.parametrize(("extra", "says"), BAD, ids=["schema-list", "schema-string", "unknown-choice",
                                                      "unknown-call-id", "bad-arguments", "image",
                                                      "forced-and-format"])
def test_bad_tool_requests_are_400_and_the_daemon_serves_on(daemon: Daemon, extra: dict, says: str) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    status, reply = daemon.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    assert says in reply["error"]["message"]
    ok = daemon.sdk().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
    assert ok.usage.completion_tokens == 2

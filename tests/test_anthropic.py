"""Anthropic's Messages API with the real `anthropic` SDK on the bundled model, reached by an alias for the
names Claude Code sends: create and stream, with and without tools, count_tokens, errors in Anthropic's shape,
and a conversation whose later turns restore the earlier ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import jsonschema
import pytest

from tests.support.sandbox import Sandbox
from tests.test_cache_paths import CHUNK, POLICY, doc
from tests.test_http import Daemon

pytestmark = pytest.mark.model

MODEL = '\n[[models]]\nname = "smollm2"\naliases = ["claude-*"]\n'
NAME = "claude-opus-5-5"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city now", "input_schema": WEATHER,
          "cache_control": {"type": "ephemeral"}}]
SYSTEM = [{"type": "text", "text": "You help travellers."},
          {"type": "text", "text": "Notes: " + doc(11, 300), "cache_control": {"type": "ephemeral"}}]
IGNORED = {"metadata": {"user_id": "u"}, "thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Sandbox.new(POLICY + MODEL, label="anthropic") as box:
        yield Daemon(box)


def sdk(d: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.base, api_key="unused", max_retries=0)


def test_create_answers_in_text_with_usage_and_a_stop_reason(daemon: Daemon) -> None:
    reply = sdk(daemon).messages.create(model=NAME, max_tokens=8, system=SYSTEM,
                                        messages=[{"role": "user", "content": "Say hello."}], **IGNORED)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "smollm2"
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens <= 8
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 300


def test_a_stop_sequence_is_reported_as_the_stop_reason(daemon: Daemon) -> None:
    reply = sdk(daemon).messages.create(model=NAME, max_tokens=40, stop_sequences=["zzz", "e"],
                                        messages=[{"role": "user", "content": "Describe the sea."}])
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "e") and "e" not in reply.content[0].text


def test_max_tokens_beyond_the_context_is_a_cap(daemon: Daemon) -> None:
    reply = sdk(daemon).messages.create(model=NAME, max_tokens=20000,  # above n_ctx; the SDK wants a stream beyond
                                        extra_body={"temperature": 0.5, "top_k": 1, "top_p": 0.9},
                                        messages=[{"role": "user", "content": "Say hi."}])
    assert reply.stop_reason in ("end_turn", "max_tokens")


def test_the_stream_carries_the_same_text_as_create(daemon: Daemon) -> None:
    args = {"model": NAME, "max_tokens": 16, "system": SYSTEM,
            "messages": [{"role": "user", "content": "Name three rivers."}]}
    whole = sdk(daemon).messages.create(**args)
    with sdk(daemon).messages.stream(**args) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason


def ask(client: anthropic.Anthropic, messages: list, choice: dict, stream: bool) -> anthropic.types.Message:
    args = {"model": NAME, "max_tokens": 60, "system": SYSTEM, "tools": TOOLS,
            "tool_choice": choice, "messages": messages}
    if not stream:
        return client.messages.create(**args)
    with client.messages.stream(**args) as s:
        return s.get_final_message()


def history(reply: anthropic.types.Message) -> list[dict]:
    """The reply as the next request sends it back, and a result for each tool_use."""
    blocks = [b.model_dump(exclude_none=True) for b in reply.content]
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": [{"type": "text", "text": "21 C, clear"}]}
               for b in reply.content if b.type == "tool_use"]
    return [{"role": "assistant", "content": blocks}, {"role": "user", "content": results or "Thanks."}]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_tool_conversation_calls_validates_and_is_warm_on_later_turns(daemon: Daemon, stream: bool) -> None:
    client = sdk(daemon)
    messages = [{"role": "user", "content": f"What is the weather in Lima? ({stream})"}]
    first = ask(client, messages, {"type": "any"}, stream)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    assert stream or isinstance(first.model_extra["barrel"]["prefix_kept"], bool)  # input resent as an object
    jsonschema.validate(uses[0].input, WEATHER)
    prompt1 = first.usage.input_tokens + first.usage.cache_read_input_tokens
    messages += history(first)
    second = ask(client, messages, {"type": "auto"}, stream)
    assert second.usage.cache_read_input_tokens >= prompt1 - CHUNK
    for b in second.content:
        if b.type == "tool_use":
            jsonschema.validate(b.input, WEATHER)
    assert client.messages.count_tokens(model=NAME, system=SYSTEM, tools=TOOLS, messages=messages).input_tokens \
        == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_a_named_tool_is_called_and_none_answers_in_text(daemon: Daemon) -> None:
    messages = [{"role": "user", "content": "Hello there."}]
    named = ask(sdk(daemon), messages, {"type": "tool", "name": "get_weather"}, False)
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]
    plain = ask(sdk(daemon), messages, {"type": "none"}, False)
    assert [b.type for b in plain.content] == ["text"] and plain.stop_reason != "tool_use"


BAD = [
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "type object"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
     "no earlier assistant message made"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x",
                                                                                "media_type": "image/png"}}]}]},
     "image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "cannot hold a block of type 'tool_use'"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "must be {role"),
]


@pytest.mark.parametrize(("extra", "says"), BAD, ids=["schema", "unknown-tool", "unknown-result", "image",
                                                      "misplaced-block", "bad-role"])
def test_bad_requests_are_400_in_anthropics_shape_and_the_daemon_serves_on(
    daemon: Daemon, extra: dict, says: str
) -> None:
    body = {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
    status, reply = daemon.request("POST", "/v1/messages?beta=true", json.dumps(body).encode())
    assert status == 400 and reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert says in reply["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match=says[:20]):
        sdk(daemon).messages.create(**body)
    assert sdk(daemon).messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_an_unknown_model_is_404_in_anthropics_shape(daemon: Daemon) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        sdk(daemon).messages.create(model="gpt-4o", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error"

"""OpenAI's Responses API with the real `openai` SDK on the bundled model through a real barreld: a forced function
call, its output and the answer, streamed and not; `responses.parse` into a Pydantic model; each later call warm,
whether it resends the whole history or names `previous_response_id` with only its new item, and the latter
also after a restart; stored responses read and deleted; errors in OpenAI's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support.sandbox import Sandbox
from tests.test_cache_paths import CHUNK, POLICY, doc
from tests.test_http import MODEL, Daemon

pytestmark = pytest.mark.model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city now",
          "parameters": WEATHER},
         {"type": "web_search", "external_web_access": False}]  # hosted: left out, never refused
INSTRUCTIONS = "You help travellers. Notes: " + doc(7, 300)
ASK = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]}]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Sandbox.new(POLICY + MODEL, label="responses") as box:
        yield Daemon(box)


def create(client: openai.OpenAI, items: list, choice: object = "auto", **extra: object):
    return client.responses.create(model="smollm2", instructions=INSTRUCTIONS, input=items, tools=TOOLS,
                                   tool_choice=choice, max_output_tokens=40, temperature=0, **extra)


def outputs(call: dict) -> list[dict]:
    """The history items that answer a function call: the call as it came, then its output."""
    return [call, {"type": "function_call_output", "call_id": call["call_id"], "output": "12 C, light rain"}]


def call_item(response) -> dict:
    calls = [o for o in response.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", response.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    return {k: v for k, v in calls[0].model_dump().items() if k in ("type", "call_id", "name", "arguments")}


def test_a_forced_call_its_output_and_the_answer_each_call_warm(daemon: Daemon) -> None:
    client = daemon.sdk()
    first = create(client, ASK, "required")
    assert first.status == "completed" and first.usage.input_tokens > 300
    assert first.model_extra["barrel"]["tools_left_out"] == ["web_search"]
    call = call_item(first)
    second = create(client, [*ASK, *outputs(call)])  # the whole history again, tool_choice auto
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - CHUNK, second.usage
    assert second.output_text and not [o for o in second.output if o.type == "function_call"]
    assert second.usage.total_tokens == second.usage.input_tokens + second.usage.output_tokens


def test_the_stream_sends_openais_events_in_order_and_ends_with_the_whole_response(daemon: Daemon) -> None:
    client = daemon.sdk()
    with client.responses.stream(model="smollm2", instructions=INSTRUCTIONS, input=ASK, tools=TOOLS,
                                 tool_choice="required", max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta") \
        < kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    call = call_item(final)
    whole = create(client, ASK, "required")
    assert call_item(whole)["arguments"] == call["arguments"]  # streamed or not, the same greedy reply
    with client.responses.stream(model="smollm2", instructions=INSTRUCTIONS, input=[*ASK, *outputs(call)],
                                 tools=TOOLS, max_output_tokens=40, temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        answer = stream.get_final_response()
    assert text == answer.output_text and text
    assert answer.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens - CHUNK


def test_a_continuation_with_only_its_new_item_is_as_warm_as_a_resend(daemon: Daemon) -> None:
    client = daemon.sdk()
    first = create(client, ASK, "required", store=True)
    call = call_item(first)
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and call_item(again) == call
    follow = create(client, outputs(call)[1:], previous_response_id=first.id)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - CHUNK, follow.usage
    resend = create(client, [*ASK, *outputs(call)])
    assert resend.usage.input_tokens == follow.usage.input_tokens  # the same conversation either way
    assert resend.output_text == follow.output_text
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError) as gone:
        create(client, outputs(call)[1:], previous_response_id=first.id)
    assert gone.value.body["code"] == "previous_response_not_found"


class City(BaseModel):
    name: str
    country: str


def test_parse_fills_a_pydantic_model_through_the_schema_grammar(daemon: Daemon) -> None:
    parsed = daemon.sdk().responses.parse(model="smollm2", input="Name a city in Norway, as JSON.",
                                          text_format=City, max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


def test_bad_input_is_a_400_an_unknown_response_a_404_and_a_cap_is_incomplete(daemon: Daemon) -> None:
    client = daemon.sdk()
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]
    orphan = [*ASK, {"type": "function_call_output", "call_id": "call_nobody", "output": "x"}]
    for items in (image, orphan):
        with pytest.raises(openai.BadRequestError):
            create(client, items)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    short = client.responses.create(model="smollm2", input="Tell me a long story.", max_output_tokens=4)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    counted = client.post("/responses/input_tokens", cast_to=object,
                          body={"model": "smollm2", "instructions": INSTRUCTIONS, "input": ASK, "tools": TOOLS})
    first = create(client, ASK, store=False)
    assert counted["input_tokens"] == first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)  # store: false keeps only the cache


def test_a_continuation_is_warm_after_a_restart(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The stored response outlives the daemon, and the state its key names is found on disk."""
    with Sandbox.new(POLICY + MODEL, label="responses-restart") as box:
        before = Daemon(box)
        first = create(before.sdk(), ASK, "required")
        assert box.stop(box.procs[-1]) == 0
        after = Daemon(box)
        follow = create(after.sdk(), outputs(call_item(first))[1:], previous_response_id=first.id)
        assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - CHUNK, follow.usage
        assert follow.model_extra["barrel"]["cache"]["tier"] in ("ram_file", "disk"), follow.model_extra["barrel"]

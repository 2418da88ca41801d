"""Each tool-call family on a model file that carries its template: tiny generated GGUFs whose
`tokenizer.chat_template` is a Hermes/Qwen, Llama 3 or Mistral layout, served by a real daemon and asked through
the real `openai` SDK. llama.cpp reads the template from the file, Barrel picks the family's format from it,
renders the tools through it, constrains a required call to that format and parses it back: the call names the
tool and its arguments validate, streamed and not, and the next turn, holding the call and its result, renders
through the same template and is served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import TinySpec, tiny_path
from tests.test_http import Daemon
from tests.unit.test_tool_formats import HERMES_TEMPLATE, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE

pytestmark = pytest.mark.model

FAMILIES = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": CITY}}]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    models = "".join(f'\n[[models]]\nname = "{name}"\npath = "{tiny_path(TinySpec(arch="mamba", chat_template=t))}"'
                     f'\nn_ctx = 2048\nn_threads = 1\n' for name, t in FAMILIES.items())
    with Sandbox.new(models, label="tool-templates") as box:
        daemon = Daemon(box)
        box.wait_models(set(FAMILIES))
        yield daemon


def ask(daemon: Daemon, model: str, messages: list, stream: bool) -> dict:
    """The assistant message of a reply that must call a tool, as history takes it."""
    args = {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
            "temperature": 0}
    client = daemon.sdk()
    if not stream:
        r = client.chat.completions.create(**args)
        assert r.choices[0].finish_reason == "tool_calls", r
        return r.choices[0].message.model_dump(exclude_none=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id:
                    calls[d.index] = {"id": d.id, "type": "function",
                                      "function": {"name": d.function.name, "arguments": ""}}
                calls[d.index]["function"]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    return {"role": "assistant", "tool_calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model", list(FAMILIES))
def test_a_models_own_template_gets_the_tools_and_its_forced_call_parses(daemon: Daemon, model: str,
                                                                        stream: bool) -> None:
    formats = {m["name"]: m["tool_format"] for m in daemon.box.ctl("--json", "models").json()["models"]}
    assert formats[model] == model  # the format came from the template in the model's file
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    message = ask(daemon, model, messages, stream)
    calls = message["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls), message
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), CITY)
    results = [{"role": "tool", "tool_call_id": c["id"], "content": '{"sky": "clear"}'} for c in calls]
    follow = daemon.sdk().chat.completions.create(model=model, messages=[*messages, message, *results],
                                                  tools=TOOLS, max_tokens=4, temperature=0)
    assert follow.usage.prompt_tokens > 0 and follow.choices[0].finish_reason in ("stop", "length", "tool_calls")

"""The model families agents run, each on the bundled SmolLM2 with the family's real chat template (the files of
llama.cpp's models/templates/), served by one real daemon and asked through the real `openai` SDK for a required
call (whole) and a named one (streamed). One model is the bundled file rewritten with gguf-new-metadata, as a user
would make it, so llama.cpp reads that template from the file; the others name their template in the config
(`[[models]] chat_template`), which spares a load-time probe per copy of the same weights.

The call must parse into `tool_calls` whose arguments validate, the reply must say `prefix_kept: true` (the
grammar held it to the bytes the template writes back), and the next turn, with the call and its result
appended, must restore at least the previous prompt and the call, less one chunk, once the reply is settled (a
reply's tokens were decoded one by one, so they are reused only once settling has prefilled them again).

Mistral Nemo's template moves the system prompt into the last user turn, so no turn of a conversation with one
keeps the previous turn's prefix: it is asked without one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import jsonschema
import pytest

from barreld.engine.registry import bundled_model_path
from tests.support.llama_sources import template_path
from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import templated_path
from tests.test_http import Daemon

pytestmark = pytest.mark.model

# model name: (the family its template is read as, the template's file)
FAMILIES = {
    "hermes2pro": ("hermes", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"),
    "qwen25": ("hermes", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    "qwen3": ("hermes", "Qwen-Qwen3-0.6B.jinja"),
    "qwen3coder": ("qwen3_coder", "Qwen3-Coder.jinja"),
    "gptoss": ("gpt_oss", "openai-gpt-oss-120b.jinja"),
    "llama33": ("llama3", "meta-llama-Llama-3.3-70B-Instruct.jinja"),
    "nemo": ("mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    "small32": ("mistral_v11", "Mistral-Small-3.2-24B-Instruct-2506.jinja"),
    "devstral": ("mistral_v11", "unsloth-mistral-Devstral-Small-2507.jinja"),
    "magistral": ("mistral_v11", "mistralai-Ministral-3-14B-Reasoning-2512.jinja"),
    "r1": ("deepseek_r1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"),
    "v31": ("deepseek_v3_1", "deepseek-ai-DeepSeek-V3.1.jinja"),
    "v32": ("deepseek_v3_2", "deepseek-ai-DeepSeek-V3.2.jinja"),
    "glm46": ("glm", "GLM-4.6.jinja"),
    "glm47": ("glm", "GLM-4.7-Flash.jinja"),
    "kimik2": ("kimi_k2", "moonshotai-Kimi-K2.jinja"),
    "granite4": ("granite", "ibm-granite-granite-4.0.jinja"),
    "minimaxm2": ("minimax_m2", "MiniMax-M2.jinja"),
    "nemotron2": ("nemotron", "NVIDIA-Nemotron-Nano-v2.jinja"),
    "commandr7b": ("command_r7b", "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"),
    "functionary32": ("functionary_v3_2", "meetkai-functionary-medium-v3.2.jinja"),
}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}
NOW = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": NOW}}]
SCHEMAS = {"get_weather": CITY, "get_time": NOW}
MOVES_SYSTEM = {"nemo"}


def counters(daemon: Daemon) -> dict[str, int]:
    """The cache's counters, over the socket (the CLI's own output is checked elsewhere; polling it costs a
    process a time)."""
    with daemon.box.client() as c:
        return dict(c.cache_stats().counters)


def settle(daemon: Daemon, model: str, before: int) -> None:
    """Until the model has settled the reply: `models` says so, with no request running (the worker lets go of
    the sequence just after the reply is out) and settling begun after `before`."""
    deadline = time.monotonic() + 60
    while True:
        with daemon.box.client() as c:
            info = next(m for m in c.models() if m.name == model)
            settled = dict(c.cache_stats().counters)["settled_tokens"]
        if not (info.running or info.settling) and settled > before:
            return
        assert time.monotonic() < deadline, "the reply was not settled"
        time.sleep(0.05)


CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_time"}}}


REWRITTEN = "qwen3coder"  # the model whose GGUF carries the template


def model_entry(name: str, file: str) -> str:
    if name == REWRITTEN:
        return f'\n[[models]]\nname = "{name}"\npath = "{templated_path(template_path(file))}"\nn_ctx = 4096\n'
    return (f'\n[[models]]\nname = "{name}"\npath = "{bundled_model_path("smollm2")}"\n'
            f'chat_template = "{template_path(file)}"\nn_ctx = 4096\n')


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    models = "".join(model_entry(name, file) for name, (_, file) in FAMILIES.items())
    with Sandbox.new(models, label="families") as box:
        daemon = Daemon(box)
        box.wait_models(set(FAMILIES), timeout=900)
        yield daemon


def ask(daemon: Daemon, model: str, messages: list, choice: object, stream: bool) -> tuple[dict, dict, object]:
    """(the assistant message as history takes it, the reply's `barrel` object, its usage)."""
    args = {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": choice, "max_tokens": 200,
            "temperature": 0}
    client = daemon.sdk()
    if not stream:
        r = client.chat.completions.create(**args)
        assert r.choices[0].finish_reason == "tool_calls", r
        return r.choices[0].message.model_dump(exclude_none=True), r.model_extra["barrel"], r.usage
    calls: dict[int, dict] = {}
    finish, last = None, None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        last = chunk
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id:
                    calls[d.index] = {"id": d.id, "type": "function",
                                      "function": {"name": d.function.name, "arguments": ""}}
                calls[d.index]["function"]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    message = {"role": "assistant", "tool_calls": [calls[i] for i in sorted(calls)]}
    return message, last.model_extra["barrel"], last.usage


def test_each_template_is_read_as_its_family(daemon: Daemon) -> None:
    formats = {m["name"]: m["tool_format"] for m in daemon.box.ctl("--json", "models").json()["models"]}
    assert {name: formats[name] for name in FAMILIES} == {name: family for name, (family, _) in FAMILIES.items()}


@pytest.mark.parametrize(("choice", "stream"), [("required", False), ("named", True)],
                         ids=["required-whole", "named-streamed"])
@pytest.mark.parametrize("model", list(FAMILIES))
def test_a_forced_call_parses_keeps_the_prefix_and_the_next_turn_restores_through_it(
        daemon: Daemon, model: str, choice: str, stream: bool) -> None:
    system = [] if model in MOVES_SYSTEM else [{"role": "system", "content": "You help with the weather and the time."}]
    messages = [*system, {"role": "user", "content": f"What is the weather in Oslo? ({choice}, {stream})"}]
    settled = counters(daemon)["settled_tokens"]
    message, barrel, usage = ask(daemon, model, messages, CHOICES[choice], stream)
    calls = message["tool_calls"]
    assert len(calls) == 1, message
    name = calls[0]["function"]["name"]
    assert name == "get_time" if choice == "named" else name in SCHEMAS
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS[name])
    assert barrel["prefix_kept"] is True, (model, message)
    settle(daemon, model, settled)
    results = [{"role": "tool", "tool_call_id": c["id"], "content": '{"sky": "clear"}'} for c in calls]
    follow = daemon.sdk().chat.completions.create(model=model, messages=[*messages, message, *results],
                                                  tools=TOOLS, max_tokens=2, temperature=0)
    with daemon.box.client() as c:
        chunk = next(m.prefill_chunk for m in c.models() if m.name == model)
    restored = follow.usage.prompt_tokens_details.cached_tokens
    assert restored >= usage.prompt_tokens + usage.completion_tokens - chunk, (restored, usage)

"""A forced call's bytes, read off each real template of llama.cpp's models/templates/: the call written as the
layout says (what the grammar lets the model write) is the very text the template writes back in the next turn,
and the family's parser reads it back as the call. No model here: the grammar's own check is in llama.cpp
(tests/test_model_families.py runs it on the real model)."""

from __future__ import annotations

import json

import pytest

from barreld.engine import calllayout
from barreld.engine.callformats import family_of
from barreld.engine.chat import Message, render, render_conversation
from barreld.engine.gbnf import check_gbnf
from barreld.engine.tools import ToolCall, forced_grammar, tool, tool_spec
from tests.support.llama_sources import template

WEATHER = tool("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}, "tools[0]")
SPEC = tool_spec([WEATHER], "required")
HISTORY = (Message("system", "You answer briefly."), Message("user", "Weather in Oslo for two days?"))
ARGS = {"city": "Oslo", "days": 2}
OPTIONS = {"bos": "<s>", "eos": "</s>", "model": "m", "tools": SPEC}
# The families, by a template of each; each must give a layout.
TEMPLATES = {
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "Qwen3-Coder.jinja": "qwen3_coder",
    "openai-gpt-oss-120b.jinja": "gpt_oss",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral_v11",
    "unsloth-mistral-Devstral-Small-2507.jinja": "mistral_v11",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral_v11",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek_r1",
    "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek_v3_1",
    "deepseek-ai-DeepSeek-V3.2.jinja": "deepseek_v3_2",
    "GLM-4.6.jinja": "glm",
    "GLM-4.7-Flash.jinja": "glm",
    "moonshotai-Kimi-K2.jinja": "kimi_k2",
    "ibm-granite-granite-4.0.jinja": "granite",
    "MiniMax-M2.jinja": "minimax_m2",
    "NVIDIA-Nemotron-Nano-v2.jinja": "nemotron",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "nemotron3",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": "command_r7b",
    "meetkai-functionary-medium-v3.2.jinja": "functionary_v3_2",
}


def written(layout: calllayout.CallLayout, name: str, args: dict, call_id: str) -> str:
    """The call as the layout writes it: what the forced grammar lets the model generate."""
    slots = {"name": name, "id": call_id, "args": json.dumps(args, ensure_ascii=False)}
    text = "".join(part if i % 2 == 0 else slots[part] for i, part in enumerate(layout.parts))
    p = layout.parameters
    if p is not None:
        items = [f"{key}{p.is_text if isinstance(v, str) else p.is_json}{v if isinstance(v, str) else json.dumps(v)}"
                 for key, v in args.items()]
        text += f"{p.first}{p.between.join(items)}{p.last}" if items else p.none
    return text


@pytest.mark.parametrize(("name", "family"), TEMPLATES.items(), ids=list(TEMPLATES))
def test_a_forced_call_is_the_templates_own_bytes_and_parses_back(name: str, family: str) -> None:
    source = template(name)
    fam = family_of(source)
    assert fam.name == family
    rendering = render_conversation(source, HISTORY, call=True, **OPTIONS)
    layout = rendering.call
    assert layout is not None, f"no layout read off {name}"
    call_id = calllayout.call_id(rendering.text, "get_weather")
    reply = written(layout, "get_weather", ARGS, call_id)
    prompt = rendering.text[:layout.cut].decode()
    opened = prompt.rstrip().endswith(fam.think[0]) if fam.think else False
    parsed = fam.parse(reply, ("get_weather",), reasoning_open=opened)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", ARGS)], reply
    sent_back = ToolCall(parsed.calls[0].id or call_id, "get_weather", parsed.calls[0].arguments)
    following = (*HISTORY, Message("assistant", parsed.content, (sent_back,)), Message("tool", "21", (), sent_back.id))
    next_prompt = render(source, following, **OPTIONS).decode()
    # Mistral Nemo's template moves the system prompt into the last user turn: no next turn keeps the prompt.
    assert next_prompt.startswith(prompt + reply) == (name != "mistralai-Mistral-Nemo-Instruct-2407.jinja")
    check_gbnf(forced_grammar(SPEC, layout, rendering.text))

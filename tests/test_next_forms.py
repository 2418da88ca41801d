"""Replies the next turn writes in other bytes than were generated, settled in that form while the model is idle,
on real daemons through the real `openai` SDK:

- an `auto` call written in another spacing than the template writes it back (Qwen 2.5's template, `tojson`),
- a reply whose thoughts the template leaves out of the history (Qwen3's template).

Grammars stand in for what a real model of the family writes (the bundled model would not call or think by
itself). After the settle, the next turn restores the previous prompt and the reply as the template re-renders
it, and replies as a cold daemon does; without it, a next turn restores no further than the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.sandbox import Sandbox
from tests.test_http import Daemon
from tests.test_model_families import counters, model_entry
from tests.test_model_families import settle as settle_reply

pytestmark = pytest.mark.model

MODELS = {"qwen25": "Qwen-Qwen2.5-7B-Instruct.jinja", "qwen3": "Qwen-Qwen3-0.6B.jinja"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": CITY}}]
COMPACT_CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'  # not tojson's spacing
THOUGHT, ANSWER = "the user greets me", "Hello there."
THINKING = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"  # Qwen3's layout


def literal(text: str) -> str:
    return "root ::= " + json.dumps(text)


@pytest.fixture(scope="module")
def daemons() -> Iterator[tuple[Daemon, Daemon]]:
    # flash attention off: with it a warm start leaves 64 tokens to the prompt's end, more than these turns add
    models = "".join(model_entry(name, file) + "flash_attn = false\n" for name, file in MODELS.items())
    with Sandbox.new(models, label="next-forms") as warm, Sandbox.new(models, label="next-forms-cold") as cold:
        pair = Daemon(warm), Daemon(cold)
        for box in (warm, cold):
            box.wait_models(set(MODELS))
        yield pair


def settle(daemon: Daemon, model: str, before: dict[str, int]) -> None:
    """Until the reply was taken in its next form and settled."""
    settle_reply(daemon, model, before["settled_tokens"])
    assert counters(daemon)["next_forms"] == before["next_forms"] + 1


def test_an_auto_call_the_template_rewrites_settles_as_rewritten(daemons: tuple[Daemon, Daemon]) -> None:
    warm, cold = daemons
    turn1 = [{"role": "user", "content": "What is the weather in Oslo?"}]
    before = counters(warm)
    r1 = warm.sdk().chat.completions.create(model="qwen25", messages=turn1, tools=TOOLS, tool_choice="auto",
                                            max_tokens=60, temperature=0, extra_body={"grammar": literal(COMPACT_CALL)})
    call = r1.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    assert r1.model_extra["barrel"]["prefix_kept"] is False  # the template writes it back as tojson spaces it
    settle(warm, "qwen25", before)
    turn2 = [*turn1, r1.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    r2 = warm.sdk().chat.completions.create(model="qwen25", messages=turn2, tools=TOOLS, max_tokens=8, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens + r1.usage.completion_tokens  # the call, re-rendered: two spaces more
    reference = cold.sdk().chat.completions.create(model="qwen25", messages=turn2, tools=TOOLS, max_tokens=8,
                                                   temperature=0)
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == reference.choices[0].message.content


def test_a_reply_whose_thoughts_the_template_drops_settles_without_them(daemons: tuple[Daemon, Daemon]) -> None:
    warm, cold = daemons
    turn1 = [{"role": "user", "content": "Hello!"}]
    before = counters(warm)
    r1 = warm.sdk().chat.completions.create(model="qwen3", messages=turn1, max_tokens=60, temperature=0,
                                            extra_body={"grammar": literal(THINKING)})
    message = r1.choices[0].message
    assert (message.model_extra["reasoning_content"].strip(), message.content) == (THOUGHT, ANSWER)
    settle(warm, "qwen3", before)
    turn2 = [*turn1, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "How are you?"}]
    r2 = warm.sdk().chat.completions.create(model="qwen3", messages=turn2, max_tokens=8, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # The prompt, then the answer without its thoughts, its end of turn and the next user turn's opening.
    assert cached >= r1.usage.prompt_tokens + 6, (cached, r1.usage)
    reference = cold.sdk().chat.completions.create(model="qwen3", messages=turn2, max_tokens=8, temperature=0)
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == reference.choices[0].message.content

"""Reasoning on every route, through the real `openai` and `anthropic` SDKs: chat completions' `reasoning_content`
(message and deltas) and `reasoning_tokens`, Messages' `thinking` blocks and `thinking_delta` events, and
Responses' `reasoning` items (a `summary_text` part and `reasoning_text` content, and the reasoning_summary_*
events), each streamed and not, on the bundled SmolLM2 served with llama.cpp's Qwen3 template, which thinks
between <think> and </think>.

A 135M model does not think by itself, so a GBNF grammar forces a thought then an answer. What the model
generated is known apart from how Barrel splits it: the chat reply's logprobs hold every generated token's bytes,
and the grammar's own shape cuts them into the thought and the answer (the `truth` fixture). Decoding is greedy
and every route renders the same conversation with the same template, so each route must give that same thought
and answer, and no route may show a marker, or any piece of one, as text: the grammar allows none of `<`, `/`,
`>` in the thought or the answer, so any of them in shown text is a marker leaking. The thought is what lies
between `<think>\n` and `\n</think>`: those newlines are the template's layout (Qwen3's template writes them
around `reasoning_content.strip('\n')` when it renders a turn back; llama.cpp's server strips them too), not
the thought's, so no route may hand them out as reasoning.

`chat_template_kwargs` reaching the template is shown by Qwen3's `enable_thinking: false`, which writes an empty
<think></think> into the generation prompt: the prompt grows by a few tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import pytest
from openai.types.responses import (
    ResponseReasoningItem,
    ResponseReasoningSummaryPartAddedEvent,
    ResponseReasoningSummaryPartDoneEvent,
    ResponseReasoningSummaryTextDeltaEvent,
    ResponseReasoningSummaryTextDoneEvent,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
)

from barreld.engine.registry import bundled_model_path
from tests.support.llama_sources import template_path
from tests.support.sandbox import Sandbox
from tests.test_http import Daemon

pytestmark = pytest.mark.model

MODEL = "qwen3"
GRAMMAR = r'''root ::= "<think>\n" thought "\n</think>\n\n" answer
thought ::= [a-z] [a-z ]{6,38} [a-z]
answer ::= [A-Z] [A-Za-z .]{0,38} "."
'''
SHAPE = re.compile(r"<think>\n([a-z][a-z ]{6,38}[a-z])\n</think>\n\n([A-Z][A-Za-z .]{0,38}\.)")
MARKER_CHARS = set("<>/")  # none is in a thought or an answer the grammar allows
ASK = "Is the sea salty? Think first."
MESSAGES = [{"role": "user", "content": ASK}]
MAX = 120  # well above the grammar's longest reply, so every reply ends with the grammar


@dataclass(frozen=True)
class Truth:
    """What the model generated for ASK under GRAMMAR, cut by the grammar's shape, not by Barrel."""

    thought: str
    answer: str


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    entry = (f'\n[[models]]\nname = "{MODEL}"\npath = "{bundled_model_path("smollm2")}"\n'
             f'chat_template = "{template_path("Qwen-Qwen3-0.6B.jinja")}"\nn_ctx = 4096\n')
    with Sandbox.new(entry, label="reasoning") as box:
        daemon = Daemon(box)
        box.wait_models({MODEL}, timeout=600)
        yield daemon


@pytest.fixture(scope="module")
def truth(daemon: Daemon) -> Truth:
    r = daemon.sdk().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX, temperature=0,
                                             logprobs=True, extra_body={"grammar": GRAMMAR})
    raw = b"".join(bytes(t.bytes or []) for t in r.choices[0].logprobs.content).decode()
    found = SHAPE.fullmatch(raw)
    assert found, raw
    return Truth(found[1], found[2])


def clean(text: str) -> None:
    assert not MARKER_CHARS & set(text), f"marker text shown: {text!r}"


def test_chat_whole_gives_reasoning_content_apart_and_counts_its_tokens(daemon: Daemon, truth: Truth) -> None:
    r = daemon.sdk().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX, temperature=0,
                                             extra_body={"grammar": GRAMMAR})
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == truth.thought
    assert message.content == truth.answer
    clean(message.content)
    assert r.choices[0].finish_reason == "stop"
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens


def test_chat_stream_gives_reasoning_deltas_and_never_a_marker_as_content(daemon: Daemon, truth: Truth) -> None:
    thought, answer = [], []
    usage = None
    for chunk in daemon.sdk().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"grammar": GRAMMAR}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            reasoning = (c.delta.model_extra or {}).get("reasoning_content")
            if reasoning:
                assert not c.delta.content, "a delta with reasoning and content both"
                thought.append(reasoning)
            if c.delta.content:
                clean(c.delta.content)
                answer.append(c.delta.content)
    assert thought and "".join(thought) == truth.thought
    assert "".join(answer) == truth.answer
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens > 0


def anthropic_sdk(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.base, api_key="unused", max_retries=0)


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 1024}], ids=["unset", "enabled"])
def test_messages_whole_gives_a_thinking_block_then_the_text(daemon: Daemon, truth: Truth, thinking: object) -> None:
    extra = {} if thinking is None else {"thinking": thinking}
    reply = anthropic_sdk(daemon).messages.create(model=MODEL, messages=MESSAGES, max_tokens=MAX, **extra,
                                                  extra_body={"grammar": GRAMMAR})
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == truth.thought and isinstance(reply.content[0].signature, str)
    assert reply.content[1].text == truth.answer
    assert reply.stop_reason == "end_turn"


def test_messages_stream_gives_thinking_deltas_and_never_a_marker_as_text(daemon: Daemon, truth: Truth) -> None:
    thought, answer, starts = [], [], []
    with anthropic_sdk(daemon).messages.stream(model=MODEL, messages=MESSAGES, max_tokens=MAX,
                                               extra_body={"grammar": GRAMMAR}) as stream:
        for ev in stream:
            if ev.type == "content_block_start":
                starts.append(ev.content_block.type)
            elif ev.type == "content_block_delta" and ev.delta.type == "thinking_delta":
                thought.append(ev.delta.thinking)
            elif ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                clean(ev.delta.text)
                answer.append(ev.delta.text)
        final = stream.get_final_message()
    assert starts == ["thinking", "text"]
    assert "".join(thought) == truth.thought and "".join(answer) == truth.answer
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == truth.thought and final.content[1].text == truth.answer


def check_output(output: list, truth: Truth) -> None:
    """A reasoning item whose summary and content are the thought, then the message with the answer."""
    assert [o.type for o in output] == ["reasoning", "message"]
    reasoning, message = output
    assert isinstance(reasoning, ResponseReasoningItem)
    assert [(s.type, s.text) for s in reasoning.summary] == [("summary_text", truth.thought)]
    assert [(c.type, c.text) for c in reasoning.content or []] == [("reasoning_text", truth.thought)]
    assert [(c.type, c.text) for c in message.content] == [("output_text", truth.answer)]


def test_responses_whole_gives_a_reasoning_item_with_its_summary(daemon: Daemon, truth: Truth) -> None:
    r = daemon.sdk().responses.create(model=MODEL, input=ASK, max_output_tokens=MAX, temperature=0,
                                      extra_body={"grammar": GRAMMAR})
    assert r.status == "completed"
    check_output(r.output, truth)
    assert r.output_text == truth.answer
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def test_responses_stream_gives_the_reasoning_summary_events_in_openais_order(daemon: Daemon, truth: Truth) -> None:
    with daemon.sdk().responses.stream(model=MODEL, input=ASK, max_output_tokens=MAX, temperature=0,
                                       extra_body={"grammar": GRAMMAR}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning_id = final.output[0].id
    mine = [e for e in events if getattr(e, "item_id", None) == reasoning_id
            or getattr(getattr(e, "item", None), "id", None) == reasoning_id]
    kinds = [e.type for e in mine]
    deltas = kinds.count("response.reasoning_summary_text.delta")
    assert deltas > 0 and kinds.count("response.reasoning_text.delta") == deltas
    assert [k for k in kinds if k not in ("response.reasoning_summary_text.delta",
                                          "response.reasoning_text.delta")] == [
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.reasoning_text.done", "response.output_item.done"]
    first = kinds.index("response.reasoning_summary_text.delta")
    assert kinds.index("response.reasoning_summary_part.added") < first
    assert max(i for i, k in enumerate(kinds) if k.endswith(".delta")) < kinds.index(
        "response.reasoning_summary_text.done")
    # each parsed into the SDK's own type, and each says the same thought
    summary = "".join(e.delta for e in mine if isinstance(e, ResponseReasoningSummaryTextDeltaEvent))
    content = "".join(e.delta for e in mine if isinstance(e, ResponseReasoningTextDeltaEvent))
    assert summary == content == truth.thought
    assert [e.text for e in mine if isinstance(e, ResponseReasoningSummaryTextDoneEvent)] == [truth.thought]
    assert [e.text for e in mine if isinstance(e, ResponseReasoningTextDoneEvent)] == [truth.thought]
    added = [e for e in mine if isinstance(e, ResponseReasoningSummaryPartAddedEvent)]
    done = [e for e in mine if isinstance(e, ResponseReasoningSummaryPartDoneEvent)]
    assert [(e.summary_index, e.part.type, e.part.text) for e in added] == [(0, "summary_text", "")]
    assert [(e.summary_index, e.part.type, e.part.text) for e in done] == [(0, "summary_text", truth.thought)]
    item_done = next(e for e in mine if e.type == "response.output_item.done")
    assert [(s.type, s.text) for s in item_done.item.summary] == [("summary_text", truth.thought)]
    # the answer after it, in output_text deltas that never show a marker
    texts = [e.delta for e in events if isinstance(e, ResponseTextDeltaEvent)]
    for t in texts:
        clean(t)
    assert "".join(texts) == truth.answer
    last = max(i for i, e in enumerate(events) if any(e is m for m in mine))
    assert last < min(i for i, e in enumerate(events) if isinstance(e, ResponseTextDeltaEvent))
    check_output(final.output, truth)
    assert events[-1].type == "response.completed" and final.usage.output_tokens_details.reasoning_tokens > 0


def test_chat_template_kwargs_reach_the_template(daemon: Daemon) -> None:
    client = daemon.sdk()
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi (kwargs)."}], "max_tokens": 1,
           "temperature": 0}
    plain = client.chat.completions.create(**ask)
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert on.usage.prompt_tokens == plain.usage.prompt_tokens  # the template thinks unless told not to
    # "<think>\n\n</think>\n\n" is a few tokens in SmolLM2's vocabulary
    assert plain.usage.prompt_tokens + 3 <= off.usage.prompt_tokens <= plain.usage.prompt_tokens + 12

"""The OpenAI Agents SDK (`openai-agents`) against barreld's /v1/responses on the bundled model, through the
model its default provider makes (OpenAIResponsesModel, the Responses API): an agent with one function tool that
it must call first (tool_choice required; the SDK resets the choice after a call, so the next model call may
answer). Run whole (Runner.run sends unstreamed requests), streamed (Runner.run_streamed sends `stream: true`)
and chained (auto_previous_response_id: each call sends only its new items and the last response's id), each
must call the tool with valid arguments, send its output back as a function_call_output item and reach a final
text; every model call after the first must restore at least 90% of the previous call's input from the cache,
as the daemon's log line for each request says and the response's usage.input_tokens_details.cached_tokens
agrees.

Tracing is off and the SDK's client is the test's own, so nothing but the daemon is reached."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    RunResult,
    RunResultStreaming,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

from tests.support.sandbox import Sandbox
from tests.test_cache_paths import POLICY
from tests.test_http import MODEL, Daemon

pytestmark = pytest.mark.model

REQUEST = re.compile(r"barreld\.requests: http smollm2: \w+, (\d+) of (\d+) prompt tokens restored")
WEATHER = "Sunny, 21 degrees Celsius, light wind from the west."
Result = RunResult | RunResultStreaming
INSTRUCTIONS = ("You are a weather assistant. Call get_weather for the city the user names, then answer in one "
                "sentence from what it returns.")  # SmolLM2 135M calls the tool again after long instructions


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Sandbox.new(POLICY + MODEL, label="agents") as box:
        yield Daemon(box)


def agent(d: Daemon, calls: list[str]) -> tuple[Agent, AsyncOpenAI]:
    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        calls.append(city)
        return WEATHER

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{d.base}/v1", api_key="unused", max_retries=0)
    model = OpenAIResponsesModel(model="smollm2", openai_client=client)
    settings = ModelSettings(tool_choice="required", temperature=0, max_tokens=64)
    return Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model=model,
                 model_settings=settings), client


def logged(d: Daemon, since: int, n: int) -> list[tuple[int, int]]:
    """(restored, prompt tokens) of the first `n` requests ended since log offset `since`: the log line comes
    as the request ends, so it may trail the reply a little."""
    deadline = time.monotonic() + 30
    while len(found := REQUEST.findall(d.box.log_text()[since:])) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return [(int(r), int(p)) for r, p in found]


def check(d: Daemon, since: int, result: Result, calls: list[str], city: str) -> str:
    """The run's tool call, output and final text, and each model call's restored share of the one before
    (returned as words)."""
    assert isinstance(result.final_output, str) and result.final_output.strip(), result.final_output
    tool_calls = [i.raw_item for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i.output for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert tool_calls and tool_calls[0].name == "get_weather", result.new_items
    assert json.loads(tool_calls[0].arguments).keys() == {"city"} and city in calls[0], (tool_calls, calls)
    assert outputs[0] == WEATHER and len(calls) == len(tool_calls), (outputs, calls)
    usages = [r.usage for r in result.raw_responses]
    assert len(usages) >= 2, result.raw_responses
    lines = logged(d, since, len(usages))
    assert len(lines) == len(usages), (lines, usages)  # one request per model call, none retried
    assert [(u.input_tokens_details.cached_tokens, u.input_tokens) for u in usages] == lines, (usages, lines)
    shares = [now[0] / before[1] for before, now in zip(lines, lines[1:], strict=False)]
    assert all(s >= 0.9 for s in shares), (lines, shares)
    return (f"{len(lines)} model calls, tool called with {calls}, (restored, prompt tokens) {lines}: "
            f"{', '.join(f'{s:.0%}' for s in shares)} of each previous prompt; final {result.final_output!r}")


async def run(d: Daemon, question: str, streamed: bool = False, **kw: object) -> tuple[Result, list[str], list[str]]:
    """One agent run on a client of its own (closed on the loop it ran on): its result, the city each tool
    call named, and the stream's event types (raw events by their data's type) when streamed."""
    calls: list[str] = []
    weather, client = agent(d, calls)
    kinds: list[str] = []
    try:
        if not streamed:
            return await Runner.run(weather, question, max_turns=4, **kw), calls, kinds  # type: ignore[arg-type]
        result = Runner.run_streamed(weather, question, max_turns=4, **kw)  # type: ignore[arg-type]
        kinds = [e.data.type if e.type == "raw_response_event" else e.type async for e in result.stream_events()]
        return result, calls, kinds
    finally:
        await client.close()


def test_an_agent_calls_its_tool_and_answers_each_call_warm(daemon: Daemon) -> None:
    since = len(daemon.box.log_text())
    result, calls, _ = asyncio.run(run(daemon, "What is the weather in Paris right now?"))
    print("agents sdk, whole:", check(daemon, since, result, calls, "Paris"))


def test_a_streamed_agent_run_calls_its_tool_and_answers_each_call_warm(daemon: Daemon) -> None:
    since = len(daemon.box.log_text())
    result, calls, kinds = asyncio.run(run(daemon, "What is the weather in Lisbon right now?", streamed=True))
    # the reply's text came as deltas, each model call ended with response.completed
    assert {"response.output_text.delta", "run_item_stream_event"} <= set(kinds), kinds
    assert kinds.count("response.completed") == len(result.raw_responses), kinds
    print("agents sdk, streamed:", check(daemon, since, result, calls, "Lisbon"))


def test_an_agent_run_chained_by_previous_response_id_is_as_warm(daemon: Daemon) -> None:
    """With auto_previous_response_id the SDK sends each call only its new items and the last response's id:
    the daemon continues its stored conversation, and each call restores the one before all the same."""
    since = len(daemon.box.log_text())
    chained = run(daemon, "What is the weather in Oslo right now?", auto_previous_response_id=True)
    result, calls, _ = asyncio.run(chained)
    ids = [r.response_id for r in result.raw_responses]
    assert all(ids) and len(set(ids)) == len(ids) and result.last_response_id == ids[-1], ids
    print("agents sdk, chained:", check(daemon, since, result, calls, "Oslo"))

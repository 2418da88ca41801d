"""The HTTP API with the real model through a real barreld: the real `openai` SDK (sync and async, streamed
and not), the real `llm` CLI, raw SSE, errors and hang-ups. A warm daemon saves and restores; a cold one
never saves, so its replies come from a cold prefill; replies are compared at temperature 0.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from barreld.engine.registry import bundled_model_path
from tests.support.sandbox import Sandbox
from tests.test_cache_paths import CHUNK, NO_SAVES, POLICY, counters, doc

pytestmark = pytest.mark.model

# Flash attention off: these tests count what short next turns restore, and with it (the default, covered by
# test_cache_paths' smollm2_tiled) a warm start leaves 64 tokens to the prompt's end (exact_reuse.spans).
MODEL = '\n[[models]]\nname = "smollm2"\nflash_attn = false\n'


class Daemon:
    """A sandboxed barreld serving HTTP on a free loopback port."""

    def __init__(self, box: Sandbox) -> None:
        self.box = box
        box.start_daemon("--http", "127.0.0.1:0")
        self.port = box.http_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0)

    def request(self, method: str, path: str, raw: bytes | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json"} if raw else {})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        return resp.status, json.loads(body) if resp.getheader("content-type") == "application/json" else body

    def metric(self, series: str) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        values = [float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(series + " ")]
        return values[0] if values else 0.0

    def running(self) -> int:
        with self.box.client() as c:
            return c.models()[0].running


@pytest.fixture(scope="module")
def warm() -> Iterator[Daemon]:
    with Sandbox.new(POLICY + MODEL, label="http-warm") as box:
        yield Daemon(box)


@pytest.fixture(scope="module")
def cold() -> Iterator[Daemon]:
    with Sandbox.new(NO_SAVES + MODEL, label="http-cold") as box:
        yield Daemon(box)


SYSTEM = {"role": "system", "content": "You are a terse assistant. Notes: " + doc(5, 250)}


def test_a_second_turn_restores_the_first_and_replies_as_a_cold_prefill_does(warm: Daemon, cold: Daemon) -> None:
    client = warm.sdk()
    turn1 = [SYSTEM, {"role": "user", "content": "What is the first word of the notes?"}]
    r1 = client.chat.completions.create(model="smollm2", messages=turn1, max_tokens=12, temperature=0)
    assert r1.usage.prompt_tokens > 200 and r1.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And the second word?"}]
    r2 = client.chat.completions.create(model="smollm2", messages=turn2, max_tokens=12, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # its prompt at least (the chunk rule's part of it), its reply too once settled, never more than both
    assert r1.usage.prompt_tokens // CHUNK * CHUNK <= cached <= r1.usage.total_tokens, (cached, r1.usage)
    barrel = r2.model_extra["barrel"]
    assert barrel["cache"]["restored_tokens"] == cached and barrel["cache"]["path"] != "miss"
    assert barrel["cache"]["prefilled_tokens"] == r2.usage.prompt_tokens - cached
    reference = cold.sdk().chat.completions.create(model="smollm2", messages=turn2, max_tokens=12, temperature=0)
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == reference.choices[0].message.content
    assert r2.model_extra["barrel"]["prompt_key"] == reference.model_extra["barrel"]["prompt_key"]


def test_a_chat_given_time_to_settle_restores_its_reply_and_the_opening_of_its_next_turn(warm: Daemon,
                                                                                        cold: Daemon) -> None:
    """While the user reads, the reply is prefilled again with what the template writes before the next user
    message (ChatML: <|im_end|>, a newline, <|im_start|>user, a newline): the next turn restores all of that
    and prefills only its own message and the cue, and replies as a cold prefill does."""
    client = warm.sdk()
    turn1 = [SYSTEM, {"role": "user", "content": "Which word of the notes comes last?"}]
    before = counters(warm.box)
    r1 = client.chat.completions.create(model="smollm2", messages=turn1, max_tokens=12, temperature=0)
    with warm.box.client() as rpc:  # settling waits settle_after_ms (200) before it starts
        assert next(m for m in rpc.models() if m.name == "smollm2").settling
    deadline = time.monotonic() + 60
    while next(m for m in warm.box.ctl("--json", "models").json()["models"] if m["name"] == "smollm2")["settling"]:
        assert time.monotonic() < deadline, "the reply was not settled"
        time.sleep(0.1)
    c = counters(warm.box)
    assert c["settled_tokens"] - before["settled_tokens"] >= r1.usage.completion_tokens
    opening = c["opening_tokens"] - before["opening_tokens"]
    assert opening >= 4
    turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And the first?"}]
    r2 = client.chat.completions.create(model="smollm2", messages=turn2, max_tokens=12, temperature=0)
    assert r2.model_extra["barrel"]["cache"]["path"] == "live"
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.total_tokens + opening
    reference = cold.sdk().chat.completions.create(model="smollm2", messages=turn2, max_tokens=12, temperature=0)
    assert r2.choices[0].message.content == reference.choices[0].message.content


def test_the_async_sdk_streams_what_it_gets_whole(warm: Daemon) -> None:
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]

    async def both() -> tuple:
        client = openai.AsyncOpenAI(base_url=f"{warm.base}/v1", api_key="unused", max_retries=0)
        whole = await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16,
                                                     temperature=0)
        chunks = [c async for c in await client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(both())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0   # the same prompt again: warm


def test_an_agents_own_model_name_reaches_the_model_with_a_matching_alias(cold: Daemon) -> None:
    box = cold.box
    path = str(bundled_model_path("smollm2"))
    loaded = box.ctl("--no-autostart", "--json", "load", "agent", "--path", path, "--alias", "claude-*")
    assert loaded.rc == 0 and loaded.json()["aliases"] == ["claude-*"], loaded.err
    try:
        messages = [{"role": "user", "content": "Say hello."}]
        reply = cold.sdk().chat.completions.create(model="claude-opus-5-5", messages=messages, max_tokens=4)
        assert reply.model == "agent" and reply.usage.completion_tokens == 4
        with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-4o'"):
            cold.sdk().chat.completions.create(model="gpt-4o", messages=messages, max_tokens=4)
        bad = box.ctl("--no-autostart", "load", "other", "--path", path, "--alias", "claude opus")
        assert bad.rc == 2 and "bad --alias 'claude opus'" in bad.err
    finally:
        assert box.ctl("--no-autostart", "unload", "agent").rc == 0


def sse(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while line := resp.readline():
        if line.startswith(b"data: "):
            yield line[len(b"data: "):].strip()


def test_sse_chunks_arrive_while_tokens_are_generated_and_end_with_done(warm: Daemon) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", warm.port, timeout=120)
    body = {"model": "smollm2", "prompt": "The history of the river town began", "max_tokens": 48,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = sse(resp)
    first = json.loads(next(events))
    assert first["choices"][0]["text"] and first["choices"][0]["finish_reason"] is None
    assert warm.running() == 1   # the first chunk is here; the last token is not made yet
    rest = list(events)
    conn.close()
    assert rest[-1] == b"[DONE]"
    usage_chunk, finish = json.loads(rest[-2]), json.loads(rest[-3])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 48
    assert usage_chunk["barrel"]["cache"]["path"] in ("miss", "exact", "live", "resume", "longest_prefix")


def test_llm_cli_prints_a_completion_and_a_repeated_long_prompt_is_an_exact_hit(warm: Daemon, tmp_path: Path) -> None:
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: barrel\n  model_name: smollm2\n  api_base: {warm.base}/v1\n")
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": ""}

    def llm(prompt: str) -> str:
        p = subprocess.run([sys.executable, "-m", "llm", "prompt", "-m", "barrel", "--no-log", "-o", "max_tokens",
                            "8", "-o", "temperature", "0", prompt], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout

    long_prompt = "Summarise these notes: " + doc(11, 130)
    first = llm(long_prompt)
    assert first.strip()
    other = [{"role": "user", "content": "Something else: " + doc(12, 130)}]
    warm.sdk().chat.completions.create(model="smollm2", messages=other, max_tokens=2)  # takes the one sequence
    exact = warm.metric('barrel_cache_hits_total{route="exact"}')
    restored = warm.metric('barrel_restored_tokens_total{model="smollm2"}')
    assert llm(long_prompt) == first
    assert warm.metric('barrel_cache_hits_total{route="exact"}') == exact + 1
    assert warm.metric('barrel_restored_tokens_total{model="smollm2"}') - restored > 128


def test_errors_are_answered_and_the_daemon_serves_on(warm: Daemon) -> None:
    too_long = json.dumps({"model": "smollm2", "prompt": "river " * 5000, "max_tokens": 4}).encode()
    status, doc_ = warm.request("POST", "/v1/completions", too_long)
    assert status == 400 and "context holds 4096" in doc_["error"]["message"]
    status, doc_ = warm.request("POST", "/v1/completions", b'{"model": "gpt-9", "prompt": "x"}')
    assert status == 404 and doc_["error"]["code"] == "model_not_found"
    status, doc_ = warm.request("POST", "/v1/chat/completions", b'{"model": "smollm2", "messages": [')
    assert status == 400 and "not valid JSON" in doc_["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        warm.sdk().completions.create(model="smollm2", prompt="hi", n=2)
    reply = warm.sdk().completions.create(model="smollm2", prompt="Hello", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4 and reply.choices[0].text


def test_a_client_that_hangs_up_stops_its_generation(warm: Daemon) -> None:
    generated = warm.metric('barrel_generated_tokens_total{model="smollm2"}')
    conn = http.client.HTTPConnection("127.0.0.1", warm.port, timeout=120)
    body = {"model": "smollm2", "prompt": "A very long story:", "max_tokens": 2000, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    next(sse(resp))
    conn.close()
    deadline = time.monotonic() + 30
    while warm.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warm.running() == 0
    assert "cancelled by its client" in warm.box.log_text()
    assert warm.metric('barrel_generated_tokens_total{model="smollm2"}') - generated < 2000

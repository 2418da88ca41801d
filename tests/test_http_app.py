"""The HTTP API in-process over FakeBackend: real uvicorn on a real loopback socket, a real LMDB store, the
real `openai` SDK and raw HTTP, in milliseconds. Every error answer is checked for its status and OpenAI's
error shape, and the server is checked to serve normally afterwards; tests/test_http.py runs the real model.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from barreld.address import parse_listen
from barreld.cache import CacheStore, TierConfig
from barreld.engine import tools
from barreld.engine.backend import BackendError
from barreld.engine.registry import LoadOptions, ModelRegistry
from barreld.http.app import DaemonState, HttpApi
from barreld.http.server import HttpServer
from barreld.http.streaming import MAX_BODY
from barreld.service.metrics import Metrics
from barreld.tenants import TenantKey, Tenants
from tests.engine.conftest import POLICY, plain
from tests.fakes.backend import FakeBackend, write_gguf

N_CTX = 256
KEY = "sk-test-0123456789"


class SteppedBackend(FakeBackend):
    """While `stepping`, each decode waits for one permit: a test decides how far generation gets."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stepping = False
        self.permits = threading.Semaphore(0)

    def decode(self, items: list) -> None:
        if self.stepping and not self.permits.acquire(timeout=10):
            raise BackendError("no permit within 10 s; a test forgot to step")
        super().decode(items)


class Served:
    """A registry over SteppedBackend (model "m", n_ctx 256, queue of 1) behind HttpApi on 127.0.0.1:0."""

    def __init__(self, root: Path, tenants: Tenants | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.store = CacheStore(root / "data", {"ram": TierConfig(64 << 20), "ram_file": TierConfig(
            64 << 20, root / "ram_file"), "disk": TierConfig(64 << 20, root / "disk")}).open()
        self.registry = ModelRegistry(self.store, POLICY, max_queue=1, backend_factory=SteppedBackend)
        self.registry.load("m", LoadOptions(path=write_gguf(root / "fake.gguf"), n_ctx=N_CTX,
                                                        n_batch=64, flash_attn=False))
        self.metrics = Metrics(self.store, self.registry.models)
        self.ready = threading.Event()
        self.ready.set()
        self.stopping = False
        self.server = HttpServer(parse_listen("127.0.0.1:0"))
        self.server.bind()
        state = DaemonState(ready=self.ready.is_set, stopping=lambda: self.stopping)
        self.server.start(HttpApi(self.registry, self.metrics, state, tenants).app)
        self.port = self.server.address.port

    @property
    def backend(self) -> SteppedBackend:
        return self.registry.get("m").worker.backend

    def counts(self) -> dict[str, int]:
        return self.registry.get("m").worker.counts()

    def request(self, method: str, path: str, body: Any = None, headers: dict | None = None,
                raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        if raw is None and body is not None:
            raw = json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json"} if raw is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=raw, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        ctype = resp.getheader("content-type", "")
        doc = json.loads(data) if ctype.startswith("application/json") else data.decode()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, doc

    def complete(self, **body: Any) -> dict:
        status, _, doc = self.request("POST", "/v1/completions", {"model": "m", "max_tokens": 6,
                                                                  "temperature": 0, **body})
        assert status == 200, doc
        return doc

    def sdk(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, **kw)

    def close(self) -> None:
        self.backend.stepping = False
        self.backend.permits.release(1000)
        self.stopping = True
        self.server.stop_accepting()
        self.registry.close()
        self.server.join(10)
        self.store.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("http"))
    yield s
    s.close()


@pytest.fixture
def healthy(served: Served) -> Iterator[Served]:
    """The shared server, proven to serve a normal completion after the test, whatever the test did."""
    yield served
    served.backend.stepping = False
    served.backend.permits.release(1000)
    wait_for(lambda: served.counts()["running"] + served.counts()["queued"] == 0)
    served.backend.permits = threading.Semaphore(0)
    assert served.complete(prompt="still serving")["choices"][0]["finish_reason"] in ("stop", "length")


def sse_events(resp: http.client.HTTPResponse) -> Iterator[Any]:
    """The `data:` payloads of an SSE stream as they arrive: JSON documents, then the string "[DONE]"."""
    while line := resp.readline():
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):]
            yield payload.decode() if payload == b"[DONE]" else json.loads(payload)


def stream(served: Served, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.request("POST", path, body=json.dumps({"model": "m", "temperature": 0, "stream": True, **body}),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def metric(served: Served, name: str, **labels: str) -> float:
    _, _, text = served.request("GET", "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        base, _, rest = series.partition("{")
        if base == name and ",".join(sorted(rest.rstrip("}").split(","))) == want:
            return float(value)
    return 0.0


def assert_error(status: int, doc: Any, want_status: int, *words: str) -> None:
    assert status == want_status, doc
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    for word in words:
        assert word in doc["error"]["message"], doc


# ---- the routes ---------------------------------------------------------------------------------------


def test_health_says_ok_when_ready_and_503_while_loading_or_stopping(served: Served) -> None:
    assert served.request("GET", "/health")[::2] == (200, {"status": "ok"})
    served.ready.clear()
    try:
        status, headers, doc = served.request("GET", "/health")
        assert (status, doc, headers["retry-after"]) == (503, {"status": "loading"}, "1")
        status, _, doc = served.request("POST", "/v1/completions", {"model": "m", "prompt": "hi"})
        assert_error(status, doc, 503, "loading")
        assert doc["error"]["code"] == "loading"
    finally:
        served.ready.set()
    served.stopping = True
    try:
        assert served.request("GET", "/health")[::2] == (503, {"status": "stopping"})
        assert_error(*served.request("POST", "/v1/completions", {"model": "m", "prompt": "hi"})[::2], 503,
                     "shutting down")
    finally:
        served.stopping = False


def test_models_list_and_retrieve_in_openai_shapes(served: Served) -> None:
    page = served.sdk().models.list()
    assert [m.id for m in page.data] == ["m"] and page.data[0].owned_by == "barrel"
    assert served.sdk().models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError) as info:
        served.sdk().models.retrieve("nope")
    assert info.value.body["code"] == "model_not_found"


def test_a_completion_reports_usage_and_the_cache_and_a_repeat_is_warm(healthy: Served) -> None:
    prompt = plain(60, 1).decode()
    first = healthy.complete(prompt=prompt)
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")
    (choice,) = first["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["text"]
    usage = first["usage"]
    assert usage["prompt_tokens"] == 60 and usage["completion_tokens"] == 6 and usage["total_tokens"] == 66
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    barrel = first["barrel"]
    assert barrel["cache"] == {"path": "miss", "restored_tokens": 0, "prefilled_tokens": 60, "tier": None}
    assert len(barrel["key"]) == len(barrel["prompt_key"]) == 64
    assert set(barrel["timings_ms"]) == {"lookup", "restore", "prefill", "ttft", "total"}
    again = healthy.complete(prompt=prompt)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["barrel"]["cache"]["restored_tokens"]
    assert again["barrel"]["cache"]["restored_tokens"] >= 58 and again["choices"][0]["text"] == choice["text"]


def test_defaults_are_greedy_and_16_tokens_for_a_completion(healthy: Served) -> None:
    prompt = plain(20, 9).decode()
    status, _, default = healthy.request("POST", "/v1/completions", {"model": "", "prompt": prompt})
    assert status == 200 and default["model"] == "m"   # no model: the default one
    assert default["usage"]["completion_tokens"] == 16 or default["choices"][0]["finish_reason"] == "stop"
    greedy = healthy.complete(prompt=prompt, max_tokens=16)
    assert default["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_chat_through_the_sdk_streamed_and_not_give_the_same_reply(healthy: Served) -> None:
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "you"}]}]
    client = healthy.sdk()
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    *body, last = chunks
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in body) and last.choices == []
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens > 0   # the second time, warm
    assert last.model_extra["barrel"]["cache"]["restored_tokens"] == last.usage.prompt_tokens_details.cached_tokens


class Reader(threading.Thread):
    """Reads an SSE response on a thread of its own, so that the test can step the worker meanwhile."""

    def __init__(self, resp: http.client.HTTPResponse) -> None:
        super().__init__(daemon=True)
        self.resp = resp
        self.events: queue.Queue[Any] = queue.Queue()
        self.start()

    def run(self) -> None:
        # A test that hangs up closes the connection under this thread: http.client then fails in its own way.
        with contextlib.suppress(Exception):
            for ev in sse_events(self.resp):
                self.events.put(ev)
        self.events.put(None)

    def step_until_text(self, served: Served) -> list[Any]:
        """Lets the worker decode once at a time until a chunk with text has arrived; the events so far."""
        got: list[Any] = []
        for _ in range(50):
            served.backend.permits.release(1)
            with contextlib.suppress(queue.Empty):
                while True:
                    got.append(self.events.get(timeout=0.05))
                    if text_of(got[-1]):
                        return got
        raise AssertionError(f"no text after 50 decodes: {got}")

    def rest(self) -> list[Any]:
        return list(iter(lambda: self.events.get(timeout=30), None))


def text_of(chunk: Any) -> str:
    if not isinstance(chunk, dict) or not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    return choice.get("text") or choice.get("delta", {}).get("content") or ""


def test_chunks_are_sent_as_tokens_are_made_and_the_stream_ends_with_done(healthy: Served) -> None:
    healthy.backend.stepping = True
    conn, resp = stream(healthy, "/v1/completions", {"prompt": plain(30, 2).decode(), "max_tokens": 20,
                                                     "stream_options": {"include_usage": True}})
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    reader = Reader(resp)
    first = reader.step_until_text(healthy)
    # The client holds text while the worker waits to decode the next token: the reply is not finished.
    assert healthy.counts()["running"] == 1
    assert all(c["choices"][0]["finish_reason"] is None for c in first)
    healthy.backend.stepping = False
    healthy.backend.permits.release(1)
    rest = reader.rest()
    conn.close()
    assert rest[-1] == "[DONE]"
    usage_chunk, finish = rest[-2], rest[-3]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 20
    assert "barrel" in usage_chunk and all("barrel" not in c for c in [*first, *rest[:-2]])


def test_a_client_that_hangs_up_mid_stream_stops_the_generation(healthy: Served) -> None:
    before = metric(healthy, "barrel_requests_total", api="http", model="m", outcome="cancelled")
    generated = metric(healthy, "barrel_generated_tokens_total", model="m")
    healthy.backend.stepping = True
    conn, resp = stream(healthy, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}],
                                                          "max_tokens": 200})
    got = Reader(resp).step_until_text(healthy)
    assert got[0]["choices"][0]["delta"]["role"] == "assistant"
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert feed_until_idle(healthy) < 50   # 200 tokens were asked for; the worker stopped soon after
    wait_for(lambda: metric(healthy, "barrel_requests_total", api="http", model="m", outcome="cancelled") > before)
    assert metric(healthy, "barrel_generated_tokens_total", model="m") - generated < 50


def test_a_client_that_hangs_up_before_a_whole_reply_cancels_it_too(healthy: Served) -> None:
    healthy.backend.stepping = True
    sock = socket.create_connection(("127.0.0.1", healthy.port))
    body = json.dumps({"model": "m", "prompt": "waiting", "max_tokens": 200}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: healthy.counts()["running"] == 1)
    sock.close()
    assert feed_until_idle(healthy) < 50


def wait_for(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def feed_until_idle(served: Served) -> int:
    """Lets generation go on one decode at a time, slowly, until the model is idle; how many it took."""
    be = served.backend
    for given in range(1, 201):
        time.sleep(0.02)
        if served.counts()["running"] == 0:
            be.stepping = False
            return given
        be.permits.release(1)
    be.stepping = False
    return 200


def test_metrics_count_requests_tokens_hits_and_tiers(healthy: Served) -> None:
    requests = metric(healthy, "barrel_requests_total", api="http", model="m", outcome="length")
    prompt_tokens = metric(healthy, "barrel_prompt_tokens_total", model="m")
    healthy.complete(prompt=plain(40, 3).decode(), max_tokens=3)
    assert metric(healthy, "barrel_requests_total", api="http", model="m", outcome="length") == requests + 1
    assert metric(healthy, "barrel_prompt_tokens_total", model="m") == prompt_tokens + 40
    _, headers, text = healthy.request("GET", "/metrics")
    assert headers["content-type"].startswith("text/plain")
    for name in ("barrel_generated_tokens_total", "barrel_restored_tokens_total", "barrel_cache_misses_total",
                 "barrel_cache_evictions_total", "barrel_time_to_first_token_seconds_bucket",
                 'barrel_cache_hits_total{route="exact"}', 'barrel_cache_saves_total{reason="finish"}',
                 'barrel_cache_save_failures_total{cause="dropped"}', 'barrel_cache_tier_quota_bytes{tier="disk"}',
                 'barrel_cache_tier_bytes{tier="ram"}', 'barrel_queue_depth{model="m"}'):
        assert name in text, name
    assert metric(healthy, "barrel_cache_tier_quota_bytes", tier="disk") == 64 << 20
    assert metric(healthy, "barrel_cache_saves_total", reason="finish") >= 1


# ---- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "m", "prompt": "x", "max_tokens": "lots"}, ["max_tokens must be an integer"]),
        ({"model": "m", "prompt": "x", "max_tokens": True}, ["max_tokens must be an integer"]),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, ["temperature must be a number"]),
        ({"model": "m", "prompt": "x", "stream": "yes"}, ["stream must be true or false"]),
        ({"model": "m", "prompt": "x", "stop": [1]}, ["stop must be a string or a list"]),
        ({"model": "m", "prompt": 7}, ["prompt must be a string"]),
        ({"model": "m", "prompt": ""}, ["prompt is missing"]),
        ({"model": "m"}, ["prompt is missing"]),
        ({"model": 3, "prompt": "x"}, ["model must be a string"]),
        ({"model": "m", "prompt": "x", "n": 2}, ["n must be 1"]),
        ({"model": "m", "prompt": "x", "top_p": 1.5}, ["bad top_p 1.5"]),
        ({"model": "m", "prompt": "x", "top_p": 0}, ["bad top_p 0"]),
        ({"model": "m", "prompt": "x", "top_k": -1}, ["bad top_k -1"]),
        ({"model": "m", "prompt": "x", "top_k": 2.5}, ["top_k must be an integer"]),
        ({"model": "m", "prompt": "x", "min_p": 1.01}, ["bad min_p"]),
        ({"model": "m", "prompt": "x", "typical_p": 0}, ["bad typical_p"]),
        ({"model": "m", "prompt": "x", "repeat_penalty": 0}, ["bad repeat_penalty"]),
        ({"model": "m", "prompt": "x", "repeat_last_n": -2}, ["bad repeat_last_n"]),
        ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, ["bad presence_penalty"]),
        ({"model": "m", "prompt": "x", "frequency_penalty": -3}, ["bad frequency_penalty"]),
        ({"model": "m", "prompt": "x", "seed": 2**64}, ["bad seed"]),
        ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, ["bad logit_bias key 'a'"]),
        ({"model": "m", "prompt": "x", "logit_bias": {"\u00b2": 1}}, ["bad logit_bias key '\u00b2'"]),
        ({"model": "m", "prompt": "x", "logit_bias": {"9" * 5000: 1}}, ["bad logit_bias key '99999"]),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": 101}}, ["bad logit_bias[5]"]),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": "up"}}, ["bad logit_bias[5]"]),
        ({"model": "m", "prompt": "x", "logit_bias": {"99999": -100}}, ["bad logit_bias key 99999"]),
        ({"model": "m", "prompt": "x", "logprobs": 21}, ["bad logprobs 21"]),
        ({"model": "m", "prompt": "x", "response_format": {"type": "xml"}}, ["bad response_format type"]),
        ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema"}}, ["json_schema.schema"]),
        ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "thing"}}}}, ["not a valid JSON Schema"]),
        ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"not": {"type": "string"}}}}}, ["unsupported JSON Schema keyword 'not'"]),
        ({"model": "m", "prompt": "x", "grammar": "root ::= x", "response_format": {"type": "json_object"}},
         ["at most one"]),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, ["only allowed with stream"]),
        ({"model": "m", "prompt": "x", "max_tokens": N_CTX + 1}, ["bad max_tokens"]),
        ({"model": "m", "prompt": "x", "temperature": -1}, ["bad temperature"]),
        ({"model": "m", "prompt": "x", "seed": -5}, ["bad seed"]),
        ({"model": "m", "prompt": "x", "parent_key": "abc"}, ["bad parent key"]),
        ({"model": "m", "prompt": "x", "stop": [""]}, ["stop string"]),
        ({"model": "m", "prompt": "y" * (N_CTX + 10)}, ["context holds 256"]),
        ({"model": "m", "prompt": "\ud800"}, ["prompt holds an unpaired surrogate"]),
        ({"model": "m", "prompt": "x", "stop": "\udc00"}, ["stop holds an unpaired surrogate"]),
        ({"model": "m", "prompt": "x", "stop": ["ok", "\udc00"]}, ["stop holds an unpaired surrogate"]),
    ],
)
def test_bad_completion_requests_are_400(healthy: Served, body: dict, words: list[str]) -> None:
    status, _, doc = healthy.request("POST", "/v1/completions", body)
    assert_error(status, doc, 400, *words)
    assert doc["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "m"}, ["messages is missing"]),
        ({"model": "m", "messages": "hi"}, ["messages must be a list"]),
        ({"model": "m", "messages": []}, ["messages is empty"]),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, ["messages[0].role"]),
        ({"model": "m", "messages": [{"role": ["user"], "content": "x"}]}, ["messages[0].role"]),
        ({"model": "m", "messages": [{"role": "user", "content": None}]}, ["messages[0].content"]),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ["text parts"]),
        ({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}, ["messages[0].content holds"]),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         ["messages[0].content holds"]),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         ["bad max_tokens 0"]),
    ],
)
def test_bad_chat_requests_are_400(healthy: Served, body: dict, words: list[str]) -> None:
    assert_error(*healthy.request("POST", "/v1/chat/completions", body)[::2], 400, *words)


def test_malformed_bodies_are_4xx(healthy: Served) -> None:
    path = "/v1/completions"
    assert_error(*healthy.request("POST", path, raw=b"{not json")[::2], 400, "not valid JSON")
    assert_error(*healthy.request("POST", path, raw=b"[1, 2]")[::2], 400, "must be a JSON object")
    assert_error(*healthy.request("POST", path, raw=b"[" * 100_000)[::2], 400, "not valid JSON")
    assert_error(*healthy.request("POST", path, raw=b"\xff\xfe")[::2], 400, "not valid JSON")
    status, _, doc = healthy.request("POST", path, raw=b"prompt=hi",
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert_error(status, doc, 415, "application/json")
    status, _, doc = healthy.request("POST", path, raw=b"{}", headers={"Content-Length": str(MAX_BODY + 1)})
    assert_error(status, doc, 413, "body over")


def test_a_body_past_the_cap_without_a_length_is_413_before_it_is_all_read(healthy: Served) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", healthy.port, timeout=30)
    block = b'{"prompt": "' + b"a" * (1 << 20)
    conn.request("POST", "/v1/completions", body=iter([block] * 40), encode_chunked=True,
                 headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    assert_error(resp.status, json.loads(resp.read()), 413, "body over")
    conn.close()


def test_unknown_model_route_and_method_are_404_and_405(healthy: Served) -> None:
    status, _, doc = healthy.request("POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    assert_error(status, doc, 404, "unknown model 'nope'")
    assert doc["error"]["code"] == "model_not_found"
    assert_error(*healthy.request("GET", "/v1/engines")[::2], 404, "/v1/engines")
    assert_error(*healthy.request("GET", "/v1/completions")[::2], 405)


def test_a_full_queue_is_429_with_retry_after(healthy: Served) -> None:
    healthy.backend.stepping = True
    replies: list[int] = []

    def send(prompt: str) -> None:
        body = {"model": "m", "prompt": prompt, "max_tokens": 2}
        replies.append(healthy.request("POST", "/v1/completions", body)[0])

    running = threading.Thread(target=send, args=("running one",))
    running.start()
    wait_for(lambda: healthy.counts()["running"] == 1)
    queued = threading.Thread(target=send, args=("queued one",))
    queued.start()
    wait_for(lambda: healthy.counts()["queued"] == 1)
    status, headers, doc = healthy.request("POST", "/v1/completions", {"model": "m", "prompt": "one too many"})
    assert_error(status, doc, 429, "queued")
    assert headers["retry-after"] == "1" and doc["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        healthy.sdk().completions.create(model="m", prompt="and again")
    healthy.backend.stepping = False
    healthy.backend.permits.release(1000)
    for t in (running, queued):
        t.join(10)
    assert replies == [200, 200]


def test_a_bug_is_500_logged_and_the_server_goes_on(healthy: Served, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(healthy.registry, "models", broken)
    status, _, doc = healthy.request("GET", "/v1/models")
    assert_error(status, doc, 500, "internal error", "a bug")
    assert doc["error"]["type"] == "server_error"
    assert "/v1/models failed" in caplog.text and "RuntimeError: a bug" in caplog.text


# ---- keys ---------------------------------------------------------------------------------------------


def test_keys_are_enforced_on_every_route_but_health(tmp_path: Path) -> None:
    guarded = Served(tmp_path, Tenants((TenantKey("other", b"another-key"), TenantKey("tester", KEY.encode()))))
    try:
        assert guarded.request("GET", "/health")[0] == 200
        for path in ("/v1/models", "/metrics"):
            status, headers, doc = guarded.request("GET", path)
            assert_error(status, doc, 401, "missing API key")
            assert headers["www-authenticate"] == "Bearer"
            status, _, doc = guarded.request("GET", path, headers={"Authorization": f"Bearer {KEY}x"})
            assert_error(status, doc, 401, "invalid API key")
            assert guarded.request("GET", path, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        status, _, doc = guarded.request("POST", "/v1/completions", {"model": "m", "prompt": "x"},
                                         headers={"Authorization": "Basic dXNlcg=="})
        assert_error(status, doc, 401)
        with pytest.raises(openai.AuthenticationError):
            guarded.sdk(api_key="wrong").completions.create(model="m", prompt="hi", max_tokens=2)
        reply = guarded.sdk(api_key=KEY).completions.create(model="m", prompt="hi", max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens == 2
    finally:
        guarded.close()


def test_each_tenant_checks_a_tool_schema_once_and_its_own_memo_only(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents resend the same tools every request; their schemas' checks are remembered, but per tenant: a
    shared memo would let one tenant time whether another had sent the same tools."""
    checked, check = [], tools.schema_problem
    monkeypatch.setattr(tools, "schema_problem", lambda schema: checked.append(schema) or check(schema))
    guarded = Served(tmp_path, Tenants((TenantKey("other", b"another-key"), TenantKey("tester", KEY.encode()))))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}]}
    try:
        for key in (KEY, KEY, "another-key", KEY):
            status, _, doc = guarded.request("POST", "/v1/messages/count_tokens", body, headers={"x-api-key": key})
            assert status == 200 and doc["input_tokens"] > 0, doc
        assert len(checked) == 2
    finally:
        guarded.close()


def test_a_miss_says_where_the_prompt_stopped_matching_the_closest_cached_text(healthy: Served) -> None:
    system = "Agent. Now: 2026-12-01T14:03:12Z. " + plain(80, 9).decode()
    first = healthy.complete(prompt=system)
    assert "divergence" not in first["barrel"]["cache"] or first["barrel"]["cache"]["divergence"]["matched_bytes"] < 40
    later = healthy.complete(prompt=system.replace("14:03:12", "14:03:19"))
    d = later["barrel"]["cache"]["divergence"]
    assert d["prompt"].startswith("9Z. ") and d["cached"].startswith("2Z. ") and d["matched_tokens"] > 0

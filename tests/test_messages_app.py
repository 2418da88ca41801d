"""Anthropic's Messages API in-process over FakeBackend (see tests/test_http_app.py): the SSE events in
order, keep-alive pings while the model has not answered, keys as x-api-key, and errors in Anthropic's shape.
tests/test_anthropic.py runs the real SDK on the real model.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import barreld.http.streaming as streaming
from barreld.tenants import TenantKey, Tenants
from tests.test_http_app import KEY, Served, wait_for


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("messages"))
    yield s
    s.close()


BODY = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]}


def events(resp: http.client.HTTPResponse) -> Iterator[tuple[str, dict]]:
    """(event name, data) of an SSE stream as they arrive."""
    name = ""
    while line := resp.readline():
        line = line.strip()
        if line.startswith(b"event: "):
            name = line[len(b"event: "):].decode()
        elif line.startswith(b"data: "):
            data = json.loads(line[len(b"data: "):])
            assert data["type"] == name
            yield name, data


def open_stream(served: Served, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.request("POST", "/v1/messages?beta=true", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01",
                          "anthropic-beta": "interleaved-thinking-2025-05-14"})
    return conn, conn.getresponse()


def test_a_stream_sends_anthropics_events_in_order(served: Served) -> None:
    conn, resp = open_stream(served, BODY)
    got = list(events(resp))
    conn.close()
    names = [n for n, _ in got]
    assert names[:2] == ["message_start", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"} and names[-3] == "content_block_stop"
    delta = got[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 5
    assert delta["barrel"]["cache"]["path"] in ("miss", "live", "exact")
    text = "".join(d["delta"]["text"] for n, d in got if n == "content_block_delta")
    whole = served.request("POST", "/v1/messages", BODY)[2]
    assert whole["content"] == [{"type": "text", "text": text}] and whole["stop_reason"] == "max_tokens"


@contextlib.contextmanager
def no_decodes(served: Served, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Pings every 50 ms while the model decodes nothing until the yielded function lets it run."""
    monkeypatch.setattr(streaming, "PING_SECONDS", 0.05)
    served.backend.permits = threading.Semaphore(0)  # none left over from an earlier test

    def release() -> None:
        served.backend.stepping = False
        served.backend.permits.release(1000)

    served.backend.stepping = True
    try:
        yield release
    finally:
        release()
        wait_for(lambda: served.counts()["running"] == 0)


def test_pings_keep_the_stream_alive_while_no_token_comes(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    with no_decodes(served, monkeypatch) as release:
        fresh = {**BODY, "messages": [{"role": "user", "content": "a prompt no other test sends"}]}
        conn, resp = open_stream(served, fresh)  # nothing to restore: the first token needs a decode
        stream = events(resp)
        assert next(stream)[0] == "message_start"  # at once, before any decode
        assert next(stream)[0] == "ping"
        release()
        assert [n for n, _ in stream][-1] == "message_stop"
        conn.close()


def test_an_openai_stream_sends_comment_keep_alives_too(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    with no_decodes(served, monkeypatch) as release:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
        body = {"model": "m", "stream": True, "max_tokens": 3, "messages": [{"role": "user", "content": "keep me"}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        lines = [resp.readline() for _ in range(4)]  # the role chunk and its blank line, then a keep-alive
        assert lines[0].startswith(b"data: ") and lines[2] == b": keep-alive\n"
        release()
        assert resp.read().endswith(b"data: [DONE]\n\n")
        conn.close()


def test_count_tokens_counts_the_rendered_prompt(served: Served) -> None:
    status, _, small = served.request("POST", "/v1/messages/count_tokens", {**BODY, "max_tokens": None})
    assert status == 200
    longer = {**BODY, "system": [{"type": "text", "text": "be brief " * 10}]}
    assert served.request("POST", "/v1/messages/count_tokens", longer)[2]["input_tokens"] > small["input_tokens"] > 0


@pytest.mark.parametrize(("body", "status", "kind", "says"), [
    ({**BODY, "max_tokens": None}, 400, "invalid_request_error", "max_tokens is missing"),
    ({**BODY, "model": "nope"}, 404, "not_found_error", "nope"),
    ({**BODY, "system": [{"type": "image"}]}, 400, "invalid_request_error", "image blocks are not supported"),
    ({**BODY, "messages": []}, 400, "invalid_request_error", "messages is missing or empty"),
    ({**BODY, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
     400, "invalid_request_error", "input must be an object"),
])
def test_errors_come_in_anthropics_shape(served: Served, body: dict, status: int, kind: str, says: str) -> None:
    got, _, doc = served.request("POST", "/v1/messages", body)
    assert got == status and doc["type"] == "error" and doc["error"]["type"] == kind, doc
    assert says in doc["error"]["message"]


def test_a_key_is_taken_as_x_api_key_or_bearer(tmp_path: Path) -> None:
    guarded = Served(tmp_path, Tenants((TenantKey("tester", KEY.encode()),)))
    try:
        status, _, doc = guarded.request("POST", "/v1/messages", BODY, headers={"x-api-key": "wrong"})
        assert status == 401 and doc["error"]["type"] == "authentication_error"
        for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
            assert guarded.request("POST", "/v1/messages", BODY, headers=headers)[0] == 200
    finally:
        guarded.close()


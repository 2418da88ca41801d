"""Compatibility points that llama.cpp's own server tests and OpenAI's clients rely on, on the fake model behind the
real HTTP app: `system_fingerprint` on every chat and completion object, `context_length_exceeded` for a prompt
past the context, every API route also without /v1, and the Responses route, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.test_http_app import N_CTX, Served


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("compat"))
    yield s
    s.close()


def test_chat_and_completion_objects_and_chunks_carry_a_system_fingerprint(served: Served) -> None:
    done = served.complete(prompt="hello")
    assert done["system_fingerprint"].startswith("barrel-")
    status, _, chat = served.request("POST", "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert status == 200 and chat["system_fingerprint"] == done["system_fingerprint"]
    stream = served.sdk().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, stream=True)
    assert {c.system_fingerprint for c in stream} == {done["system_fingerprint"]}


def test_a_prompt_past_the_context_says_context_length_exceeded(served: Served) -> None:
    status, _, doc = served.request("POST", "/v1/completions", {"model": "m", "prompt": "word " * N_CTX * 2})
    assert status == 400 and doc["error"]["code"] == "context_length_exceeded", doc
    assert "shorten it" in doc["error"]["message"]


@pytest.mark.parametrize("path", ["/completions", "/chat/completions", "/models", "/responses"])
def test_every_api_route_answers_without_v1_too(served: Served, path: str) -> None:
    body = {"model": "m", "max_tokens": 3, "prompt": "x", "messages": [{"role": "user", "content": "x"}],
            "input": "x", "max_output_tokens": 3}
    status, _, doc = served.request("GET" if path == "/models" else "POST", path,
                                    None if path == "/models" else body)
    assert status == 200, doc


def test_the_responses_route_whole_and_streamed_and_its_stored_response(served: Served) -> None:
    status, _, whole = served.request("POST", "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 4})
    assert status == 200 and whole["object"] == "response" and whole["output"][0]["type"] == "message"
    assert whole["usage"]["input_tokens"] > 0 and whole["status"] == "incomplete"  # the fake runs to its cap
    status, _, again = served.request("GET", f"/v1/responses/{whole['id']}")
    assert status == 200 and again == whole
    status, headers, text = served.request("POST", "/v1/responses", {
        "model": "m", "input": "hi", "max_output_tokens": 4, "stream": True, "store": False})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    status, _, gone = served.request("GET", f"/v1/responses/{events[-1]['response']['id']}")
    assert status == 404 and gone["error"]["code"] == "not_found"
    status, _, deleted = served.request("DELETE", f"/v1/responses/{whole['id']}")
    assert status == 200 and deleted["deleted"] is True

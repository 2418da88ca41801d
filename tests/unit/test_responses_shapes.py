"""The Responses API's shapes without a model: Codex CLI's captured request read as Barrel runs it, input items to
messages, the hosted tools left out, errors, and the engine's reply events (from the real reply reader) framed as
OpenAI's numbered stream events in OpenAI's order."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from barreld.engine.callformats import GENERIC
from barreld.engine.callformats.generic import Generic
from barreld.engine.reply import Finish, ReplyReader
from barreld.engine.request import CacheReport, Done, Started, Timings, Token
from barreld.errors import InvalidArgument
from barreld.http.response_store import ResponseStore, Stored
from barreld.http.responses import ResponseReply, parse_responses

DATA = Path(__file__).resolve().parents[1] / "data"
FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
MODEL = SimpleNamespace(name="m")


def test_codex_clis_request_reads_as_messages_and_tools() -> None:
    doc = json.loads((DATA / "codex-request.json").read_text())
    req = parse_responses(doc, None)
    roles = [m.role for m in req.call.messages]
    assert roles[0] == "system" and "user" in roles
    assert req.call.tools is not None and len(req.call.tools.tools) >= 7
    assert "web_search" in req.left_out
    assert req.namespaces["spawn_agent"] == "multi_agent_v1"  # its calls go back under their namespace
    assert req.call.stream and not req.store


def test_items_become_turns_calls_join_their_assistant_turn_and_outputs_answer_them() -> None:
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "reasoning", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"}]
    req = parse_responses({"model": "m", "instructions": "Rules.", "input": items, "tools": [FUNCTION]}, None)
    m = req.call.messages
    assert [x.role for x in m] == ["system", "system", "user", "assistant", "tool"]
    assert m[3].content == "Let me look." and m[3].tool_calls[0].arguments == '{"city": "Oslo"}'
    assert m[4].tool_call_id == "c1" and m[4].content == "rain"
    assert req.history == m[1:]  # the instructions are the request's own, never carried on


def test_a_namespace_offers_its_tools_and_a_named_choice_forces_one() -> None:
    spaced = {"type": "namespace", "name": "ns", "description": "d", "tools": [FUNCTION]}
    req = parse_responses({"model": "m", "input": "x", "tools": [spaced, {"type": "file_search"}],
                           "tool_choice": {"type": "function", "name": "get_weather"}}, None)
    assert [t.name for t in req.call.tools.tools] == ["get_weather"] and req.call.tools.forced
    assert req.left_out == ("file_search",) and req.namespaces == {"get_weather": "ns"}
    with pytest.raises(InvalidArgument, match="same name"):  # tool_spec's check, as on every route
        parse_responses({"model": "m", "input": "x", "tools": [spaced, FUNCTION]}, None)


@pytest.mark.parametrize(("body", "says"), [
    ({"input": ""}, "input is missing"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text-only"),
    ({"input": [{"type": "function_call_output", "call_id": "nobody", "output": "x"}]}, "no function_call"),
    ({"input": [{"type": "web_search_call"}]}, "not supported"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
])
def test_bad_bodies_are_refused_with_what_to_send(body: dict, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        parse_responses({"model": "m", **body}, None)


def test_a_continuation_resumes_the_stored_conversation_from_its_key() -> None:
    store = ResponseStore(None)
    first = parse_responses({"model": "m", "input": "Hi", "instructions": "Old rules."}, None)
    store.put("alice", Stored({"id": "resp_1"}, first.history, "ab" * 32))
    assert store.get("bob", "resp_1") is None  # another tenant's id reads as unknown
    previous = store.get("alice", "resp_1")
    req = parse_responses({"model": "m", "input": "More", "instructions": "New rules."}, previous)
    assert [m.content for m in req.call.messages] == ["New rules.", "Hi", "More"]
    assert req.call.parent_key == "ab" * 32
    assert store.delete("alice", "resp_1") and store.get("alice", "resp_1") is None


def test_the_oldest_responses_go_first_past_the_quota() -> None:
    store = ResponseStore(None, quota=3000)
    for i in range(10):
        store.put("t", Stored({"id": f"resp_{i}", "pad": "x" * 500}, (), ""))
    kept = [i for i in range(10) if store.get("t", f"resp_{i}") is not None]
    assert kept and kept == list(range(10 - len(kept), 10)) and len(kept) < 10


class Thinking(Generic):
    """Calls as JSON objects, reasoning between <think> marks (the Responses route reads whichever the model's)."""

    think = ("<think>", "</think>")


THINKING = Thinking()


def events(body: dict, pieces: list[str], reason: str = "stop") -> tuple[list[dict], dict]:
    """The stream's events for a reply made of `pieces`, through the real reply reader, and the stored doc."""
    req = parse_responses({"model": "m", "stream": True, **body}, None)
    params = req.call.params(4096)
    reader = ReplyReader(params, THINKING)
    kept: list[Stored] = []
    reply = ResponseReply(req, MODEL, kept.append)  # type: ignore[arg-type]
    frames = reply.frames(Started(CacheReport(), 10, b"p"))
    for piece in pieces:
        for ev in reader.read(Token(piece.encode())):
            frames += reply.frames(ev)
    done = Done("".join(pieces).encode(), reason, b"k" * 32, b"p", CacheReport(), 10, len(pieces), Timings())
    for ev in reader.finish(done, b"prompt", lambda p: b""):
        frames += reply.frames(ev)
    docs = [json.loads(f.split(b"data: ", 1)[1]) for f in frames]
    assert [f.split(b"\n", 1)[0] for f in frames] == [b"event: " + d["type"].encode() for d in docs]
    return docs, (kept[0].doc if kept else {})


def test_text_streams_in_openais_order_with_numbered_events() -> None:
    docs, stored = events({"input": "Hi"}, ["Hel", "lo ", "there"])
    assert [d["type"] for d in docs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [d["sequence_number"] for d in docs] == list(range(len(docs)))
    final = docs[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello there" and final["status"] == "completed"
    assert final["usage"]["input_tokens"] == 10 and stored["id"] == final["id"]


def test_reasoning_and_a_call_become_their_own_items() -> None:
    reply = ["<think>", "rain?", "</think>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}']
    docs, _ = events({"input": "Hi", "tools": [FUNCTION], "store": False}, reply)
    kinds = [d["type"] for d in docs]
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" not in kinds
    final = docs[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "rain?"
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Oslo"}
    assert kinds[-1] == "response.completed"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    docs, _ = events({"input": "Hi"}, ["Once upon"], "length")
    assert docs[-1]["type"] == "response.incomplete"
    assert docs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_call_to_a_namespaced_tool_names_its_namespace() -> None:
    spaced = {"type": "namespace", "name": "weather_v1", "description": "d", "tools": [FUNCTION]}
    reply = ['{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}']
    docs, _ = events({"input": "Hi", "tools": [spaced], "store": False}, reply)
    call = docs[-1]["response"]["output"][0]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "get_weather", "weather_v1")


def test_the_finish_holds_what_was_shown() -> None:
    reader = ReplyReader(parse_responses({"model": "m", "input": "x"}, None).call.params(4096), GENERIC)
    shown = [ev.text for p in ("a", "b\xc3") for ev in reader.read(Token(p.encode("latin-1")))]
    done = Done("ab\xc3".encode("latin-1"), "stop", b"k", b"p", CacheReport(), 1, 2, Timings())
    last = reader.finish(done, b"", lambda p: b"")
    assert isinstance(last[-1], Finish) and last[-1].content == "".join(shown) + "".join(
        e.text for e in last[:-1])

"""Conversations as input, without a model: bad messages files are refused by the CLI before any daemon is
asked (exit 2, one line naming the problem), and the daemon's own checks of a CompleteRequest's messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from barrelctl.conversation import parse_messages, write_messages
from barrelctl.errors import CliError
from barreld.cache.key import DEFAULT_NAMESPACE
from barreld.engine.chat import Message
from barreld.errors import InvalidArgument
from barreld.rpc import barrel_pb2 as pb
from barreld.server.servicer import grpc_request
from barreld.service.calls import MAX_TEMPLATE
from tests.support.sandbox import Sandbox

BAD_FILES = [
    (b"[{'role': 'user'}]", "not JSON (Expecting property name enclosed in double quotes: line 1 column 3"),
    (b"", "not JSON (Expecting value: line 1 column 1"),
    (b"\xff\xfe[]", "not JSON"),
    (b'{"messages": []}', "expected a JSON array of messages, got an object"),
    (b'"hi"', "expected a JSON array of messages, got a string"),
    (b"null", "expected a JSON array of messages, got null"),
    (b"[]", "messages is empty; send at least one message"),
    (b'[{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]',
     "messages[1].role 'robot' is not one of system, user, assistant, tool"),
    (b'[{"role": "user", "content": ["a"]}]', "messages[0].content must be a string, got list"),
    (b'[{"role": "user"}]', "messages[0] has no content"),
    (b'[{"content": "x"}]', "messages[0] has no role"),
    (b'["hello"]', "messages[0] is not an object with a role and a content"),
    (b'[{"role": "user", "content": "\\ud800"}]', "messages[0].content holds an unpaired surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
]


@pytest.mark.parametrize(("data", "says"), BAD_FILES, ids=range(len(BAD_FILES)))
def test_a_bad_messages_file_is_named_with_its_problem(data: bytes, says: str) -> None:
    with pytest.raises(CliError) as caught:
        parse_messages(data, "chat.json")
    assert caught.value.code == 2
    assert str(caught.value).startswith("bad messages in chat.json: ")
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_saved_conversation_reads_back_the_same(tmp_path: Path) -> None:
    conversation = (Message("system", "Be brief."), Message("user", "Grüße, \"quotes\"\nand lines"),
                    Message("assistant", "ok"), Message("tool", "{}"))
    path = tmp_path / "chat.json"
    path.write_text("old")
    write_messages(path, conversation)
    assert parse_messages(path.read_bytes(), str(path)) == conversation
    assert json.loads(path.read_text())[1] == {"role": "user", "content": "Grüße, \"quotes\"\nand lines"}
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"]   # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o600   # a conversation is private


@pytest.fixture(scope="module")
def box() -> Sandbox:
    """A sandbox with no daemon: a bad file must be refused before anyone is asked."""
    with Sandbox.new() as w:
        yield w


@pytest.mark.parametrize("command", [("complete", "--messages"), ("chat", "--resume")])
def test_the_cli_refuses_a_bad_file_before_asking_a_daemon(box: Sandbox, command: tuple[str, str]) -> None:
    path = box.base / "bad.json"
    path.write_text('[{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]')
    r = box.ctl("--no-autostart", *command, str(path), input=b"")
    assert r.rc == 2, (r.rc, r.err)
    assert r.err.strip() == f"barrelctl: bad messages in {path}: messages[1].role 'wizard' is not one of " \
                            "system, user, assistant, tool"
    assert r.out == ""


@pytest.mark.parametrize(("data", "says"), [BAD_FILES[i] for i in (0, 3, 6, 8, 9, 10)])
def test_each_kind_of_bad_file_is_one_line_and_exit_2(box: Sandbox, data: bytes, says: str) -> None:
    r = box.ctl("--no-autostart", "complete", "--messages", "-", input=data)
    assert r.rc == 2, (r.rc, r.err)
    assert r.err.startswith("barrelctl: bad messages in stdin: ") and says in r.err
    assert len(r.err.splitlines()) == 1


def test_messages_from_stdin_and_files_that_cannot_be_read(box: Sandbox) -> None:
    r = box.ctl("--no-autostart", "complete", "--messages", "-", input=b"[]")
    assert (r.rc, r.err.strip()) == (2, "barrelctl: bad messages in stdin: messages is empty; send at least one "
                                        "message")
    r = box.ctl("--no-autostart", "complete", "--messages", str(box.base / "missing.json"))
    assert r.rc == 2 and r.err.strip() == f"barrelctl: cannot read messages file {box.base / 'missing.json'}: " \
                                          "No such file or directory"
    r = box.ctl("--no-autostart", "complete", "hello", "--messages", "-", input=b"[]")
    assert (r.rc, r.err.strip()) == (2, "barrelctl: pass either PROMPT or --messages, not both")


@pytest.mark.parametrize(("args", "says"), [
    (("--json", "chat"), "chat has no JSON output; use `complete --messages FILE` in scripts"),
    (("chat", "--resume", "-"), "--resume needs a file: stdin carries the conversation's new messages"),
    (("chat", "--max-tokens", "0"), "bad --max-tokens 0: must be at least 1"),
])
def test_chat_usage_errors(box: Sandbox, args: tuple[str, ...], says: str) -> None:
    r = box.ctl("--no-autostart", *args, input=b"hi\n")
    assert (r.rc, r.err.strip()) == (2, f"barrelctl: {says}")


def _request(**fields) -> pb.CompleteRequest:
    return pb.CompleteRequest(**fields)


USER = [pb.Message(role="user", content="hi")]


@pytest.mark.parametrize(("fields", "says"), [
    ({"prompt": b"x", "messages": USER}, "send either a prompt or messages, not both"),
    ({}, "the prompt is empty"),
    ({"prompt": b"x", "chat_template": "{{ 1 }}"}, "a chat template applies only to messages or a chat prompt"),
    ({"messages": USER, "chat_template": "x" * (MAX_TEMPLATE + 1)}, f"at most {MAX_TEMPLATE}"),
    ({"messages": [pb.Message(role="robot", content="x")]}, "messages[0].role 'robot' is not one of"),
])
def test_the_daemon_checks_a_requests_messages(fields: dict, says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        grpc_request(_request(**fields), DEFAULT_NAMESPACE).params(4096)
    assert says in str(caught.value)


def test_messages_reach_the_engine_with_their_template() -> None:
    params = grpc_request(_request(messages=USER, chat=True, chat_template="{{ 1 }}"), DEFAULT_NAMESPACE).params(4096)
    assert params.messages == (Message("user", "hi"),)
    assert params.chat_template == "{{ 1 }}"
    chat = grpc_request(_request(prompt=b"x", chat=True, chat_template="t"), DEFAULT_NAMESPACE).params(4096)
    assert chat.chat_template == "t"
    assert grpc_request(_request(prompt=b"x"), DEFAULT_NAMESPACE).params(4096).chat_template is None

"""Conversations as files: the OpenAI `messages` array (`[{"role": ..., "content": ...}, ...]`) that
`complete --messages`, `chat --resume` and the chat's `/save` read and write.

A file is checked here, before anything is sent, by the same rules the daemon applies again, so a bad one
is exit 2 with one line naming the message and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from barrelctl.errors import EXIT_USAGE, CliError
from barreld.engine.chat import Message, messages_from
from barreld.errors import InvalidArgument

JSON_KINDS = {dict: "an object", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def parse_messages(data: bytes, source: str) -> tuple[Message, ...]:
    """The messages in `data`, a JSON array; CliError (exit 2) naming `source` and the first problem."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CliError(f"bad messages in {source}: not JSON ({exc})", EXIT_USAGE) from None
    except RecursionError:
        raise CliError(f"bad messages in {source}: nested too deeply to be a messages array", EXIT_USAGE) from None
    if not isinstance(doc, list):
        kind = "null" if doc is None else JSON_KINDS.get(type(doc), type(doc).__name__)
        raise CliError(f"bad messages in {source}: expected a JSON array of messages, got {kind}", EXIT_USAGE)
    try:
        messages = messages_from(doc)
    except InvalidArgument as exc:
        raise CliError(f"bad messages in {source}: {exc}", EXIT_USAGE) from None
    for i, m in enumerate(messages):
        try:
            m.content.encode("utf-8")
        except UnicodeEncodeError:
            raise CliError(f"bad messages in {source}: messages[{i}].content holds an unpaired surrogate "
                           "escape (\\ud800-\\udfff), which is not text", EXIT_USAGE) from None
    return messages


def read_messages(path: str) -> tuple[Message, ...]:
    """Messages from a file, or from stdin for `-`."""
    if path == "-":
        return parse_messages(sys.stdin.buffer.read(), "stdin")
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read messages file {path}: {exc.strerror or exc}", EXIT_USAGE) from None
    return parse_messages(data, path)


def write_messages(path: Path, messages: Sequence[Message]) -> None:
    """Writes the conversation through a temporary file and a rename, so an existing file is replaced whole
    or not at all."""
    doc = [{"role": m.role, "content": m.content} for m in messages]
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    path = path.expanduser()
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise

"""Conversations to prompt bytes: the one renderer that gRPC's `messages`, `complete --chat` and the HTTP
chat endpoint all use, so the same conversation renders to the same bytes (and the same cache keys)
whichever way it arrives.

Templates are the model's own Jinja chat template (the GGUF's `tokenizer.chat_template`), run in Jinja's
immutable sandbox: a template comes from a file or a client, and must not reach anything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from barreld.errors import FailedPrecondition, InvalidArgument

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 4096


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def messages_from(items: Iterable[object]) -> tuple[Message, ...]:
    """Messages from OpenAI-shaped dicts ({"role", "content"}, other keys ignored); InvalidArgument naming
    the first bad one. Shared by every front end, so each refuses exactly the same conversations."""
    out: list[Message] = []
    for i, item in enumerate(items):
        if i >= MAX_MESSAGES:
            raise InvalidArgument(f"too many messages; at most {MAX_MESSAGES}")
        if not isinstance(item, Mapping):
            raise InvalidArgument(f"messages[{i}] is not an object with a role and a content")
        out.append(_message(i, item))
    if not out:
        raise InvalidArgument("messages is empty; send at least one message")
    return tuple(out)


def _message(i: int, item: Mapping) -> Message:
    missing = [key for key in ("role", "content") if key not in item]
    if missing:
        raise InvalidArgument(f"messages[{i}] has no {' and no '.join(missing)}")
    role, content = item["role"], item["content"]
    if role not in ROLES:
        shown = repr(role)[:40]
        raise InvalidArgument(f"messages[{i}].role {shown} is not one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise InvalidArgument(f"messages[{i}].content must be a string, got {type(content).__name__}")
    return Message(role, content)


def render(
    template: str | None,
    messages: tuple[Message, ...],
    *,
    bos: str,
    eos: str,
    model: str,
) -> bytes:
    """The conversation rendered by `template`, ending with the cue for the assistant's next turn.

    No template (a base model) is FailedPrecondition naming the model; a template that fails on these
    messages (many refuse a system role, or turns out of order) is InvalidArgument with its own words.
    """
    if not template:
        raise FailedPrecondition(
            f"model {model} has no chat template; send a plain prompt, or give a template with the request"
        )
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidArgument(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        text = env.from_string(template).render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            bos_token=bos,
            eos_token=eos,
        )
    except jinja2.TemplateError as exc:
        raise InvalidArgument(f"the chat template failed: {exc}") from None
    return text.encode("utf-8", "replace")

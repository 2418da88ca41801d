"""Conversations rendered through a chat template: the renderer every front end shares, and the worker's use of it."""

from __future__ import annotations

import pytest

from barreld.engine import chat
from barreld.engine.chat import Message, messages_from, render, render_with_ends
from barreld.errors import FailedPrecondition, InvalidArgument
from tests.fakes.backend import CHAT_TEMPLATE, render_user_turn

from .conftest import Engine

CONVERSATION = (
    Message("system", "Be brief."),
    Message("user", "Why is the sky blue?"),
    Message("assistant", "Rayleigh scattering."),
    Message("user", "And sunsets?"),
)


def test_every_role_renders_in_order_and_ends_with_the_assistant_cue() -> None:
    out = render(CHAT_TEMPLATE, CONVERSATION, bos="<s>", eos="</s>", model="m")
    assert out == (
        b"<|system|>Be brief.<|end|>\n<|user|>Why is the sky blue?<|end|>\n"
        b"<|assistant|>Rayleigh scattering.<|end|>\n<|user|>And sunsets?<|end|>\n<|assistant|>"
    )


def test_message_ends_are_where_each_message_renders_to_a_prefix_of_the_whole() -> None:
    out, ends = render_with_ends(CHAT_TEMPLATE, CONVERSATION, bos="<s>", eos="</s>", model="m")
    assert out == render(CHAT_TEMPLATE, CONVERSATION, bos="<s>", eos="</s>", model="m")
    assert len(ends) == len(CONVERSATION) and ends[-1] < len(out)
    assert all(out[:e].endswith(m.content.encode() + b"<|end|>\n") for e, m in zip(ends, CONVERSATION, strict=True))


def test_a_template_that_renders_a_turn_by_what_follows_it_gives_only_the_ends_it_keeps() -> None:
    # the last message is rendered otherwise than the ones before it: a cut there is no prefix of the whole
    template = ("{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }};"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    out, ends = render_with_ends(template, CONVERSATION[:3], bos="", eos="", model="m")
    assert out == b"Be brief.;Why is the sky blue?;[Rayleigh scattering.]>" and ends == (len(out) - 1,)
    refusing = "{% if messages[-1].role != 'user' %}{{ raise_exception('last must be user') }}{% endif %}" + template
    out, ends = render_with_ends(refusing, CONVERSATION, bos="", eos="", model="m")
    assert out.endswith(b"[And sunsets?]>") and ends == (len(out) - 1,)  # cut after a user turn only


def test_a_long_conversation_looks_for_its_first_and_last_ends_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat, "MESSAGE_ENDS_HEAD", 1)
    monkeypatch.setattr(chat, "MESSAGE_ENDS_TAIL", 1)
    out, ends = render_with_ends(CHAT_TEMPLATE, CONVERSATION, bos="<s>", eos="</s>", model="m")
    assert len(ends) == 2 and out[: ends[0]].endswith(b"brief.<|end|>\n") and out[: ends[1]].endswith(b"sets?<|end|>\n")


def test_openai_shaped_dicts_become_messages_and_other_keys_are_ignored() -> None:
    got = messages_from([{"role": "user", "content": "hi", "name": "x"}, {"role": "tool", "content": "{}"}])
    assert got == (Message("user", "hi"), Message("tool", "{}"))


@pytest.mark.parametrize(
    ("items", "says"),
    [
        ([], "messages is empty"),
        (["hi"], r"messages\[0\] is not an object"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\.role 'robot'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string, got int"),
        ([{"content": "a"}], r"messages\[0\] has no role$"),
        ([{"role": "user"}, {}], r"messages\[0\] has no content$"),
        ([{"role": "user", "content": ""}, {}], r"messages\[1\] has no role and no content"),
        ([{"role": None, "content": "a"}], r"messages\[0\]\.role None"),
    ],
)
def test_a_bad_conversation_is_refused_naming_the_message(items: list, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        messages_from(items)


def test_a_model_without_a_template_is_a_failed_precondition_naming_it() -> None:
    with pytest.raises(FailedPrecondition, match="model base-1 has no chat template"):
        render(None, CONVERSATION, bos="", eos="", model="base-1")


def test_a_template_that_refuses_the_messages_says_so() -> None:
    template = "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    with pytest.raises(InvalidArgument, match="refused the messages: no system role"):
        render(template, CONVERSATION, bos="", eos="", model="m")
    with pytest.raises(InvalidArgument, match="the chat template failed"):
        render("{% for %}", CONVERSATION, bos="", eos="", model="m")


def test_the_sandbox_keeps_templates_away_from_python() -> None:
    with pytest.raises(InvalidArgument, match="the chat template failed"):
        render("{{ ''.__class__.__mro__ }}", CONVERSATION, bos="", eos="", model="m")


def test_the_worker_renders_messages_and_chat_alike(engine: Engine) -> None:
    be = engine.backend()
    by_messages = engine.run(b"", messages=(Message("user", "why is the sky blue?"),))
    by_chat = engine.run(b"why is the sky blue?", chat=True)
    raw = engine.cold(render_user_turn(b"why is the sky blue?"))
    assert by_messages.started.prompt_tokens == len(be.tokenize(render_user_turn(b"why is the sky blue?")))
    assert by_messages.text == by_chat.text == raw.text


def test_a_request_template_serves_a_model_without_one(engine: Engine) -> None:
    type(engine.backend()).chat_template = None
    try:
        with pytest.raises(FailedPrecondition, match="model m has no chat template"):
            engine.submit(b"", messages=CONVERSATION)  # refused before it queues: the caller renders
        reply = engine.run(b"", messages=CONVERSATION, chat_template=CHAT_TEMPLATE)
        assert reply.done.finish_reason in ("stop", "length")
    finally:
        type(engine.backend()).chat_template = CHAT_TEMPLATE


def test_a_configured_template_replaces_the_models_own(engine: Engine) -> None:
    engine.load("t", chat_template="<<{{ messages[0].content }}>>")
    chat = engine.run(b"hi there", name="t", chat=True)
    assert chat.done.prompt_key == engine.run(b"<<hi there>>", name="t").done.prompt_key

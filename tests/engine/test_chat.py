"""Conversations rendered through a chat template: the renderer every front end shares, and the worker's use of it."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from barreld.engine import chat
from barreld.engine.chat import Message, messages_from, render, render_conversation
from barreld.engine.exactness import ReuseProbe
from barreld.errors import FailedPrecondition, InvalidArgument
from tests.fakes.backend import CHAT_TEMPLATE, render_user_turn, tokenize

from .conftest import Engine, WatchedStore, plain


def render_with_ends(template: str, messages: tuple[Message, ...], **options: str) -> tuple[bytes, tuple[int, ...]]:
    r = render_conversation(template, messages, ends=True, **options)
    return r.text, r.ends


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


def test_a_template_may_ask_for_the_date_as_hugging_face_templates_do() -> None:
    """gpt-oss's template (and Llama 3.x's) write strftime_now(...) into the system turn; without it they failed."""
    before = datetime.date.today().isoformat()
    out = render("Today: {{ strftime_now('%Y-%m-%d') }}{{ messages[0].content }}", CONVERSATION[:1], bos="", eos="",
                 model="m").decode()
    assert out in {f"Today: {day}Be brief." for day in (before, datetime.date.today().isoformat())}


def test_a_long_conversation_looks_for_its_first_and_last_ends_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat, "MESSAGE_ENDS_HEAD", 1)
    monkeypatch.setattr(chat, "MESSAGE_ENDS_TAIL", 1)
    out, ends = render_with_ends(CHAT_TEMPLATE, CONVERSATION, bos="<s>", eos="</s>", model="m")
    assert len(ends) == 2 and out[: ends[0]].endswith(b"brief.<|end|>\n") and out[: ends[1]].endswith(b"sets?<|end|>\n")


def test_the_opening_of_a_next_turn_is_what_the_template_writes_between_a_reply_and_a_user_message() -> None:
    r = render_conversation(CHAT_TEMPLATE, CONVERSATION, opening=True, bos="<s>", eos="</s>", model="m")
    assert r.opening == b"<|end|>\n<|user|>" and r.ends == ()
    reply = b"Dust."
    after = render(CHAT_TEMPLATE, (*CONVERSATION, Message("assistant", "Dust."), Message("user", "Thanks")),
                   bos="<s>", eos="</s>", model="m")
    assert after.startswith(r.text + reply + r.opening)


def test_no_opening_where_the_template_does_not_write_the_reply_as_it_is_or_refuses_a_next_turn() -> None:
    shouting = CHAT_TEMPLATE.replace("{{ m.content }}", "{{ m.content | upper }}")
    assert render_conversation(shouting, CONVERSATION, opening=True, bos="", eos="", model="m").opening == b""
    short = "{% if messages | length > 4 %}{{ raise_exception('at most 4 messages') }}{% endif %}" + CHAT_TEMPLATE
    r = render_conversation(short, CONVERSATION, opening=True, bos="", eos="", model="m")
    assert r.text.endswith(b"<|assistant|>") and r.opening == b""


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


def test_a_chat_settles_the_opening_of_its_next_turn_with_its_reply(tmp_path: Path, store: WatchedStore) -> None:
    """The next turn restores the prompt, the reply and the template's opening of the next user message: it
    prefills its own message and the cue only, and replies as a cold prefill does."""
    e = Engine(tmp_path, store, reuse_probe=ReuseProbe(tmp_path / "memo.json"))
    e.load(policy={"settle_tokens": "infinity"})
    for seed in range(2, 40):  # a reply a client can send back as text: the fake's vocabulary is not all UTF-8
        first = (Message("system", plain(40, 1).decode()), Message("user", plain(20, seed).decode()))
        reply = e.run(b"", messages=first, chat_template=CHAT_TEMPLATE)
        if reply.text.decode("utf-8", "replace").encode() == reply.text:
            break
    e.wait_settled()
    assert e.counter("opening_tokens") > 0
    second = (*first, Message("assistant", reply.text.decode()), Message("user", plain(9, 3).decode()))
    again = e.run(b"", messages=second, chat_template=CHAT_TEMPLATE)
    answered = render(CHAT_TEMPLATE, first, bos="", eos="", model="m") + reply.text
    restored = again.started.cache.restored_tokens  # into the opening (a token short where it would be alone)
    assert again.route == "live"
    assert len(tokenize(answered, bos=True)) + 1 < restored <= len(tokenize(answered + b"<|end|>\n<|user|>", True))
    assert again.text == e.cold(b"", messages=second, chat_template=CHAT_TEMPLATE).text
    e.close()

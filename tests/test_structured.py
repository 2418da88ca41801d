"""Structured output with the real model through a real barreld's HTTP API and the real `openai` SDK: the SDK's
`parse` with Pydantic models, `json_object`, a GBNF grammar; then bad input of every kind, each a 400 (or
exit 2 from barrelctl) after which the daemon serves the next request as usual.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from enum import StrEnum
from typing import Literal

import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from tests.support.sandbox import Sandbox
from tests.test_cache_paths import NO_SAVES
from tests.test_http import MODEL, Daemon

pytestmark = pytest.mark.model

Name = Field(min_length=1, max_length=24)


class Address(BaseModel):
    street: str = Name
    city: str = Name


class Person(BaseModel):
    name: str = Name
    address: Address


class Shopping(BaseModel):
    items: list[str] = Field(min_length=2, max_length=4)


class Priority(StrEnum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class Ticket(BaseModel):
    title: str = Name
    priority: Priority
    status: Literal["open", "closed"]


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)
    score: float = Field(ge=0, le=1)
    year: int = Field(ge=1900, le=2030)


class Contact(BaseModel):
    name: str = Name
    email: str | None = Field(default=None, max_length=40)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    breed: str = Name


class Pet(BaseModel):
    pet: Cat | Dog
    tag: int | str


CASES = [
    (Person, "Describe a person who lives in Paris."),
    (Shopping, "List a few things to buy at the market."),
    (Ticket, "File a ticket: the login page is down."),
    (Review, "Review a film you liked."),
    (Contact, "Give me a contact for a plumber."),
    (Pet, "Describe a pet."),
]


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Sandbox.new(NO_SAVES + MODEL, label="structured") as box:
        yield Daemon(box)


def ask(text: str) -> list[dict]:
    return [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": text}]


@pytest.mark.parametrize(("model", "prompt"), CASES, ids=[c[0].__name__ for c in CASES])
def test_the_sdks_parse_returns_an_object_that_validates(daemon: Daemon, model: type[BaseModel], prompt: str) -> None:
    reply = daemon.sdk().chat.completions.parse(model="smollm2", messages=ask(prompt), response_format=model,
                                                max_tokens=400, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)
    jsonschema.validate(json.loads(choice.message.content), to_strict_json_schema(model))


def test_a_seeded_sampled_reply_validates_too(daemon: Daemon) -> None:
    for seed in range(3):
        reply = daemon.sdk().chat.completions.parse(model="smollm2", messages=ask("Review a film."),
                                                    response_format=Review, max_tokens=400, temperature=1.0,
                                                    seed=seed)
        jsonschema.validate(json.loads(reply.choices[0].message.content), to_strict_json_schema(Review))


def test_json_object_gives_an_object(daemon: Daemon) -> None:
    question = ask("Give the weather in Paris as JSON with keys city and temperature.")
    reply = daemon.sdk().chat.completions.create(model="smollm2", messages=question, max_tokens=400, temperature=0,
                                                 response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_gbnf_grammar_is_obeyed(daemon: Daemon) -> None:
    grammar = 'root ::= ("yes" | "no") ", because " [a-z ]{1,40} "."'
    for question in ("Is the sky blue?", "Can fish fly?"):
        reply = daemon.sdk().chat.completions.create(model="smollm2", messages=ask(question), max_tokens=80,
                                                     temperature=0, extra_body={"grammar": grammar})
        assert reply.choices[0].finish_reason == "stop"
        assert re.fullmatch(r"(yes|no), because [a-z ]{1,40}\.", reply.choices[0].message.content)
    plain = daemon.sdk().completions.create(model="smollm2", prompt="Is the sky blue? Answer:", max_tokens=40,
                                            temperature=0, extra_body={"grammar": grammar})
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,40}\.", plain.choices[0].text)


def test_a_constrained_reply_cut_by_max_tokens_says_length(daemon: Daemon) -> None:
    reply = daemon.sdk().chat.completions.create(model="smollm2", messages=ask("Describe a person."),
                                                 response_format={"type": "json_object"}, max_tokens=3,
                                                 temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def schema_format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


BAD = [
    ({"top_p": 1.5}, "bad top_p"),
    ({"top_k": -1}, "bad top_k"),
    ({"min_p": -0.1}, "bad min_p"),
    ({"typical_p": 0}, "bad typical_p"),
    ({"temperature": 101}, "bad temperature"),
    ({"repeat_penalty": -1}, "bad repeat_penalty"),
    ({"repeat_last_n": -1}, "bad repeat_last_n"),
    ({"presence_penalty": 9}, "bad presence_penalty"),
    ({"frequency_penalty": -9}, "bad frequency_penalty"),
    ({"seed": -1}, "bad seed"),
    ({"logprobs": True, "top_logprobs": 99}, "bad logprobs"),
    ({"logit_bias": {"49152": -100}}, "bad logit_bias key 49152"),
    ({"logit_bias": {"hello": -100}}, "bad logit_bias key 'hello'"),
    ({"logit_bias": {"12": -1000}}, "bad logit_bias[12]"),
    ({"grammar": 'root ::= "a" undefined'}, "bad grammar"),
    ({"grammar": "root ::= ("}, "bad grammar"),
    ({"grammar": 'root ::= "b"{3,1}'}, "ran out of memory or stack"),  # kills llama.cpp's parser in-process
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": 7}}})},
     "not a valid JSON Schema"),
    ({"response_format": schema_format({"type": "array", "uniqueItems": True})}, "'uniqueItems'"),
    ({"response_format": schema_format({"type": "string", "format": "email"})}, "unsupported format"),
    ({"response_format": schema_format({"$ref": "https://example.com/s.json"})}, "only local references"),
    ({"response_format": {"type": "yaml"}}, "bad response_format type"),
]


@pytest.mark.parametrize(("extra", "words"), BAD, ids=[w for _, w in BAD])
def test_bad_input_is_a_400_and_the_next_request_is_served(daemon: Daemon, extra: dict, words: str) -> None:
    client = daemon.sdk()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=ask("Hi."), max_tokens=4, extra_body=extra)
    assert words in info.value.body["message"], info.value.body
    after = client.chat.completions.create(model="smollm2", messages=ask("Hi."), max_tokens=4, temperature=0)
    assert after.choices[0].message.content and after.usage.completion_tokens >= 1


def test_barrelctl_exits_2_on_bad_sampling_input(daemon: Daemon, tmp_path) -> None:
    box = daemon.box
    (tmp_path / "bad.gbnf").write_text("root ::= (")
    (tmp_path / "bad.json").write_text('{"type": "array", "uniqueItems": true}')
    (tmp_path / "good.gbnf").write_text('root ::= "ok"')
    for args, words in [
        (("--top-p", "2"), "bad --top-p 2"),
        (("--logit-bias", "x=1"), "bad --logit-bias"),
        (("--logit-bias", "99999999=1"), "bad logit_bias key"),
        (("--json-schema", str(tmp_path / "bad.json")), "uniqueItems"),
        (("--grammar", str(tmp_path / "bad.gbnf")), "bad grammar"),
        (("--logprobs", "50"), "bad --logprobs"),
    ]:
        r = box.ctl("complete", "Hi", "-n", "4", *args)
        assert r.rc == 2 and words in r.err, (args, r)
    r = box.ctl("complete", "Say ok:", "-n", "4", "--grammar", str(tmp_path / "good.gbnf"))
    assert r.rc == 0 and r.out.rstrip("\n") == "ok", r

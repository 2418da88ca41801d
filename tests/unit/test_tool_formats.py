"""Tool calls on text: each family's format read off a real template of llama.cpp's models/templates/ and parsed
back, the streamed split that never shows a marker's start, and the forced-call grammar that llama.cpp accepts.
The generic format is rendered through SmolLM2's own template and the README's Gemma 3 one.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from barreld.engine import tools
from barreld.engine.callformats import GENERIC, Family, family_of
from barreld.engine.chat import Message, messages_from, render
from barreld.engine.gbnf import check_gbnf
from barreld.engine.registry import bundled_model_path
from barreld.engine.tools import GENERIC as GENERIC_TEXT
from barreld.engine.tools import CallStream, SchemaChecks, ToolCall, forced_grammar, split_calls, tool, tool_spec
from barreld.errors import InvalidArgument
from tests.support.llama_sources import family_named, template
from tests.support.sandbox_models import gguf_string

WEATHER = tool("get_weather", "The weather now", {"type": "object", "properties": {"city": {"type": "string"}},
                                                  "required": ["city"]}, "tools[0]")
SPEC = tool_spec([WEATHER])
ARGS = '{"city": "Paris"}'
CALL = ToolCall("call00001", "get_weather", ARGS)  # nine letters and digits, as Mistral's templates demand
FAMILIES = {"hermes": "Qwen-Qwen2.5-7B-Instruct.jinja", "llama3": "meta-llama-Llama-3.3-70B-Instruct.jinja",
            "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja"}
HISTORY = (Message("user", "Weather in Paris?"),)


@functools.cache
def smollm2_template() -> str:
    return gguf_string(bundled_model_path("smollm2"), "tokenizer.chat_template")


def draw(template: str, messages: tuple[Message, ...]) -> str:
    return render(template, messages, bos="<s>", eos="</s>", model="m", tools=SPEC).decode()


@pytest.mark.parametrize(("family", "file"), FAMILIES.items(), ids=list(FAMILIES))
def test_each_family_gets_the_tools_and_reads_its_own_calls(family: str, file: str) -> None:
    text = template(file)
    assert family_of(text).name == family
    prompt = draw(text, HISTORY)
    assert '"get_weather"' in prompt and '"city"' in prompt  # the template was given the tools
    answered = (*HISTORY, Message("assistant", "", (CALL,)), Message("tool", '{"c": 21}', (), CALL.id))
    reply = draw(text, answered)[len(prompt):]  # the call as the template writes it, and what follows
    end = family_of(text).call_end
    reply = reply[:reply.index(end, reply.index(ARGS) + len(ARGS)) + len(end)]
    content, calls, _ = split_calls(reply, SPEC, family_of(text))
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def dialogue_template() -> str:
    """The plain dialogue template the README gives for a base model (Gemma 3 270M ships none)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    return re.search(r"cat > dialogue.jinja <<'JINJA'\n(.*?)JINJA\n", readme, re.S).group(1)


@pytest.mark.parametrize(("template", "system_turn", "end"), [
    (smollm2_template, "<|im_start|>system\nBe brief.\n\nYou can call tools.", "<|im_end|>"),
    (dialogue_template, "Be brief.\n\nYou can call tools.", "\n\n"),
], ids=["smollm2", "dialogue"])
def test_the_generic_format_describes_the_tools_in_the_system_turn_and_renders_a_call_back(
    template: Callable[[], str], system_turn: str, end: str
) -> None:
    text = template()
    assert family_of(text) is GENERIC
    system = (Message("system", "Be brief."), *HISTORY)
    prompt = draw(text, system)
    assert prompt.startswith(system_turn) and json.dumps(WEATHER.parameters) in prompt
    reply = GENERIC_TEXT.text([CALL])
    assert reply == '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    answered = (*system, Message("assistant", "", (CALL,)), Message("tool", "21", (), CALL.id))
    assert draw(text, answered).startswith(prompt + reply + end)


def test_arguments_are_returned_as_the_model_wrote_them() -> None:
    reply = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo" } }\n</tool_call>'
    content, calls, _ = split_calls(reply, SPEC, family_named("hermes"))
    assert content == "Checking.\n" and calls[0].arguments == '{"city":"Oslo" }'
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("reply", [
    '{"name": "get_weather", "arguments": {"town": "Oslo"}}',  # arguments the schema refuses
    '{"name": "get_time", "arguments": {}}',  # a tool not offered
    '{"name": "get_weather", "arguments": {"city": "Oslo"}} and more',  # text after the call
    "<tool_call>\n{not json",
])
def test_a_reply_that_is_not_a_valid_call_is_text(reply: str) -> None:
    assert split_calls(reply, SPEC, family_named("hermes")) == (reply, (), "")


def test_several_calls_parse_and_parallel_false_keeps_the_first() -> None:
    reply = GENERIC_TEXT.text([CALL, ToolCall("call_2", "get_weather", '{"city": "Rome"}')])
    assert [c.arguments for c in split_calls(reply, SPEC, GENERIC)[1]] == [ARGS, '{"city": "Rome"}']
    single = tool_spec([WEATHER], parallel=False)
    assert [c.arguments for c in split_calls(reply, single, GENERIC)[1]] == [ARGS]


def test_tool_choice_none_parses_nothing() -> None:
    reply = GENERIC_TEXT.text([CALL])
    assert split_calls(reply, tool_spec([WEATHER], "none"), GENERIC) == (reply, (), "")


def stream(reply: str, spec: object = SPEC, family: Family = GENERIC) -> tuple[list[str], str, tuple[ToolCall, ...]]:
    s = CallStream(spec, family)
    shown = [s.feed(ch) for ch in reply]
    tail, calls, _ = s.finish()
    return shown, tail, calls


def test_a_stream_never_shows_the_start_of_a_call_marker() -> None:
    shown, tail, calls = stream("Let me look.<tool_call>\n" + '{"name": "get_weather", "arguments": ' + ARGS + "}",
                                family=family_named("hermes"))
    assert "".join(shown) + tail == "Let me look." and not any("<" in s for s in shown)
    assert [c.arguments for c in calls] == [ARGS]


def test_a_stream_of_plain_text_shows_it_all_including_a_lone_angle_bracket() -> None:
    text = "  a < b and [x] hold."
    shown, tail, calls = stream(text, family=family_named("hermes"))
    assert "".join(shown) + tail == text and calls == ()
    assert "".join(shown).startswith("  a <")  # held only while it could still begin a marker


def test_a_stream_that_opens_a_json_object_but_is_no_call_is_text_at_the_end() -> None:
    shown, tail, calls = stream('{"answer": 42}')
    assert "".join(shown) == "" and tail == '{"answer": 42}' and calls == ()


def test_the_generic_forced_call_grammar_parses_in_llama_cpp() -> None:
    grammar = forced_grammar(tool_spec([WEATHER], "get_weather"), None, b"")
    assert grammar.count("root ::=") == 1 and json.dumps('{"name": ') in grammar
    check_gbnf(grammar)


def test_a_schema_the_grammar_cannot_enforce_is_held_to_any_object() -> None:
    loose = tool("f", None, {"type": "object", "propertyNames": {"maxLength": 3}}, "tools[0]")
    assert "tool0 ::= object" in forced_grammar(tool_spec([loose], "required"), None, b"")


@pytest.mark.parametrize(("make", "says"), [
    (lambda: tool("f", None, {"type": "string"}, "t"), "JSON Schema object of type object"),
    (lambda: tool("f", None, ["x"], "t"), "JSON Schema object of type object"),
    (lambda: tool("a b", None, None, "t"), "1-64 letters"),
    (lambda: tool("required", None, None, "t"), "is reserved"),
    (lambda: tool("f", None, {"type": "object", "properties": 3}, "t"), "not a valid JSON Schema"),
    (lambda: tool_spec([WEATHER], "other"), "not among the tools"),
    (lambda: tool_spec([WEATHER, WEATHER]), "same name"),
    (lambda: tool_spec([], "required"), "needs tools"),
    (lambda: messages_from([{"role": "tool", "tool_call_id": "x", "content": "1"}]), "no earlier assistant"),
    (lambda: messages_from([{"role": "user", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}]),
     "arguments must be a JSON object"),
    (lambda: messages_from([{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "{}"}}]}]), "only an assistant message"),
])
def test_bad_tools_and_tool_history_are_refused_by_name(make: object, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        make()


def test_a_tenants_schema_checks_check_each_schema_once_in_any_key_order(monkeypatch: pytest.MonkeyPatch) -> None:
    checked, check = [], tools.schema_problem
    monkeypatch.setattr(tools, "schema_problem", lambda schema: checked.append(schema) or check(schema))
    mine, theirs = SchemaChecks(), SchemaChecks()
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for checks in (mine, mine, theirs):
        assert tool("f", None, city, "t", checks).parameters == city
    assert tool("f", None, dict(reversed(city.items())), "t", mine).parameters == dict(reversed(city.items()))
    assert len(checked) == 2  # one for each tenant's memo
    bad = {"type": "object", "properties": 3}
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="not a valid JSON Schema: 3 is not of type 'object'"):
            tool("f", None, bad, "t", mine)
    assert len(checked) == 3


def test_an_assistant_turn_of_calls_may_have_no_content_and_its_result_names_it() -> None:
    got = messages_from([
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
    ])
    assert got == (Message("assistant", "", (ToolCall("c1", "get_weather", ARGS),)), Message("tool", "21", (), "c1"))


@pytest.mark.parametrize(("family", "reply"), [
    ("qwen3_coder", "<tool_call>\n<function=ship>\n<parameter=zip>\n10001\n</parameter>\n<parameter=count>\n3\n"
                    "</parameter>\n</function>\n</tool_call>"),
    ("glm", "<tool_call>ship\n<arg_key>zip</arg_key>\n<arg_value>10001</arg_value>\n<arg_key>count</arg_key>\n"
            "<arg_value>3</arg_value>\n</tool_call>"),
])
def test_a_bare_value_is_text_where_the_schema_declares_a_string(family: str, reply: str) -> None:
    schema = {"type": "object", "properties": {"zip": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["zip", "count"]}
    ship = tool("ship", None, schema, "tools[0]")
    _, calls, _ = split_calls(reply, tool_spec([ship]), family_named(family))
    assert [json.loads(c.arguments) for c in calls] == [{"zip": "10001", "count": 3}]

"""Tool calls on text: each family's format rendered through a template in its style and parsed back, the
prefix a reply leaves for the next turn, the streamed split that never shows a marker's start, and the
forced-call grammar that llama.cpp accepts. The generic format is rendered through SmolLM2's own template and
the README's Gemma 3 one.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest

from barreld.engine.chat import Message, messages_from, render
from barreld.engine.gbnf import check_gbnf
from barreld.engine.registry import bundled_model_path
from barreld.engine.tools import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    CallStream,
    Format,
    ToolCall,
    forced_grammar,
    format_of,
    split_calls,
    tool,
    tool_spec,
)
from barreld.errors import InvalidArgument

WEATHER = tool("get_weather", "The weather now", {"type": "object", "properties": {"city": {"type": "string"}},
                                                  "required": ["city"]}, "tools[0]")
SPEC = tool_spec([WEATHER])
ARGS = '{"city": "Paris"}'
CALL = ToolCall("call_1", "get_weather", ARGS)
NL = "{{ '\\n' }}"
HERMES_TEMPLATE = (  # Qwen 2.5's layout: tools in the system turn, calls in <tool_call> tags
    "{% if tools %}<|im_start|>system" + NL + "<tools>{% for t in tools %}" + NL + "{{ t | tojson }}{% endfor %}"
    + NL + "</tools><|im_end|>" + NL + "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}" + NL + "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{% if not loop.first %}" + NL + "{% endif %}<tool_call>" + NL
    + '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}' + NL
    + "</tool_call>{% endfor %}<|im_end|>" + NL + "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)
LLAMA3_TEMPLATE = (  # Llama 3.1's: JSON calls with "parameters"
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>{{ tools | tojson }}<|eot_id|>"
    "{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>" + NL + NL
    + "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>" + NL + NL + "{% endif %}"
)
MISTRAL_TEMPLATE = (  # Mistral's: [AVAILABLE_TOOLS], [TOOL_CALLS] then a JSON list
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}{% if not loop.first %}, {% endif %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "{% endfor %}]{{ eos_token }}{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
FAMILIES = [(HERMES_TEMPLATE, HERMES), (LLAMA3_TEMPLATE, LLAMA3), (MISTRAL_TEMPLATE, MISTRAL)]
HISTORY = (Message("user", "Weather in Paris?"),)


@functools.cache
def smollm2_template() -> str:
    reader = gguf.GGUFReader(bundled_model_path("smollm2"))
    field = reader.fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def draw(template: str, messages: tuple[Message, ...]) -> str:
    return render(template, messages, bos="<s>", eos="</s>", model="m", tools=SPEC).decode()


@pytest.mark.parametrize(("template", "fmt"), FAMILIES, ids=lambda x: x.name if isinstance(x, Format) else "")
def test_each_family_gets_the_tools_and_its_reply_renders_back_as_the_prefix_of_the_next_turn(
    template: str, fmt: Format
) -> None:
    assert format_of(template) is fmt
    prompt = draw(template, HISTORY)
    assert '"name": "get_weather"' in prompt and '"city"' in prompt  # the template was given the tools
    reply = fmt.text([CALL])
    content, calls = split_calls(reply, SPEC)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", ARGS)]
    answered = (*HISTORY, Message("assistant", "", calls), Message("tool", '{"c": 21}', (), calls[0].id))
    assert draw(template, answered).startswith(prompt + reply)


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
    assert format_of(text) is GENERIC
    system = (Message("system", "Be brief."), *HISTORY)
    prompt = draw(text, system)
    assert prompt.startswith(system_turn) and json.dumps(WEATHER.parameters) in prompt
    reply = GENERIC.text([CALL])
    assert reply == '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    answered = (*system, Message("assistant", "", (CALL,)), Message("tool", "21", (), CALL.id))
    assert draw(text, answered).startswith(prompt + reply + end)


def test_arguments_are_returned_as_the_model_wrote_them() -> None:
    reply = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo" } }\n</tool_call>'
    content, calls = split_calls(reply, SPEC)
    assert content == "Checking.\n" and calls[0].arguments == '{"city":"Oslo" } '
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("reply", [
    '{"name": "get_weather", "arguments": {"town": "Oslo"}}',  # arguments the schema refuses
    '{"name": "get_time", "arguments": {}}',  # a tool not offered
    '{"name": "get_weather", "arguments": {"city": "Oslo"}} and more',  # text after the call
    "<tool_call>\n{not json",
])
def test_a_reply_that_is_not_a_valid_call_is_text(reply: str) -> None:
    assert split_calls(reply, SPEC) == (reply, ())


def test_several_calls_parse_and_parallel_false_keeps_the_first() -> None:
    reply = MISTRAL.text([CALL, ToolCall("call_2", "get_weather", '{"city": "Rome"}')])
    assert [c.arguments for c in split_calls(reply, SPEC)[1]] == [ARGS, '{"city": "Rome"}']
    single = tool_spec([WEATHER], parallel=False)
    assert [c.arguments for c in split_calls(reply, single)[1]] == [ARGS]


def test_tool_choice_none_parses_nothing() -> None:
    reply = GENERIC.text([CALL])
    assert split_calls(reply, tool_spec([WEATHER], "none")) == (reply, ())


def stream(reply: str, spec: object = SPEC) -> tuple[list[str], str, tuple[ToolCall, ...]]:
    s = CallStream(spec)
    shown = [s.feed(ch) for ch in reply]
    tail, calls = s.finish()
    return shown, tail, calls


def test_a_stream_never_shows_the_start_of_a_call_marker() -> None:
    shown, tail, calls = stream("Let me look.<tool_call>\n" + '{"name": "get_weather", "arguments": ' + ARGS + "}")
    assert "".join(shown) + tail == "Let me look." and not any("<" in s for s in shown)
    assert [c.arguments for c in calls] == [ARGS]


def test_a_stream_of_plain_text_shows_it_all_including_a_lone_angle_bracket() -> None:
    text = "  a < b and [x] hold."
    shown, tail, calls = stream(text)
    assert "".join(shown) + tail == text and calls == ()
    assert "".join(shown).startswith("  a <")  # held only while it could still begin a marker


def test_a_stream_that_opens_a_json_object_but_is_no_call_is_text_at_the_end() -> None:
    shown, tail, calls = stream('{"answer": 42}')
    assert "".join(shown) == "" and tail == '{"answer": 42}' and calls == ()


@pytest.mark.parametrize("fmt", [GENERIC, HERMES, MISTRAL, LLAMA3], ids=lambda f: f.name)
def test_the_forced_call_grammar_parses_in_llama_cpp(fmt: Format) -> None:
    grammar = forced_grammar(tool_spec([WEATHER], "get_weather"), fmt)
    assert grammar.count("root ::=") == 1 and json.dumps(fmt.start + fmt.each_open + '{"name": ') in grammar
    check_gbnf(grammar)


def test_a_schema_the_grammar_cannot_enforce_is_held_to_any_object() -> None:
    loose = tool("f", None, {"type": "object", "propertyNames": {"maxLength": 3}}, "tools[0]")
    assert "tool0 ::= object" in forced_grammar(tool_spec([loose], "required"), GENERIC)


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


def test_an_assistant_turn_of_calls_may_have_no_content_and_its_result_names_it() -> None:
    got = messages_from([
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
    ])
    assert got == (Message("assistant", "", (ToolCall("c1", "get_weather", ARGS),)), Message("tool", "21", (), "c1"))

"""gpt-oss against OpenAI's own harmony library (openai-harmony): a conversation with a tool call and its result,
rendered by Barrel's `chat.render` through llama.cpp's gpt-oss template and by harmony's renderer, and a completion
with reasoning and a call, read by Barrel's gpt_oss parser and by harmony's parser. Harmony is the format gpt-oss
was trained on, so it is the reference the template and the parser are held to.

Where the template and harmony disagree, the disagreement is pinned here, not normalised away; each is inherent
to the template (llama.cpp's server renders the same bytes as Barrel), not to how Barrel feeds it:

- a call's content type: the template writes `<|channel|>commentary json`, harmony (and the model's own output)
  `<|channel|>commentary <|constrain|>json`;
- a call's arguments: the template re-serialises them (`arguments|tojson` on the object, with `, ` and `: `),
  harmony keeps the JSON text as the model wrote it;
- a tool's result: the template writes it through `|tojson`, so a string result is a quoted JSON string literal,
  harmony writes it as it is.

Given those three choices of the template, harmony renders the whole conversation byte for byte (and token for
token) as Barrel does.

Harmony's Rust core loads the o200k_base vocabulary from `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken` when that
variable is set (else it downloads it, which tests must not). The file is rebuilt here from the copy of the same
ranks that the quicktok-v1 package ships (its data/o200k.vocab), and harmony checks its SHA-256 on loading.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    TextContent,
    ToolDescription,
    load_harmony_encoding,
)

from barreld.engine import chat, tools
from tests.support.llama_sources import family_named, template

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # tiktoken's, and harmony's

# What the template writes into the system message when not told otherwise (Barrel gives it no model_identity
# nor reasoning_effort), built on harmony's side explicitly so the comparison shows it.
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
CUTOFF = "2024-06"

INSTRUCTIONS = "Answer briefly, in the user's units."
QUESTION = "What is the weather in Zürich?"
NAME = "get_weather"
DESCRIPTION = "Get the current weather in a city"
PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city"],
}
ARGUMENTS = '{"city":"Zürich","unit":"celsius"}'  # compact, as gpt-oss writes them
RESULT = '{"temperature":18,"sky":"clear"}'


def o200k_base_file(directory: Path) -> Path:
    """o200k_base.tiktoken (one `base64(token) rank` line per rank) written from quicktok's o200k.vocab (a count,
    then per token its length, bytes and rank, little-endian), found without importing quicktok's extension."""
    spec = importlib.util.find_spec("quicktok")
    assert spec is not None and spec.submodule_search_locations, "quicktok-v1 (the test extra) is not installed"
    data = (Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    ranks: list[tuple[int, bytes]] = []
    at = 4
    while at < len(data):
        (size,) = struct.unpack_from("<H", data, at)
        token = data[at + 2:at + 2 + size]
        (rank,) = struct.unpack_from("<I", data, at + 2 + size)
        ranks.append((rank, token))
        at += 2 + size + 4
    ranks.sort()
    assert len(ranks) == count and [r for r, _ in ranks] == list(range(count))
    text = b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in ranks)
    assert hashlib.sha256(text).hexdigest() == O200K_SHA256, "quicktok's o200k vocabulary is not o200k_base's"
    path = directory / "o200k_base.tiktoken"
    path.write_bytes(text)
    return path


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> HarmonyEncoding:
    directory = tmp_path_factory.mktemp("tiktoken")
    o200k_base_file(directory)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TIKTOKEN_ENCODINGS_BASE", str(directory))  # read from here, never downloaded
        env.setenv("TIKTOKEN_RS_CACHE_DIR", str(directory / "cache"))
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def barrel_messages(instructions: str) -> tuple[chat.Message, ...]:
    system = (chat.Message("system", instructions),) if instructions else ()
    return (*system, chat.Message("user", QUESTION),
            chat.Message("assistant", "", (chat.ToolCall("call_1", NAME, ARGUMENTS),)),
            chat.Message("tool", RESULT, tool_call_id="call_1"))


def barrel_render(instructions: str) -> tuple[bytes, str]:
    """Barrel's prompt for the conversation, with the date the template wrote into it (rendered again should the
    day change meanwhile)."""
    spec = tools.tool_spec([tools.tool(NAME, DESCRIPTION, PARAMETERS, "tools[0]")])
    while True:
        day = datetime.datetime.now().strftime("%Y-%m-%d")
        text = chat.render(template("openai-gpt-oss-120b.jinja"), barrel_messages(instructions),
                           bos="<|startoftext|>", eos="<|return|>", model="gpt-oss-120b", tools=spec)
        if datetime.datetime.now().strftime("%Y-%m-%d") == day:
            return text, day


def harmony_conversation(instructions: str, day: str, *, arguments: str = ARGUMENTS,
                         content_type: str = "<|constrain|>json", result: str = RESULT) -> Conversation:
    """The same conversation for harmony; its defaults are harmony's own way (and the model's) of writing the
    call and the result."""
    system = (SystemContent.new().with_model_identity(IDENTITY).with_knowledge_cutoff(CUTOFF)
              .with_conversation_start_date(day).with_reasoning_effort(ReasoningEffort.MEDIUM)
              .with_required_channels(["analysis", "commentary", "final"]))
    developer = DeveloperContent.new().with_function_tools([ToolDescription.new(NAME, DESCRIPTION, PARAMETERS)])
    if instructions:
        developer = developer.with_instructions(instructions)
    return Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, QUESTION),
        Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary")
        .with_recipient(f"functions.{NAME}").with_content_type(content_type),
        Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{NAME}"), result)
        .with_channel("commentary").with_recipient("assistant"),
    ])


def harmony_render(encoding: HarmonyEncoding, conversation: Conversation) -> tuple[bytes, list[int]]:
    tokens = encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
    return encoding.decode_utf8(tokens).encode(), tokens


def turns(text: bytes) -> list[bytes]:
    """A harmony prompt cut into its messages, each from its `<|start|>`; the last is the generation prompt."""
    return [b"<|start|>" + part for part in text.split(b"<|start|>")[1:]]


def shown(a: bytes, b: bytes) -> str:
    import difflib

    return "\n".join(difflib.unified_diff([repr(t) for t in turns(a)], [repr(t) for t in turns(b)],
                                          "barrel", "harmony", lineterm=""))


@pytest.mark.parametrize("instructions", [INSTRUCTIONS, ""], ids=["instructions", "no-instructions"])
def test_given_the_templates_three_choices_harmony_renders_the_same_bytes_and_tokens(
        harmony: HarmonyEncoding, instructions: str) -> None:
    ours, day = barrel_render(instructions)
    theirs, tokens = harmony_render(harmony, harmony_conversation(
        instructions, day,
        arguments=json.dumps(json.loads(ARGUMENTS), ensure_ascii=False),  # the template's `arguments|tojson`
        content_type="json",  # the template's default content type
        result=json.dumps(RESULT, ensure_ascii=False)))  # the template's `content|tojson`
    assert ours == theirs, shown(ours, theirs)
    assert harmony.encode(ours.decode(), allowed_special="all") == tokens
    assert ours.endswith(b"<|start|>assistant")


@pytest.mark.parametrize("instructions", [INSTRUCTIONS, ""], ids=["instructions", "no-instructions"])
def test_the_template_and_harmony_agree_on_every_message_but_the_call_and_its_result(
        harmony: HarmonyEncoding, instructions: str) -> None:
    ours, day = barrel_render(instructions)
    theirs, _ = harmony_render(harmony, harmony_conversation(instructions, day))
    a, b = turns(ours), turns(theirs)
    assert len(a) == len(b) == 6, shown(ours, theirs)  # system, developer, user, call, result, generation prompt
    assert [i for i in range(len(a)) if a[i] != b[i]] == [3, 4], shown(ours, theirs)
    assert a[0] == (f"<|start|>system<|message|>{IDENTITY}\nKnowledge cutoff: {CUTOFF}\nCurrent date: {day}\n\n"
                    "Reasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included "
                    "for every message.\nCalls to these tools must go to the commentary channel: 'functions'."
                    "<|end|>").encode()


def test_the_template_writes_a_calls_content_type_without_constrain_and_its_arguments_rewritten(
        harmony: HarmonyEncoding) -> None:
    ours, day = barrel_render(INSTRUCTIONS)
    theirs, _ = harmony_render(harmony, harmony_conversation(INSTRUCTIONS, day))
    assert turns(ours)[3] == ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                              '{"city": "Zürich", "unit": "celsius"}<|call|>').encode()
    assert turns(theirs)[3] == ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json'
                                '<|message|>{"city":"Zürich","unit":"celsius"}<|call|>').encode()


def test_the_template_writes_a_tool_result_as_a_json_string(harmony: HarmonyEncoding) -> None:
    ours, day = barrel_render(INSTRUCTIONS)
    theirs, _ = harmony_render(harmony, harmony_conversation(INSTRUCTIONS, day))
    head = b"<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    assert turns(ours)[4] == head + b'"{\\"temperature\\":18,\\"sky\\":\\"clear\\"}"<|end|>'
    assert turns(theirs)[4] == head + b'{"temperature":18,"sky":"clear"}<|end|>'


REASONING = "The user wants Zürich's weather; call get_weather with celsius."
COMPLETIONS = {
    # as gpt-oss writes it: the recipient after the channel, the content type constrained
    "model": (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>commentary "
              f"to=functions.get_weather <|constrain|>json<|message|>{ARGUMENTS}<|call|>"),
    # as the template writes a call: the recipient in the role's header, a bare content type
    "template": (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant to=functions.get_weather"
                 f"<|channel|>commentary json<|message|>{ARGUMENTS}<|call|>"),
}


@pytest.mark.parametrize("completion", list(COMPLETIONS.values()), ids=list(COMPLETIONS))
def test_the_gpt_oss_parser_reads_a_completion_as_harmony_does(harmony: HarmonyEncoding, completion: str) -> None:
    """The completion follows the generation prompt `<|start|>assistant`: harmony is told the role it opens with."""
    messages = harmony.parse_messages_from_completion_tokens(harmony.encode(completion, allowed_special="all"),
                                                             Role.ASSISTANT)
    text = [part.text for m in messages for part in m.content if isinstance(part, TextContent)]
    assert [(m.author.role, m.channel, m.recipient) for m in messages] == [
        (Role.ASSISTANT, "analysis", None), (Role.ASSISTANT, "commentary", f"functions.{NAME}")]

    parsed = family_named("gpt_oss").parse(completion, (NAME,), reasoning_open=False)
    assert parsed.reasoning == text[0] == REASONING
    assert parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.calls] == [(str(messages[1].recipient).removeprefix("functions."),
                                                              text[1])]
    assert json.loads(parsed.calls[0].arguments) == json.loads(ARGUMENTS)

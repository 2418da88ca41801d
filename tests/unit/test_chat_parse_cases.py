"""llama.cpp's own parse cases (tests/test-chat.cpp: the model outputs it feeds its chat parser, and the content,
reasoning and calls it expects), data-driven through Barrel's parser for the family each real template is read
as. The cases live in tests/data/chat-parse-cases/, one file per template, each case naming the line of
test-chat.cpp it comes from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from barreld.engine.callformats import family_of
from tests.support.llama_sources import template

CASES = Path(__file__).resolve().parents[1] / "data" / "chat-parse-cases"


def _cases() -> list:
    out = []
    for path in sorted(CASES.glob("*.json")):
        doc = json.loads(path.read_text())
        for i, case in enumerate(doc["cases"]):
            out.append(pytest.param(doc["template"], doc["family"], case, id=f"{path.stem}-{i}-l{case['line']}"))
    return out


def test_every_case_file_names_its_template_and_family() -> None:
    files = sorted(CASES.glob("*.json"))
    assert len(files) >= 12, "a case file per family of the issue"
    for path in files:
        doc = json.loads(path.read_text())
        assert {"template", "family", "cases"} <= set(doc), path
        assert doc["cases"], f"{path} holds no case"


@pytest.mark.parametrize(("template_name", "family", "case"), _cases())
def test_llama_cpp_parse_case(template_name: str, family: str, case: dict) -> None:
    fmt = family_of(template(template_name))
    assert fmt.name == family, f"{template_name} is read as {fmt.name}"
    parsed = fmt.parse(case["output"], case.get("tools", ()), reasoning_open=case.get("reasoning_open", False))
    expect = case["expect"]
    assert parsed.content == expect.get("content", "")
    assert parsed.reasoning == expect.get("reasoning", "")
    got = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in parsed.calls]
    want = [{"name": c["name"], "arguments": c["arguments"]} for c in expect.get("tool_calls", [])]
    assert got == want
    for call, wanted in zip(parsed.calls, expect.get("tool_calls", []), strict=True):
        if wanted.get("id"):
            assert call.id == wanted["id"]

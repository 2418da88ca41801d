"""Rules a reviewer would otherwise check by hand, so that a newcomer's change is told at once.

Short functions, docstrings that state facts instead of pointing at documents a user of the repository does
not have, and the domain's names defined in one place (`barreld.names`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("barreld", "barrelctl")
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
MAX_FUNCTION_LINES = 50
CITATION = re.compile(r"CONTRACT\.md|FACTS\.md|STYLE\.md|caching-guide|\bthe guide\b|\b[Ii]ssue \d+", re.ASCII)


def sources(*roots: str) -> list[Path]:
    return sorted(p for r in roots for p in (ROOT / r).rglob("*.py") if not p.name.endswith(GENERATED))


def test_the_rules_see_the_code() -> None:
    assert len(sources(*PACKAGES)) > 40


@pytest.mark.parametrize("path", sources(*PACKAGES), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_is_longer_than_fifty_lines(path: Path) -> None:
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"split these: {long}"


def test_no_code_cites_a_document_outside_the_repository() -> None:
    cited = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in sources(*PACKAGES, "tests", "bench")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if CITATION.search(line) and p != Path(__file__)
    ]
    assert not cited, "state the fact instead:\n" + "\n".join(cited)


@pytest.mark.parametrize(
    "definition",
    [
        r'\(\s*"ram",\s*"ram_file"',  # the tier names, or the memory tiers
        r'\(\s*"safe",\s*"gguf_chunked"',  # the fingerprint modes
        r'\(\s*"cold",\s*"continued"',  # the save reasons
        r"\[A-Za-z0-9\]\[A-Za-z0-9\._-\]",  # the model-name rule
    ],
)
def test_each_domain_name_is_defined_once(definition: str) -> None:
    """In the code; tests spell out the values they expect."""
    pattern = re.compile(definition)
    found = [str(p.relative_to(ROOT)) for p in sources(*PACKAGES) if pattern.search(p.read_text())]
    assert found == ["barreld/names.py"], f"import it from barreld.names instead: {found}"

"""Rules a reviewer would otherwise check by hand, so that a newcomer's change is told at once.

Short functions and files, docstrings that state facts instead of pointing at documents a user of the repository
does not have, the domain's names defined in one place (`barreld.names`), and tests that go through the public
functions of the cache store and index, never their private attributes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("barreld", "barrelctl")
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
MAX_FUNCTION_LINES = 50
MAX_FILE_LINES = 600
STORE_OR_INDEX = re.compile(r"(store|index|idx|st)(_of)?$", re.IGNORECASE)  # `store`, `bstore`, `index_of(...)`, ...
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


@pytest.mark.parametrize("path", sources(*PACKAGES), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_is_longer_than_six_hundred_lines(path: Path) -> None:
    """Generated code aside: a longer module does more than one job, and splits along its seams."""
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{lines} lines: split it along its seams"


def _ends_in(node: ast.expr) -> str:
    """The name an expression ends in: `store` for `store`, `x.store` and `index_of(store)`'s `index_of`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return _ends_in(node.func) if isinstance(node, ast.Call) else ""


def _private_reads(tree: ast.AST) -> list[ast.Attribute]:
    """`store._x`, `index._x` (however the store or index is named or reached) and `super()._x` in a subclass
    of either: the reads of a private attribute of a cache store or index."""
    subclasses = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                  and any(STORE_OR_INDEX.search(_ends_in(b)) for b in c.bases)]
    supers = {id(n) for c in subclasses for n in ast.walk(c) if isinstance(n, ast.Attribute)
              and isinstance(n.value, ast.Call) and _ends_in(n.value) == "super"}
    return [
        n for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
        and (STORE_OR_INDEX.search(_ends_in(n.value)) or id(n) in supers)
    ]


def test_no_test_reads_a_private_attribute_of_a_store_or_index() -> None:
    """Tests go through public functions (`store.index`, `store.tier(name)`, `index.tables`, ...), so the cache
    can be rearranged without rewriting them."""
    found = [
        f"{p.relative_to(ROOT)}:{n.lineno}: .{n.attr}"
        for p in sources("tests")
        for n in _private_reads(ast.parse(p.read_text()))
    ]
    assert not found, "read it through a public function:\n" + "\n".join(found)


def test_the_private_read_rule_sees_one() -> None:
    reads = _private_reads(ast.parse(
        "store._tiers\nindex_of(s)._env\nclass W(CacheStore):\n    def f(self):\n        super()._publish()\n"
        "store.tier('disk').root\nrows_mod._unpack\n"
    ))
    assert sorted(n.attr for n in reads) == ["_env", "_publish", "_tiers"]


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

"""Rules a reviewer would otherwise check by hand, so that a newcomer's change is told at once.

Short functions and files, docstrings that state facts instead of pointing at documents a user of the repository
does not have, the domain's names defined in one place (`barreld.names`), tests that go through the public
functions of the cache store and index, never their private attributes, and imports that point down one declared
order of layers, with no cycle, so the tree drawn from the imports is the one the README's code map shows."""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cache
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


NAMES = ["barreld/names.py"]


@pytest.mark.parametrize(
    ("definition", "where"),
    [
        (r'RAM_FILE\s*=\s*"ram_file"', NAMES),  # the tier names
        (r'GGUF_CHUNKED\s*=\s*"gguf_chunked"', NAMES),  # the fingerprint modes
        (r'CONTINUED\s*=\s*"continued"', NAMES),  # the save reasons
        (r'LENGTH\s*=\s*"length"', NAMES),  # the finish reasons
        (r"\[A-Za-z0-9\]\[A-Za-z0-9\._-\]", NAMES),  # the model-name rule
        (r'\(\s*"ram",\s*"ram_file"', []),  # tiers spelt out as a list: take them from the enum
        (r'\(\s*"cold",\s*"continued"', []),  # save reasons spelt out as a list
        (r'"saves_cold",', []),  # counters the enums already name
    ],
)
def test_each_domain_name_is_defined_once(definition: str, where: list[str]) -> None:
    """In the code; tests spell out the values they expect."""
    pattern = re.compile(definition)
    found = [str(p.relative_to(ROOT)) for p in sources(*PACKAGES) if pattern.search(p.read_text())]
    assert found == where, f"import it from barreld.names instead: {found}"


# ---- imports: layers ------------------------------------------------------------------------------------
# A package (or a top-level module) of barreld may import only from the layers below its own; the bottom layer's
# leaves may also import each other. Bottom first.
LAYERS: tuple[frozenset[str], ...] = tuple(map(frozenset, (
    # leaves: names, errors, paths, the listen address, the process lifecycle, the generated RPC code
    ("barreld", "barreld.names", "barreld.errors", "barreld.sizes", "barreld.paths", "barreld.deaths",
     "barreld.address", "barreld.lifecycle", "barreld.rpc"),
    ("barreld.cache", "barreld.pressure"),  # the cache core (plain Python); memory pressure readings
    ("barreld.engine", "barreld.tenants"),  # llama.cpp, the lookup routes, the save policy, sampling; who asks
    ("barreld.config", "barreld.service"),  # the config file; the one request type and call every front end uses
    ("barreld.http", "barreld.server"),  # the front ends: the HTTP APIs, gRPC
    ("barreld.daemon",),  # the composition root: wires the store, the models and both front ends
    ("barreld.main", "barreld.supervise"),  # barreld's command line and its watcher
    ("barreld.__main__",),
    ("barrelctl",),  # a client: of barreld it imports CLIENT_PIECES only
)))  # fmt: skip
# What barrelctl may import from barreld: the generated RPC code and pure pieces the daemon and the CLI share.
CLIENT_PIECES = frozenset({
    "barreld", "barreld.rpc.barrel_pb2", "barreld.rpc.barrel_pb2_grpc", "barreld.names", "barreld.errors",
    "barreld.sizes", "barreld.paths", "barreld.deaths", "barreld.engine.chat", "barreld.engine.tools",
    "barreld.engine.divergence", "barreld.engine.sampling", "barreld.engine.grammar", "barreld.engine.calllayout",
    "barreld.engine.callformats", *(f"barreld.engine.callformats.{p.stem}"
                                    for p in (ROOT / "barreld" / "engine" / "callformats").glob("*.py")),
})  # fmt: skip
# Libraries that belong to one layer: the cache core imports neither llama.cpp nor gRPC, the shared front-end
# code neither gRPC nor the web stack.
CONFINED = {
    "llama_cpp": ("barreld.engine",),
    "grpc": ("barreld.server", "barreld.rpc", "barrelctl"),
    "google": ("barreld.server", "barreld.rpc", "barrelctl"),
    "grpc_tools": ("barreld.rpc",),
    "starlette": ("barreld.http",),
    "uvicorn": ("barreld.http",),
    "anyio": ("barreld.http",),
}
TEST_SUPPORT = ("tests", "bench")


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    importer: str
    imported: str  # a module of barreld or barrelctl where it is one, else the name as written

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.importer} imports {self.imported}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The package (or top-level module) a module belongs to: what LAYERS places."""
    parts = module.split(".")
    return "barrelctl" if parts[0] == "barrelctl" else ".".join(parts[:2])


def layer(module: str) -> int:
    found = [i for i, names in enumerate(LAYERS) if unit(module) in names]
    assert found, f"{unit(module)} has no place in LAYERS: add it where it belongs"
    return found[0]


def _named(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """The modules one import statement names: `from a import b` names a.b where that is a module, else a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = importer if is_package else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    module = ".".join(p for p in ((base if node.level else ""), node.module or "") if p)
    return [f"{module}.{a.name}" if f"{module}.{a.name}" in modules() else module for a in node.names]


@cache
def modules() -> frozenset[str]:
    """Every module, the generated ones too: what an import may name."""
    return frozenset(module_name(p) for r in PACKAGES for p in (ROOT / r).rglob("*.py"))


@cache
def imports() -> tuple[Import, ...]:
    """Every import in barreld and barrelctl: at module level, in functions, under TYPE_CHECKING alike."""
    found = []
    for path in sources(*PACKAGES):
        importer = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = _named(node, importer, path.name == "__init__.py")
                found += [Import(path, node.lineno, importer, n) for n in dict.fromkeys(names) if n != importer]
    return tuple(found)


def ours(found: Import) -> bool:
    return found.imported.split(".")[0] in PACKAGES


def test_the_import_rules_see_the_imports() -> None:
    assert sum(map(ours, imports())) > 200


def test_every_package_has_one_layer() -> None:
    placed = [name for names in LAYERS for name in names]
    present = {unit(m) for m in modules()}
    assert len(placed) == len(set(placed)), f"placed twice: {sorted({n for n in placed if placed.count(n) > 1})}"
    assert present <= set(placed), f"add these to LAYERS, where they belong: {sorted(present - set(placed))}"
    assert set(placed) <= present, f"LAYERS names what no longer exists: {sorted(set(placed) - present)}"


def test_imports_point_down_the_layers() -> None:
    wrong = [
        f"{i}: layer {layer(i.importer)} ({unit(i.importer)}) may not import from layer {layer(i.imported)} "
        f"({unit(i.imported)})"
        for i in imports()
        if ours(i) and unit(i.importer) != unit(i.imported) and 0 < layer(i.importer) <= layer(i.imported)
    ]
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as its nodes in order (the first repeated at the end), or [] if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    return next((found for node in sorted(edges) if node not in state and (found := visit(node))), [])


def test_no_cycle_between_packages() -> None:
    edges: dict[str, set[str]] = {}
    for i in filter(ours, imports()):
        if unit(i.importer) != unit(i.imported):
            edges.setdefault(unit(i.importer), set()).add(unit(i.imported))
    cycle = _cycle(edges)
    witnesses = [
        next(str(i) for i in imports() if ours(i) and (unit(i.importer), unit(i.imported)) == (a, b))
        for a, b in zip(cycle, cycle[1:], strict=False)
    ]
    assert not cycle, f"a cycle: {' -> '.join(cycle)}, through\n" + "\n".join(witnesses)
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the search finds one


def test_the_cli_imports_only_client_pieces_of_barreld() -> None:
    """And those pieces import only each other, so `barrelctl` never loads the engine, the cache or a server."""
    wrong = [
        str(i)
        for i in imports()
        if i.imported.split(".")[0] == "barreld"
        and (unit(i.importer) == "barrelctl" or i.importer in CLIENT_PIECES)
        and i.imported not in CLIENT_PIECES
    ]
    assert not wrong, "barrelctl reaches past the client pieces of barreld:\n" + "\n".join(wrong)


def test_libraries_stay_in_their_layer() -> None:
    wrong = [
        f"{i}: only {', '.join(CONFINED[top])} may"
        for i in imports()
        if (top := i.imported.split(".")[0]) in CONFINED and unit(i.importer) not in CONFINED[top]
    ]
    assert not wrong, "\n".join(wrong)


def test_what_is_installed_leaves_the_test_support_out() -> None:
    """Nothing in barreld or barrelctl imports tests/ (the sandboxes) or bench/, and the wheel ships neither."""
    wrong = [str(i) for i in imports() if i.imported.split(".")[0] in TEST_SUPPORT]
    assert not wrong, "move what these need into the package, or the import into the tests:\n" + "\n".join(wrong)
    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    support = [module_name(p.parent) for r in TEST_SUPPORT for p in (ROOT / r).rglob("__init__.py")]
    assert support, "the test support has packages to leave out"
    assert not [s for s in support if any(fnmatchcase(s, pattern) for pattern in shipped["include"])]


def test_the_readme_code_map_names_files_that_exist_in_layer_order() -> None:
    """The map reads from the CLI down to the cache core: no line of it sits above a layer it imports."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## How it is built", 1)[1].split("```", 2)[1]
    paths = [line.split()[0] for line in block.splitlines() if line.startswith(PACKAGES)]
    assert len(paths) > 10, "the code map is where this test looks for it"
    missing = [p for p in paths if not list(ROOT.glob(p))]
    assert not missing, f"no such files: {missing}"
    ranks = [layer(module_name(ROOT / p.replace("*", "x"))) for p in paths]
    assert ranks == sorted(ranks, reverse=True), f"out of the layers' order: {list(zip(paths, ranks, strict=True))}"


# ---- the front ends: one module per API, over the engine's reply events -------------------------------------
# Each API of the HTTP front end (its modules, by name); gRPC's is barreld.server.
HTTP_APIS = {"openai": ("barreld.http.openai",), "anthropic": ("barreld.http.anthropic",),
             "responses": ("barreld.http.responses", "barreld.http.response_store")}
FRONT_ENDS = ("barreld.http", "barreld.server")
# What reads a reply for tool calls or renders a conversation: the engine's, used by the call (service.calls).
REPLY_READING = {"barreld.engine.tools": {"CallStream", "split_calls"},
                 "barreld.engine.chat": {"render", "render_conversation"},
                 "barreld.engine.reply": {"ReplyReader", "next_turn"}}


def _imported_names(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of each `from module import name` in a file."""
    return [(node.lineno, node.module or "", alias.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) for alias in node.names]


def test_no_http_api_module_imports_another_api() -> None:
    owner = {module: api for api, modules in HTTP_APIS.items() for module in modules}
    assert set(owner) <= modules(), f"HTTP_APIS names modules that do not exist: {sorted(set(owner) - modules())}"
    wrong = [str(i) for i in imports() if i.importer in owner and i.imported in owner
             and owner[i.importer] != owner[i.imported]]
    assert not wrong, "an API imports another API's module; move what both need below them:\n" + "\n".join(wrong)


def test_front_ends_learn_of_tool_calls_only_from_the_engines_reply_events() -> None:
    """No front end parses a reply for calls, reads it itself or renders the conversation again: the engine's
    reply events (a Finish with its calls and prefix_kept) are the only way."""
    wrong = [
        f"{p.relative_to(ROOT)}:{line}: imports {name} from {module}"
        for p in sources("barreld")
        if module_name(p).startswith(FRONT_ENDS)
        for line, module, name in _imported_names(p)
        if name in REPLY_READING.get(module, ())
    ]
    assert not wrong, "take the calls from the Finish event instead:\n" + "\n".join(wrong)
    assert any(name == "ReplyReader" for _, _, name in _imported_names(ROOT / "barreld/service/calls.py"))

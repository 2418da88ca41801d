"""Fixtures that run the real barreld and barrelctl as processes, each in its own sandbox (tests.support.sandbox):
private XDG directories, data dir, ram_file root and socket, so tests never touch a user's cache."""

from __future__ import annotations

import itertools
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from tests.support.redis_sandbox import RedisServer
from tests.support.sandbox import Sandbox

# A suite started in the background of a non-interactive shell (`tests/run &` in a script) inherits SIGINT
# ignored, and so would every barrelctl it starts: its Ctrl-C would do nothing and the Ctrl-C tests fail. A
# handler of our own is reset to the default in each child, which then takes Ctrl-C as a user's shell would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The modules that take longest on two cores, longest first (seconds each in a full run, December 2026: 310,
# 181, 107, 107, 94, 71, 59, 57). The full command hands whole modules to two workers in collection order
# (tests/run: --dist loadfile --no-loadscope-reorder); starting with these lets the many short modules fill in
# at the end, so the workers finish together rather than one waiting on the other's last long module.
LONGEST_FIRST = ("test_cache_paths", "test_model_families", "test_redis_cluster_hosts", "test_redis_hosts",
                 "test_crash", "test_concurrency", "test_load", "test_pressure_daemon")
MODULE_MARKS = re.compile(r"^pytestmark = (.*)$", re.M)
WORDS = {"and", "or", "not"}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A module whose one-line `pytestmark` puts every test out of `-m` is not imported: the fast command would
    otherwise import the SDKs and helpers of every model test on each worker, for nothing (4 s of its minute)."""
    expr = config.option.markexpr
    if not expr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    line = MODULE_MARKS.search(collection_path.read_text())
    marks = set(re.findall(r"pytest\.mark\.(\w+)", line.group(1))) if line else set()
    if not marks:
        return None
    compiled = Expression.compile(expr)
    others = sorted(set(re.findall(r"\w+", expr)) - WORDS - marks)
    # out whatever marks a single test adds: every combination of the expression's other names is tried
    for extra in itertools.chain.from_iterable(itertools.combinations(others, n) for n in range(len(others) + 1)):
        on = marks | set(extra)
        if compiled.evaluate(lambda name, on=on, **_: name in on):
            return None
    return True


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def private_defaults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What a test starts outside a sandbox gets private XDG directories, socket and ram_file root too: no test
    may touch the default socket or /dev/shm/barrel-$UID, which the daemon of README's first command may hold
    while the tests run."""
    base = tmp_path_factory.mktemp("defaults")
    config = base / "config" / "barrel" / "barreld.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'[tiers.ram_file]\nroot = "{base / "shm"}"\n')
    with pytest.MonkeyPatch.context() as mp:
        for name, leaf in (("XDG_RUNTIME_DIR", "run"), ("XDG_DATA_HOME", "data"), ("XDG_CONFIG_HOME", "config")):
            mp.setenv(name, str(base / leaf))
        mp.setenv("BARREL_SOCKET", str(base / "run" / "barrel" / "barreld.sock"))
        yield


@pytest.fixture
def world() -> Iterator[Sandbox]:
    with Sandbox.new() as w:
        yield w


@pytest.fixture(scope="module")
def served() -> Iterator[Sandbox]:
    """One running daemon shared by a module's tests (the model loads once)."""
    with Sandbox.new() as w:
        w.start_daemon()
        yield w


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server of the test's own (loopback port and Unix socket, no persistence); the test
    fails, never skips, when redis-server is not installed."""
    with RedisServer.start() as server:
        yield server

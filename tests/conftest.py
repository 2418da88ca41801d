"""Fixtures that run the real barreld and barrelctl as processes, each in its own sandbox (tests.support.sandbox):
private XDG directories, data dir, ram_file root and socket, so tests never touch a user's cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis_sandbox import RedisServer
from tests.support.sandbox import Sandbox


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

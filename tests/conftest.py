"""Fixtures that run the real barreld and barrelctl as processes, each test world in its own directories.

Every world gets private XDG directories, a short socket path (Unix sockets allow ~107 bytes), and a
config whose ram_file root is its own directory under /dev/shm, so tests never touch a user's cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    rc: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)


@dataclass
class World:
    """A private set of paths, plus helpers to run barreld and barrelctl against them."""

    base: Path
    shm: Path
    extra_config: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.base / "run" / "barrel" / "barreld.sock"

    @property
    def data_dir(self) -> Path:
        return self.base / "data" / "barrel"

    @property
    def config(self) -> Path:
        return self.base / "barreld.toml"

    @property
    def log(self) -> Path:
        return self.base / "barreld.log"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BARREL_", "XDG_"))}
        env.update(
            PYTHONPATH=str(ROOT),
            XDG_RUNTIME_DIR=str(self.base / "run"),
            XDG_DATA_HOME=str(self.base / "data"),
            XDG_CONFIG_HOME=str(self.base / "config"),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def write_config(self, text: str = "") -> Path:
        """The world's config file: its own ram_file root, plus any extra TOML."""
        cfg_dir = self.base / "config" / "barrel"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        body = f'[tiers.ram_file]\nroot = "{self.shm}"\n' + (text or self.extra_config)
        (cfg_dir / "barreld.toml").write_text(body)
        self.config.write_text(body)
        return self.config

    def ctl(self, *args: str, input: bytes | None = None, timeout: float = 300, **env: str) -> Run:
        p = subprocess.run([sys.executable, "-m", "barrelctl", *args], input=input, capture_output=True,
                           timeout=timeout, env=self.env(**env), cwd=self.base)
        return Run(p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"))

    def ctl_popen(self, *args: str, **kw) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "barrelctl", *args], env=self.env(), cwd=self.base,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)

    def start_daemon(self, *args: str, wait: bool = True, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.log, "ab") as log:
            p = subprocess.Popen([sys.executable, "-m", "barreld", "--socket", str(self.socket), *args],
                                 env=self.env(**(env or {})), cwd=self.base, stdout=log, stderr=log)
        self.procs.append(p)
        if wait:
            self.wait_ready(p)
        return p

    def wait_ready(self, proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"barreld exited with {proc.returncode}:\n{self.log_text()}")
            if self.ctl("--no-autostart", "daemon", "status", timeout=30).rc == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"barreld not ready after {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        logs = [self.log, self.socket.parent / "barreld.log"]
        return "\n".join(p.read_text(errors="replace") for p in logs if p.exists())

    def daemon_pids(self) -> list[int]:
        import psutil

        pids = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "barreld" in cmd and str(self.socket) in cmd:
                pids.append(p.pid)
        return pids

    def stop_all(self) -> None:
        for pid in self.daemon_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while self.daemon_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.daemon_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


@contextlib.contextmanager
def make_world(extra_config: str = "") -> Iterator[World]:
    base = Path(tempfile.mkdtemp(prefix="bw", dir="/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="barrel-test-", dir="/dev/shm"))
    w = World(base, shm, extra_config)
    w.write_config()
    try:
        yield w
    finally:
        w.stop_all()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def world() -> Iterator[World]:
    with make_world() as w:
        yield w


@pytest.fixture(scope="module")
def served() -> Iterator[World]:
    """One running daemon shared by a module's tests (the model loads once)."""
    with make_world() as w:
        w.start_daemon()
        yield w

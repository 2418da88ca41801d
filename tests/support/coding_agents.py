"""What the coding-agent tests share (Claude Code, Codex CLI, OpenCode, each installed by tests/run under .cache/):
a barreld serving Gemma 3 270M with a 32k context as the README serves a base model (its plain dialogue template,
the turn markers as `stop`), reached by an alias for the model names the agent sends, and each request's line in
the daemon's log."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import gemma_path
from tests.test_http import Daemon
from tests.unit.test_tool_formats import dialogue_template

ROOT = Path(__file__).resolve().parents[2]
REQUEST = re.compile(r"barreld\.requests: http gemma: \w+, (\d+) of (\d+) prompt tokens restored.*?, ttft (\d+) ms, "
                     r"total \d+ ms, (\w+)")


def agent_bin(folder: str, name: str) -> Path:
    return ROOT / ".cache" / folder / "node_modules" / ".bin" / name


def agent_daemon(alias: str, label: str) -> Callable[..., Iterator[Daemon]]:
    """A test module's `daemon` fixture (assign it to that name): barreld serving Gemma 3 270M as above, `alias`
    the agent's model names."""

    @pytest.fixture(scope="module")
    def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
        template = tmp_path_factory.mktemp(label) / "dialogue.jinja"
        template.write_text(dialogue_template())
        model = (f'\n[[models]]\nname = "gemma"\npath = "{gemma_path()}"\nn_ctx = 32768\naliases = ["{alias}"]\n'
                 f'chat_template = "{template}"\nstop = ["\\n"]\n')
        with Sandbox.new(model, label=label) as box:
            yield Daemon(box)

    return daemon


def agent_run(binary: Path, args: list[str], home: Path, drop: tuple[str, ...], **env: str
              ) -> subprocess.CompletedProcess[str]:
    """The agent started in `home` as a user would start it there: the caller's environment less the variables
    that begin with one of `drop`, plus HOME and `env`; nothing on stdin."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(drop)} | {"HOME": str(home), **env}
    return subprocess.run([str(binary), *args], env=full, cwd=home, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=900)


def run_twice(d: Daemon, run: Callable[[], subprocess.CompletedProcess[str]], text: bool = True
              ) -> list[list[tuple[int, int, int, str]]]:
    """The agent run twice in a row, each run exiting 0 (with an answer on stdout when `text`): the daemon's
    requests of each run, as `requests` reads them."""
    runs = []
    for _ in range(2):
        since = len(d.box.log_text())
        done = run()
        assert done.returncode == 0 and (done.stdout.strip() or not text), (
            done.returncode, done.stdout[-500:], done.stderr[-1500:])
        runs.append(requests(d, since))
    return runs


def speedup(name: str, runs: list[list[tuple[int, int, int, str]]], first: tuple, second: tuple) -> str:
    """The line a test prints: each run's measured request, how much the second restored, both TTFTs."""
    return (f"{name}: run 1 {first[1]} tokens cold, TTFT {first[2] / 1000:.1f} s; run 2 restored {second[0]} of "
            f"{second[1]}, TTFT {second[2] / 1000:.2f} s ({first[2] / max(second[2], 1):.0f}x); requests per run "
            f"{len(runs[0])}, {len(runs[1])}; replies ended by {[r[3] for run in runs for r in run]}")


def requests(d: Daemon, since: int) -> list[tuple[int, int, int, str]]:
    """(restored, prompt tokens, ms to the first token, finish reason) of each request ended since log offset
    `since`, from the daemon's one line per request."""
    return [(int(r), int(p), int(t), f) for r, p, t, f in REQUEST.findall(d.box.log_text()[since:])]


def fixed_home(name: str) -> Path:
    """A fresh home at the same path on every run: agents write their working directory into the prompt, so
    the prompt, and the greedy reply a base model gives it, is the same from run to run (on a given day)."""
    home = Path(f"/tmp/barrel-{name}-{os.getuid()}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(mode=0o700)
    return home

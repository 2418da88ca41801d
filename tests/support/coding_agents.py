"""What the coding-agent tests share (Claude Code, Codex CLI, OpenCode, each installed by tests/run under .cache/):
a barreld serving Gemma 3 270M with a 32k context as the README serves a base model (its plain dialogue template,
the turn markers as `stop`), reached by an alias for the model names the agent sends, and each request's line in
the daemon's log."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import gemma_path
from tests.test_http import Daemon
from tests.unit.test_tool_formats import dialogue_template

ROOT = Path(__file__).resolve().parents[2]
REQUEST = re.compile(r"barreld\.requests: http gemma: \w+, (\d+) of (\d+) prompt tokens restored.*?, ttft (\d+) ms, "
                     r"total \d+ ms, (\w+)")


def agent_bin(folder: str, name: str) -> Path:
    return ROOT / ".cache" / folder / "node_modules" / ".bin" / name


@contextmanager
def gemma_daemon(where: Path, alias: str, label: str) -> Iterator[Daemon]:
    template = where / "dialogue.jinja"
    template.write_text(dialogue_template())
    model = (f'\n[[models]]\nname = "gemma"\npath = "{gemma_path()}"\nn_ctx = 32768\naliases = ["{alias}"]\n'
             f'chat_template = "{template}"\nstop = ["\\n"]\n')
    with Sandbox.new(model, label=label) as box:
        yield Daemon(box)


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

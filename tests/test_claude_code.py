"""Claude Code itself (the npm package that tests/run installs) against barreld's Messages API: two `claude -p`
calls in a row on Gemma 3 270M with a 32k context, reached by an alias for the model names Claude Code sends.
Both must exit 0 with text; the second call's request must restore at least 90% of its prompt (byte-identical
system blocks and tools) and reach its first token in at most a tenth of the first call's time, as the daemon's
log line for each request says.

Gemma 3 270M is a base model: it never samples its end-of-turn token, so it is served as the README says to
serve one, with the README's plain dialogue template and its turn markers as the model's `stop` strings.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.coding_agents import agent_bin, fixed_home, gemma_daemon, requests
from tests.test_http import Daemon

pytestmark = pytest.mark.model

CLAUDE = agent_bin("claude-code", "claude")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with gemma_daemon(tmp_path_factory.mktemp("claude"), "claude-*", "claude") as d:
        yield d


def claude(d: Daemon, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(ANTHROPIC_BASE_URL=d.base, ANTHROPIC_API_KEY="unused", HOME=str(home),
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS="256",
               DISABLE_AUTOUPDATER="1")
    return subprocess.run([str(CLAUDE), "-p", "Say hello."], env=env, cwd=home, capture_output=True, text=True,
                          timeout=900)


def test_two_claude_code_calls_in_a_row_the_second_warm(daemon: Daemon) -> None:
    assert CLAUDE.exists(), f"Claude Code is not installed at {CLAUDE}: tests/run installs it with npm"
    home = fixed_home("claude-code")
    calls = []
    for _ in range(2):
        since = len(daemon.box.log_text())
        run = claude(daemon, home)
        assert run.returncode == 0 and run.stdout.strip(), (run.returncode, run.stdout[-500:], run.stderr[-500:])
        calls.append(requests(daemon, since))
    first, second = calls[0][0], calls[1][0]  # each call's Messages request (a retry would come after it)
    assert first[1] > 8000 and first[0] == 0, calls  # Claude Code's head, cold
    assert second[0] >= 0.9 * second[1], calls
    assert second[2] <= first[2] / 10, calls
    print(f"claude code: call 1 {first[1]} tokens cold, TTFT {first[2] / 1000:.1f} s; call 2 restored {second[0]} "
          f"of {second[1]}, TTFT {second[2] / 1000:.2f} s ({first[2] / max(second[2], 1):.0f}x); requests per call "
          f"{len(calls[0])}, {len(calls[1])}; replies ended by {[r[3] for c in calls for r in c]}")

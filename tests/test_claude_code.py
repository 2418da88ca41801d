"""Claude Code itself (the npm package that tests/run installs) against barreld's Messages API: two `claude -p`
calls in a row on Gemma 3 270M with a 32k context, reached by an alias for the model names Claude Code sends.
Both must exit 0 with text; the second call's request must restore at least 90% of its prompt (byte-identical
system blocks and tools) and reach its first token in at most a tenth of the first call's time, as the daemon's
log line for each request says.

Gemma 3 270M is a base model: it never samples its end-of-turn token, so it is served as the README says to
serve one, with the README's plain dialogue template and its turn markers as the model's `stop` strings.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.coding_agents import agent_bin, agent_daemon, agent_run, fixed_home, run_twice, speedup
from tests.test_http import Daemon

pytestmark = pytest.mark.model

CLAUDE = agent_bin("claude-code", "claude")


daemon = agent_daemon("claude-*", "claude")


def claude(d: Daemon, home: Path) -> subprocess.CompletedProcess[str]:
    return agent_run(CLAUDE, ["-p", "Say hello."], home, ("ANTHROPIC_", "CLAUDE_"), ANTHROPIC_BASE_URL=d.base,
                     ANTHROPIC_API_KEY="unused", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                     CLAUDE_CODE_MAX_OUTPUT_TOKENS="256", DISABLE_AUTOUPDATER="1")


def test_two_claude_code_calls_in_a_row_the_second_warm(daemon: Daemon) -> None:
    assert CLAUDE.exists(), f"Claude Code is not installed at {CLAUDE}: tests/run installs it with npm"
    home = fixed_home("claude-code")
    runs = run_twice(daemon, lambda: claude(daemon, home))
    first, second = runs[0][0], runs[1][0]  # each call's Messages request (a retry would come after it)
    assert first[1] > 8000 and first[0] == 0, runs  # Claude Code's head, cold
    assert second[0] >= 0.9 * second[1], runs
    assert second[2] <= first[2] / 10, runs
    print(speedup("claude code", runs, first, second))

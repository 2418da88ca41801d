"""Codex CLI itself (the npm package that tests/run installs) against barreld's Responses API: two `codex exec`
runs in a row on Gemma 3 270M with a 32k context, reached through the provider block the README gives
(`wire_api = "responses"`) and an alias for Codex's model names. Both must exit 0 with an answer; the second run's
request must restore at least 90% of its input (Codex resends the same instructions, tools and environment, only
the items' ids and its cache key change) and reach its first token in at most a tenth of the first run's time,
as the daemon's log line for each request says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support.coding_agents import ROOT, agent_bin, agent_daemon, agent_run, fixed_home, run_twice, speedup
from tests.test_http import Daemon

pytestmark = pytest.mark.model

CODEX = agent_bin("codex", "codex")


daemon = agent_daemon("gpt-*", "codex")


def provider_block(base: str) -> str:
    """The README's ~/.codex/config.toml, pointed at this daemon."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"cat > ~/.codex/config.toml <<'TOML'\n(.*?)TOML\n", readme, re.S).group(1)
    return block.replace("http://127.0.0.1:8080", base)


def codex(d: Daemon, home: Path) -> subprocess.CompletedProcess[str]:
    (home / ".codex").mkdir(exist_ok=True)
    (home / ".codex" / "config.toml").write_text(provider_block(d.base))
    return agent_run(CODEX, ["exec", "--skip-git-repo-check", "Say hello."], home, ("OPENAI_", "CODEX_"),
                     CODEX_HOME=str(home / ".codex"))


def test_two_codex_runs_in_a_row_the_second_warm(daemon: Daemon) -> None:
    assert CODEX.exists(), f"Codex CLI is not installed at {CODEX}: tests/run installs it with npm"
    home = fixed_home("codex")
    runs = run_twice(daemon, lambda: codex(daemon, home))
    first, second = runs[0][0], runs[1][0]  # each run's first Responses request
    assert first[1] > 8000 and first[0] == 0, runs  # Codex's head, cold
    assert second[0] >= 0.9 * second[1], runs
    assert second[2] <= first[2] / 10, runs
    print(speedup("codex", runs, first, second))

"""Codex CLI itself (the npm package that tests/run installs) against barreld's Responses API: two `codex exec`
runs in a row on Gemma 3 270M with a 32k context, reached through the provider block the README gives
(`wire_api = "responses"`) and an alias for Codex's model names. Both must exit 0 with an answer; the second run's
request must restore at least 90% of its input (Codex resends the same instructions, tools and environment, only
the items' ids and its cache key change) and reach its first token in at most a tenth of the first run's time,
as the daemon's log line for each request says."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.coding_agents import ROOT, agent_bin, fixed_home, gemma_daemon, requests
from tests.test_http import Daemon

pytestmark = pytest.mark.model

CODEX = agent_bin("codex", "codex")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with gemma_daemon(tmp_path_factory.mktemp("codex"), "gpt-*", "codex") as d:
        yield d


def provider_block(base: str) -> str:
    """The README's ~/.codex/config.toml, pointed at this daemon."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"cat > ~/.codex/config.toml <<'TOML'\n(.*?)TOML\n", readme, re.S).group(1)
    return block.replace("http://127.0.0.1:8080", base)


def codex(d: Daemon, home: Path) -> subprocess.CompletedProcess[str]:
    (home / ".codex").mkdir(exist_ok=True)
    (home / ".codex" / "config.toml").write_text(provider_block(d.base))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(HOME=str(home), CODEX_HOME=str(home / ".codex"))
    return subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "Say hello."], env=env, cwd=home,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)


def test_two_codex_runs_in_a_row_the_second_warm(daemon: Daemon) -> None:
    assert CODEX.exists(), f"Codex CLI is not installed at {CODEX}: tests/run installs it with npm"
    home = fixed_home("codex")
    calls = []
    for _ in range(2):
        since = len(daemon.box.log_text())
        run = codex(daemon, home)
        assert run.returncode == 0 and run.stdout.strip(), (run.returncode, run.stdout[-500:], run.stderr[-1500:])
        calls.append(requests(daemon, since))
    first, second = calls[0][0], calls[1][0]  # each run's first Responses request
    assert first[1] > 8000 and first[0] == 0, calls  # Codex's head, cold
    assert second[0] >= 0.9 * second[1], calls
    assert second[2] <= first[2] / 10, calls
    print(f"codex: run 1 {first[1]} tokens cold, TTFT {first[2] / 1000:.1f} s; run 2 restored {second[0]} of "
          f"{second[1]}, TTFT {second[2] / 1000:.2f} s ({first[2] / max(second[2], 1):.0f}x); requests per run "
          f"{len(calls[0])}, {len(calls[1])}; replies ended by {[r[3] for c in calls for r in c]}")

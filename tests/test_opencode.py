"""OpenCode itself (the npm package that tests/run installs, with @ai-sdk/openai-compatible beside it) against
barreld's chat completions: two `opencode run` calls in a row on Gemma 3 270M with a 32k context, configured as
the README's "Use it from OpenCode" says. OpenCode sends each run two requests, a short one for the session's
title and the agent's own (its system prompt and ten tools). Both runs must exit 0; the second run's agent
request must restore at least 90% of its prompt, as the daemon's log line for each request says. Nothing is
fetched: models.dev, updates, LSP servers and plugins are off."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.coding_agents import ROOT, agent_bin, agent_daemon, agent_run, fixed_home, run_twice, speedup
from tests.test_http import Daemon

pytestmark = pytest.mark.model

OPENCODE = agent_bin("opencode", "opencode")
OFFLINE = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
           "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}


daemon = agent_daemon("gemma-*", "opencode")


def config(base: str) -> dict:
    """The README's opencode.json, pointed at this daemon."""
    readme = (ROOT / "README.md").read_text()
    doc = json.loads(re.search(r"cat > ~/.config/opencode/opencode.json <<'JSON'\n(.*?)JSON\n", readme, re.S).group(1))
    doc["provider"]["barrel"]["options"]["baseURL"] = f"{base}/v1"
    doc["provider"]["barrel"]["models"]["gemma"]["limit"]["output"] = 32  # the base model's replies are not read
    return doc


def opencode(d: Daemon, home: Path) -> subprocess.CompletedProcess[str]:
    where = home / ".config" / "opencode"
    where.mkdir(parents=True, exist_ok=True)
    (where / "opencode.json").write_text(json.dumps(config(d.base)))
    return agent_run(OPENCODE, ["run", "Say hello."], home, ("OPENAI_", "OPENCODE_"),
                     XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local"),
                     XDG_CACHE_HOME=str(home / ".cache"), **OFFLINE)


def test_two_opencode_runs_in_a_row_the_second_warm(daemon: Daemon) -> None:
    assert OPENCODE.exists(), f"OpenCode is not installed at {OPENCODE}: tests/run installs it with npm"
    home = fixed_home("opencode")
    runs = run_twice(daemon, lambda: opencode(daemon, home), text=False)
    # the agent's request is each run's longest (the title request is a few hundred tokens)
    first, second = (max(r, key=lambda x: x[1]) for r in runs)
    assert first[1] > 5000 and first[0] == 0, runs  # OpenCode's head, cold
    assert second[0] >= 0.9 * second[1], runs
    print(speedup("opencode", runs, first, second))

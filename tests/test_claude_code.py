"""Claude Code itself (the npm package that tests/run installs) against barreld's Messages API: two `claude -p`
calls in a row on Gemma 3 270M with a 32k context, reached by an alias for the model names Claude Code sends.
Both must exit 0 with text; the second call's request must restore at least 90% of its prompt (byte-identical
system blocks and tools) and reach its first token in at most a tenth of the first call's time.

Gemma 3 270M is a base model: it never samples its end-of-turn token, so it is served as the README says to
serve one, with the README's plain dialogue template and its turn markers as the model's `stop` strings.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import gemma_path
from tests.test_http import Daemon
from tests.unit.test_tool_formats import dialogue_template

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parent.parent
CLAUDE = ROOT / ".cache" / "claude-code" / "node_modules" / ".bin" / "claude"
TTFT = "barrel_time_to_first_token_seconds"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    template = tmp_path_factory.mktemp("claude") / "dialogue.jinja"
    template.write_text(dialogue_template())
    model = (f'\n[[models]]\nname = "gemma"\npath = "{gemma_path()}"\nn_ctx = 32768\naliases = ["claude-*"]\n'
             f'chat_template = "{template}"\nstop = ["\\nUser:", "\\nAssistant:"]\n')
    with Sandbox.new(model, label="claude") as box:
        yield Daemon(box)


def claude(d: Daemon, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(ANTHROPIC_BASE_URL=d.base, ANTHROPIC_API_KEY="unused", HOME=str(home),
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_OUTPUT_TOKENS="64",
               DISABLE_AUTOUPDATER="1")
    return subprocess.run([str(CLAUDE), "-p", "Say hello."], env=env, cwd=home, capture_output=True, text=True,
                          timeout=900)


def figures(d: Daemon) -> tuple[float, float, float, float]:
    """Requests, prompt tokens, restored tokens and the sum of times to first token, so far."""
    return (d.metric(f'{TTFT}_count{{model="gemma"}}'), d.metric('barrel_prompt_tokens_total{model="gemma"}'),
            d.metric('barrel_restored_tokens_total{model="gemma"}'), d.metric(f'{TTFT}_sum{{model="gemma"}}'))


def test_two_claude_code_calls_in_a_row_the_second_warm(daemon: Daemon, tmp_path: Path) -> None:
    assert CLAUDE.exists(), f"Claude Code is not installed at {CLAUDE}: tests/run installs it with npm"
    calls = []
    for _ in range(2):
        before = figures(daemon)
        run = claude(daemon, tmp_path)
        assert run.returncode == 0 and run.stdout.strip(), (run.returncode, run.stdout[-500:], run.stderr[-500:])
        calls.append([after - b for after, b in zip(figures(daemon), before, strict=True)])
    (n1, prompt1, restored1, ttft1), (n2, prompt2, restored2, ttft2) = calls
    assert n1 == n2 == 1, calls  # one Messages request per call: the reply ended its turn
    assert prompt1 > 8000 and restored1 == 0, calls  # Claude Code's head, cold
    assert restored2 >= 0.9 * prompt2, calls
    assert ttft2 <= ttft1 / 10, calls
    print(f"claude code: call 1 {prompt1:.0f} tokens cold, TTFT {ttft1:.1f} s; call 2 restored "
          f"{restored2:.0f} of {prompt2:.0f}, TTFT {ttft2:.2f} s ({ttft1 / ttft2:.0f}x)")

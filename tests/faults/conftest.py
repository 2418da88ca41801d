"""The whole-daemon fault suite: every test here is marked `faults` (and `model`: it runs the real model),
so `pytest -m 'not faults'` skips it while `.ci/run` (plain `pytest -q`) runs it.

Knobs for a longer hunt (the defaults are what CI runs): FAULTS_KILLS (SIGKILLs, default 40),
FAULTS_FUZZ_EXAMPLES (default 150) and FAULTS_FUZZ_RANDOM=1 (new fuzz examples instead of the fixed set).
Run with `-s` to see each part's counts."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item, not only this directory's: mark ours alone.
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.faults)
            item.add_marker(pytest.mark.model)

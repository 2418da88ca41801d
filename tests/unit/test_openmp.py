"""barreld's OpenMP wait defaults: set before llama.cpp loads, an operator's own setting kept."""

from __future__ import annotations

import subprocess
import sys

from barreld.engine.openmp import WAIT_DEFAULTS, set_wait_defaults


def test_each_default_the_environment_lacks_is_set_and_an_operators_own_is_kept() -> None:
    env: dict[str, str] = {}
    assert set_wait_defaults(env) == WAIT_DEFAULTS and env == WAIT_DEFAULTS
    env = {"OMP_WAIT_POLICY": "passive"}
    assert set_wait_defaults(env) == {"GOMP_SPINCOUNT": "10000"}
    assert env == {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10000"}
    assert set_wait_defaults(env) == {}


def test_barreld_sets_them_before_anything_imports_llama_cpp() -> None:
    """main() sets them first thing: a daemon that stops at a bad config has them set and llama.cpp unloaded."""
    code = ("import os, sys; from barreld.main import main; os.environ.pop('OMP_WAIT_POLICY', None); "
            "os.environ.pop('GOMP_SPINCOUNT', None); rc = main(['--config', '/nonexistent/barreld.toml']); "
            "print(rc, os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), "
            "any(m.startswith('llama_cpp') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[1:] == ["active", "10000", "False"], (out.stdout, out.stderr[-500:])

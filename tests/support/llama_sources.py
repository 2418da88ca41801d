"""The chat templates and chat tests of the llama.cpp that llama-cpp-python vendors, unpacked by tests/run under
.cache/llama.cpp/ from llama-cpp-python's source distribution (the version installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from barreld.engine.callformats import Family, families

ROOT = Path(__file__).resolve().parents[2] / ".cache" / "llama.cpp"


def template_path(name: str) -> Path:
    """A template of llama.cpp's models/templates/, by file name; fails (not skips) when tests/run has not
    unpacked them, since a missing file is a broken set-up, not a reason to test less."""
    path = ROOT / "templates" / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run tests/run, which unpacks llama.cpp's templates under .cache/")
    return path


def template(name: str) -> str:
    return template_path(name).read_text()


def family_named(name: str) -> Family:
    """A family's format by its name (as `barrelctl models` reports it)."""
    return next(f for f in families() if f.name == name)

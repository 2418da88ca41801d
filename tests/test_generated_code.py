"""The committed gRPC code must be what `python -m barreld.rpc.generate` makes from proto/ today."""

from __future__ import annotations

from pathlib import Path

from barreld.rpc import generate


def test_generated_code_is_current(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    for name in generate.GENERATED:
        committed = (generate.PACKAGE_DIR / name).read_text()
        fresh = (tmp_path / name).read_text()
        assert committed == fresh, f"{name} is stale: run `python -m barreld.rpc.generate` and commit"

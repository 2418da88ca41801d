"""bench.report's sections: each says where and under what noise its figures were measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import report


def test_a_section_names_its_cpu_and_the_share_the_host_took(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # user, nice, system, idle, iowait, irq, softirq, steal: 300 ticks spent since the start, 75 of them stolen
    monkeypatch.setattr(report, "_TICKS_AT_START", [100, 0, 10, 500, 0, 0, 0, 20])
    monkeypatch.setattr(report, "_cpu_ticks", lambda: [250, 0, 20, 565, 0, 0, 0, 95])
    path = tmp_path / "RESULTS.md"
    report.put_section(path, "one", "## One\n\nfigures\n")
    report.put_section(path, "two", "## Two\n\nother figures\n")
    text = path.read_text()
    assert text.count(f"on {report.this_cpu()}; the host took 25% of its CPU time over the run (steal).") == 2
    assert text.index("## One") < text.index("figures") < text.index("## Two")


def test_without_proc_the_steal_share_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "_cpu_ticks", lambda: [])
    assert report.stolen_share() is None
    path = tmp_path / "RESULTS.md"
    report.put_section(path, "one", "## One\n\nfigures\n")
    assert f"on {report.this_cpu()}._" in path.read_text()

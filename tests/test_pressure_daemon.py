"""Memory-pressure eviction in the real daemon: a module source driven through a file, real RSS."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from tests.support.sandbox import Sandbox
from tests.test_cache_paths import POLICY, complete, doc

pytestmark = pytest.mark.model

PROBE = '''
import os


def sample():
    used, total = open(os.environ["BARREL_TEST_PRESSURE_FILE"]).read().split()
    return int(used), int(total)
'''


def models(path: str) -> str:
    return "".join(f'\n[[models]]\nname = "{n}"\npath = "{path}"\ntier = "{t}"\n'
                   for n, t in (("r", "ram"), ("f", "ram_file"), ("d", "disk")))


def bundled() -> str:
    from barreld.engine.registry import bundled_model_path

    return str(bundled_model_path("smollm2"))


def status(w: Sandbox) -> dict:
    r = w.ctl("--json", "scheduler", "status")
    assert r.rc == 0, r.err
    return r.json()


def rows(w: Sandbox) -> list[dict]:
    return w.ctl("--json", "cache", "dump").json()["rows"]


def test_crossing_the_high_watermark_evicts_ram_tiers_only() -> None:
    with Sandbox.new() as w:
        (w.base / "pyextra").mkdir()
        (w.base / "pyextra" / "pressure_probe.py").write_text(PROBE)
        pressure = w.base / "pressure"
        pressure.write_text("0 1000000000000")
        w.write_config(POLICY + models(bundled()) + """
[scheduler]
enabled = true
pressure_source = "module:pressure_probe"
interval_ms = 100
high_watermark = 0.85
low_watermark = 0.75
""")
        env = {"PYTHONPATH": f"{w.env()['PYTHONPATH']}:{w.base / 'pyextra'}",
               "BARREL_TEST_PRESSURE_FILE": str(pressure)}
        w.start_daemon(env=env)
        for name in ("r", "f", "d"):
            complete(w, doc(ord(name), 560), "--model", name)
        before = rows(w)
        assert {r["tier"] for r in before} == {"ram", "ram_file", "disk"}
        ram_bytes = sum(r["size"] for r in before if r["tier"] in ("ram", "ram_file"))
        total = 10 * ram_bytes
        used = int(0.75 * total) + ram_bytes     # only evicting every ram/ram_file byte gets below low
        s = status(w)
        assert s["enabled"] and s["available"] and not s.get("last_eviction")
        pressure.write_text(f"{used} {total}")
        deadline = time.monotonic() + 20
        while not status(w).get("last_eviction") and time.monotonic() < deadline:
            time.sleep(0.1)
        s = status(w)
        assert s["bytes_freed_total"] >= ram_bytes and s["last_eviction"]["evicted"] >= 1
        assert s["last_sample"]["ratio"] >= 0.85
        after = rows(w)
        assert {r["tier"] for r in after} == {"disk"}
        assert [r["key"] for r in after] == [r["key"] for r in before if r["tier"] == "disk"]
        human = w.ctl("scheduler", "status")
        assert "last eviction" in human.out and "never" not in human.out.split("last eviction")[1].splitlines()[0]


def test_evicting_ram_rows_gives_memory_back_to_the_os() -> None:
    with Sandbox.new(POLICY + '\n[tiers.ram]\nquota = "1G"\n' + models(bundled())) as w:
        w.start_daemon()
        pid = json.loads(w.ctl("--json", "daemon", "status").out)["pid"]
        i = 0
        while w.ctl("--json", "cache", "stats").json()["tiers"]["ram"]["bytes"] < 110 * 2**20:  # blocks included
            complete(w, doc(600 + i, 560), "--model", "r")
            i += 1
        complete(w, "Unrelated short prompt.", "--model", "r", "--max-tokens", "2")
        time.sleep(0.5)
        rss_before = psutil.Process(pid).memory_info().rss
        r = w.ctl("--json", "cache", "evict-bytes", "100M", "--tier", "ram")
        assert r.rc == 0, r.err
        freed = r.json()["bytes_freed"]
        assert freed >= 100 * 2**20
        rss_after = psutil.Process(pid).memory_info().rss
        assert rss_before - rss_after >= 75 * 2**20, (rss_before, rss_after, freed)


def test_nvidia_smi_without_the_tool_reports_unavailable() -> None:
    with Sandbox.new('\n[scheduler]\nenabled = true\npressure_source = "nvidia_smi"\ninterval_ms = 100\n') as w:
        w.start_daemon(env={"PATH": "/nonexistent"})
        deadline = time.monotonic() + 10
        while status(w).get("available") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        s = status(w)
        assert s["enabled"] and s["available"] is False
        assert "nvidia-smi" in (s.get("unavailable_reason") or "")
        assert w.ctl("complete", "Still serving?", "--max-tokens", "3").rc == 0
        assert "unavailable" in w.ctl("scheduler", "status").out

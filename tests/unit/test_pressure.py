"""Memory-pressure scheduler and its sources, driven through files and fake tools, never real pressure."""

import json
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from barreld.pressure.scheduler import Evict, PressureScheduler, check_watermarks
from barreld.pressure.sources import (
    ModuleSource,
    NoopSource,
    NvidiaSmiSource,
    SourceUnavailable,
    SystemSource,
    check_source_spec,
    make_source,
)

MIB = 1024 * 1024
GIB = 1024 * MIB

STATUS_KEYS = {
    "enabled",
    "running",
    "source",
    "high_watermark",
    "low_watermark",
    "interval_ms",
    "evict_tiers",
    "available",
    "unavailable_reason",
    "last_sample",
    "last_eviction",
    "evictions_total",
    "bytes_freed_total",
    "errors",
    "ticks",
}


class FileSource:
    """A `module:` source whose sample() reads "used total" (or raw junk) from a file the test writes."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.module = f"barrel_test_pressure_{uuid.uuid4().hex}"
        self.file = directory / "pressure.txt"
        (directory / f"{self.module}.py").write_text(
            "import pathlib\n"
            f"FILE = pathlib.Path({str(self.file)!r})\n"
            "def sample():\n"
            "    return eval(FILE.read_text())\n"
        )
        monkeypatch.syspath_prepend(str(directory))
        monkeypatch.delitem(sys.modules, self.module, raising=False)
        self.spec = f"module:{self.module}"

    def set(self, used: int, total: int) -> None:
        self.file.write_text(f"({used}, {total})")

    def set_raw(self, python_expression: str) -> None:
        self.file.write_text(python_expression)


class FakeCache:
    """Rows per tier, oldest first within a tier; a stand-in for the real cache's evict_bytes."""

    def __init__(self, rows: dict[str, list[int]]) -> None:
        self.rows = {tier: list(sizes) for tier, sizes in rows.items()}
        self.calls: list[tuple[int, list[str]]] = []

    def evict_bytes(self, n_bytes: int, tiers: list[str]) -> tuple[int, int]:
        self.calls.append((n_bytes, tiers))
        evicted = freed = 0
        for tier in tiers:
            while self.rows.get(tier) and freed < n_bytes:
                freed += self.rows[tier].pop(0)
                evicted += 1
        return evicted, freed

    def bytes_in(self, tier: str) -> int:
        return sum(self.rows[tier])


@pytest.fixture
def file_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FileSource:
    return FileSource(tmp_path, monkeypatch)


def scheduler(source_spec: str, evict: Evict, **kwargs: Any) -> PressureScheduler:
    kwargs.setdefault("enabled", True)
    kwargs.setdefault("high_watermark", 0.85)
    kwargs.setdefault("low_watermark", 0.75)
    return PressureScheduler(make_source(source_spec), evict, **kwargs)


def never_evict(n_bytes: int, tiers: list[str]) -> tuple[int, int]:
    raise AssertionError(f"evict({n_bytes}, {tiers}) was not expected")


# crossing the watermark


def test_crossing_high_watermark_evicts_down_to_low(file_source: FileSource) -> None:
    cache = FakeCache({"ram": [100 * MIB] * 20, "ram_file": [100 * MIB] * 20, "disk": [100 * MIB] * 20})
    sched = scheduler(file_source.spec, cache.evict_bytes, clock=lambda: 1234.5)
    total = 10 * GIB
    used = 9 * GIB  # 0.9 >= 0.85
    file_source.set(used, total)

    sched.tick()

    wanted = math.ceil(used - 0.75 * total)
    assert cache.calls == [(wanted, ["ram", "ram_file"])]
    status = sched.status()
    assert status["last_sample"] == {"used": used, "total": total, "ratio": 0.9, "at": 1234.5}
    freed = status["last_eviction"]["bytes_freed"]
    assert status["last_eviction"] == {"at": 1234.5, "requested": wanted, "evicted": 16, "bytes_freed": freed}
    assert freed >= wanted
    assert (used - freed) / total < 0.75
    assert cache.bytes_in("disk") == 20 * 100 * MIB, "disk is not in evict_tiers"
    assert status["evictions_total"] == 1
    assert status["bytes_freed_total"] == freed
    assert status["available"] is True
    assert status["errors"] == []


def test_disk_is_evicted_only_when_named(file_source: FileSource) -> None:
    cache = FakeCache({"ram": [GIB], "ram_file": [GIB], "disk": [GIB] * 4})
    sched = scheduler(file_source.spec, cache.evict_bytes, evict_tiers=["ram", "ram_file", "disk"])
    file_source.set(99 * GIB // 10, 10 * GIB)  # wants 2.4 GiB: more than ram and ram_file hold
    sched.tick()
    assert cache.calls[0][1] == ["ram", "ram_file", "disk"]
    assert cache.bytes_in("disk") < 4 * GIB


def test_below_high_watermark_does_not_evict(file_source: FileSource) -> None:
    sched = scheduler(file_source.spec, never_evict)
    file_source.set(849, 1000)
    sched.tick()
    status = sched.status()
    assert status["last_sample"]["ratio"] == 0.849
    assert status["last_eviction"] is None
    assert status["evictions_total"] == 0


def test_exactly_at_high_watermark_evicts(file_source: FileSource) -> None:
    cache = FakeCache({"ram": [1] * 1000})
    sched = scheduler(file_source.spec, cache.evict_bytes, high_watermark=0.5, low_watermark=0.25)
    file_source.set(500, 1000)
    sched.tick()
    assert cache.calls == [(250, ["ram", "ram_file"])]


def test_requested_bytes_round_up(file_source: FileSource) -> None:
    cache = FakeCache({"ram": [1] * 10})
    sched = scheduler(file_source.spec, cache.evict_bytes, high_watermark=0.9, low_watermark=0.3)
    file_source.set(10, 11)  # 10 - 0.3 * 11 = 6.7
    sched.tick()
    assert cache.calls[0][0] == 7


def test_keeps_evicting_on_later_ticks_while_pressure_stays(file_source: FileSource) -> None:
    cache = FakeCache({"ram": []})
    sched = scheduler(file_source.spec, cache.evict_bytes)
    file_source.set(95, 100)
    sched.tick()
    sched.tick()
    assert len(cache.calls) == 2
    # Passes that found nothing to evict do not count, nor hide the last real eviction.
    assert sched.status()["evictions_total"] == 0
    assert sched.status()["last_eviction"] is None
    assert sched.status()["bytes_freed_total"] == 0


# failures cost one tick


@pytest.mark.parametrize(
    "junk",
    [
        "None",
        "(1,)",
        "(1, 2, 3)",
        "(1.5, 2)",
        "('1', '2')",
        "(True, 2)",
        "(-1, 10)",
        "(11, 10)",
        "(0, 0)",
        "(5, -10)",
        "'95 100'",
    ],
)
def test_nonsense_sample_is_skipped(file_source: FileSource, junk: str) -> None:
    sched = scheduler(file_source.spec, never_evict)
    file_source.set(10, 100)
    sched.tick()
    file_source.set_raw(junk)
    sched.tick()
    status = sched.status()
    assert status["ticks"] == 2
    assert status["last_sample"]["used"] == 10, "the bad sample did not replace the good one"
    assert len(status["errors"]) == 1
    assert "sample() returned" in status["errors"][0]["message"]
    assert status["available"] is True


def test_raising_source_is_logged_and_skipped(
    file_source: FileSource, caplog: pytest.LogCaptureFixture
) -> None:
    sched = scheduler(file_source.spec, never_evict)
    file_source.set_raw("1/0")
    sched.tick()
    status = sched.status()
    assert status["last_sample"] is None
    assert "division by zero" in status["errors"][0]["message"]
    assert "division by zero" in caplog.text
    file_source.set(1, 2)
    sched.tick()
    assert sched.status()["last_sample"]["ratio"] == 0.5


def test_raising_or_nonsense_evict_is_logged_and_skipped(file_source: FileSource) -> None:
    def broken(n_bytes: int, tiers: list[str]) -> tuple[int, int]:
        raise OSError("index is gone")

    sched = scheduler(file_source.spec, broken)
    file_source.set(99, 100)
    sched.tick()
    status = sched.status()
    assert status["last_eviction"] is None
    assert "index is gone" in status["errors"][0]["message"]

    sched = scheduler(file_source.spec, lambda n, tiers: None)  # type: ignore[arg-type,return-value]
    sched.tick()
    assert sched.status()["errors"][0]["message"].startswith("evicting 24 bytes from ram, ram_file failed")


def test_errors_keep_only_the_last_few(file_source: FileSource) -> None:
    sched = scheduler(file_source.spec, never_evict)
    file_source.set_raw("None")
    for _ in range(25):
        sched.tick()
    assert len(sched.status()["errors"]) == 10
    assert sched.status()["ticks"] == 25


# nvidia_smi


def fake_tool(directory: Path, script: str) -> None:
    tool = directory / "nvidia-smi"
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)


def test_nvidia_smi_without_the_tool_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SourceUnavailable, match="nvidia-smi not found on PATH"):
        NvidiaSmiSource().sample()

    sched = scheduler("nvidia_smi", never_evict)
    sched.tick()
    status = sched.status()
    assert status["available"] is False
    assert status["unavailable_reason"] == "nvidia-smi not found on PATH"
    assert status["errors"] == []
    assert status["source"] == "nvidia_smi"


def test_unavailable_source_is_rechecked_slowly_not_spun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    sched = scheduler("nvidia_smi", never_evict, interval_ms=5, unavailable_retry_ms=60_000)
    sched.start()
    try:
        time.sleep(0.3)
        assert sched.status()["ticks"] == 1
        assert sched.status()["running"] is True
    finally:
        started = time.monotonic()
        sched.stop()
    assert time.monotonic() - started < 1
    assert sched.status()["running"] is False


def test_nvidia_smi_sums_gpus_and_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    sched = scheduler("nvidia_smi", never_evict)
    sched.tick()
    assert sched.status()["available"] is False

    fake_tool(tmp_path, 'echo "1024, 81920"\necho "512, 81920"\n')
    sched.tick()
    status = sched.status()
    assert status["available"] is True
    assert status["unavailable_reason"] is None
    assert (status["last_sample"]["used"], status["last_sample"]["total"]) == (1536 * MIB, 163840 * MIB)


def test_nvidia_smi_passes_the_documented_query(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    args = tmp_path / "args"
    fake_tool(tmp_path, f'echo "$@" > {args}\necho "1, 2"\n')
    assert NvidiaSmiSource().sample() == (MIB, 2 * MIB)
    assert args.read_text().split() == [
        "--query-gpu=memory.used,memory.total",
        "--format=csv,noheader,nounits",
    ]


def test_nvidia_smi_failing_driver_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    fake_tool(
        tmp_path, 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the driver"\nexit 9\n'
    )
    with pytest.raises(SourceUnavailable, match="exited 9: NVIDIA-SMI has failed"):
        NvidiaSmiSource().sample()


@pytest.mark.parametrize("output", ['echo "[N/A], 1024"', 'echo "12"', 'echo "1, 2, 3"'])
def test_nvidia_smi_garbage_is_an_error_not_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    fake_tool(tmp_path, output + "\n")
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        NvidiaSmiSource().sample()


def test_nvidia_smi_no_gpus_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    fake_tool(tmp_path, "exit 0\n")
    with pytest.raises(SourceUnavailable, match="no GPU"):
        NvidiaSmiSource().sample()


# the thread


def test_thread_polls_and_stops_promptly(file_source: FileSource) -> None:
    cache = FakeCache({"ram": [1] * 1000})
    sched = scheduler(file_source.spec, cache.evict_bytes, interval_ms=10)
    file_source.set(90, 100)
    sched.start()
    sched.start()  # a second start is a no-op, not a second thread
    deadline = time.monotonic() + 5
    while sched.status()["evictions_total"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sched.status()["evictions_total"] >= 3
    sched.stop()
    assert sched.status()["running"] is False


def test_stop_does_not_wait_for_the_interval(file_source: FileSource) -> None:
    sched = scheduler(file_source.spec, never_evict, interval_ms=600_000)
    file_source.set(1, 100)
    sched.start()
    time.sleep(0.05)
    started = time.monotonic()
    sched.stop()
    assert time.monotonic() - started < 1
    assert sched.status()["ticks"] == 1


def test_disabled_scheduler_does_not_start_but_answers_status() -> None:
    sched = PressureScheduler(NoopSource(), never_evict)
    sched.start()
    status = sched.status()
    assert set(status) == STATUS_KEYS
    assert status["enabled"] is False
    assert status["running"] is False
    assert status["ticks"] == 0
    assert status["available"] is None
    assert status["source"] == "noop"
    assert (status["high_watermark"], status["low_watermark"], status["interval_ms"]) == (0.85, 0.75, 5000)
    assert status["evict_tiers"] == ["ram", "ram_file"]
    sched.stop()


def test_status_is_json(file_source: FileSource) -> None:
    cache = FakeCache({"ram": [10] * 10})
    sched = scheduler(file_source.spec, cache.evict_bytes)
    file_source.set(99, 100)
    sched.tick()
    file_source.set_raw("None")
    sched.tick()
    status = json.loads(json.dumps(sched.status()))
    assert set(status) == STATUS_KEYS
    assert status["source"] == file_source.spec


def test_noop_never_evicts() -> None:
    sched = PressureScheduler(NoopSource(), never_evict, enabled=True, high_watermark=0.0001, low_watermark=0)
    sched.tick()
    assert sched.status()["last_sample"]["ratio"] == 0


# watermarks and specs


@pytest.mark.parametrize(
    ("high", "low"),
    [(0.8, 0.8), (0.7, 0.8), (1.1, 0.5), (0.9, -0.1), (float("nan"), 0.5), (True, 0.5), ("0.9", 0.5)],
)
def test_bad_watermarks_are_refused(high: float, low: float) -> None:
    with pytest.raises(ValueError, match="watermark"):
        check_watermarks(high, low)
    with pytest.raises(ValueError, match="watermark"):
        PressureScheduler(NoopSource(), never_evict, high_watermark=high, low_watermark=low)


@pytest.mark.parametrize(("high", "low"), [(1, 0), (0.85, 0.75), (1.0, 0.99)])
def test_good_watermarks(high: float, low: float) -> None:
    check_watermarks(high, low)


def test_other_bad_scheduler_settings() -> None:
    with pytest.raises(ValueError, match="interval_ms"):
        PressureScheduler(NoopSource(), never_evict, interval_ms=0)
    with pytest.raises(ValueError, match="evict_tiers"):
        PressureScheduler(NoopSource(), never_evict, evict_tiers=[])


@pytest.mark.parametrize("spec", ["noop", "system", "nvidia_smi", "module:json"])
def test_known_specs_pass_the_check(spec: str) -> None:
    check_source_spec(spec)


@pytest.mark.parametrize("spec", ["", "memsup", "System", "module:", "module:a..b", "module:1x", "mod:json"])
def test_unknown_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="unknown pressure source"):
        check_source_spec(spec)
    with pytest.raises(ValueError, match="unknown pressure source"):
        make_source(spec)


def test_module_spec_must_exist_and_have_sample() -> None:
    with pytest.raises(ValueError, match="no module named barrel_no_such_module"):
        check_source_spec("module:barrel_no_such_module")
    with pytest.raises(ValueError, match="cannot import"):
        make_source("module:barrel_no_such_module.sub")
    with pytest.raises(ValueError, match="has no sample"):
        ModuleSource("json")


def test_make_source_names() -> None:
    assert make_source("noop").name == "noop"
    assert make_source("system").name == "system"
    assert make_source("nvidia_smi").name == "nvidia_smi"


# system source


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_system_without_cgroup_is_host_memory(tmp_path: Path) -> None:
    used, total = SystemSource(cgroup_root=tmp_path, proc_cgroup=tmp_path / "absent").sample()
    assert total == psutil.virtual_memory().total
    assert 0 < used <= total


def test_system_uses_a_v2_cgroup_limit(tmp_path: Path) -> None:
    write(tmp_path / "proc", "0::/user.slice/barrel.service\n")
    group = tmp_path / "cg/user.slice/barrel.service"
    write(group / "memory.max", f"{GIB}\n")
    write(group / "memory.current", f"{600 * MIB}\n")
    write(group / "memory.stat", f"anon 1\nactive_file 5\ninactive_file {100 * MIB}\n")
    assert SystemSource(cgroup_root=tmp_path / "cg", proc_cgroup=tmp_path / "proc").sample() == (
        500 * MIB,
        GIB,
    )


def test_system_walks_up_to_the_limiting_ancestor(tmp_path: Path) -> None:
    write(tmp_path / "proc", "0::/limited/child\n")
    write(tmp_path / "cg/limited/child/memory.max", "max\n")
    write(tmp_path / "cg/limited/child/memory.current", "1\n")
    write(tmp_path / "cg/limited/memory.max", f"{GIB}\n")
    write(tmp_path / "cg/limited/memory.current", f"{300 * MIB}\n")
    assert SystemSource(tmp_path / "cg", tmp_path / "proc").sample() == (300 * MIB, GIB)


def test_system_ignores_max_and_limits_above_the_host(tmp_path: Path) -> None:
    write(tmp_path / "proc", "0::/\n")
    write(tmp_path / "cg/memory.max", "max\n")
    write(tmp_path / "cg/memory.current", "5\n")
    assert SystemSource(tmp_path / "cg", tmp_path / "proc").sample()[1] == psutil.virtual_memory().total
    write(tmp_path / "cg/memory.max", f"{2**62}\n")
    assert SystemSource(tmp_path / "cg", tmp_path / "proc").sample()[1] == psutil.virtual_memory().total


def test_system_uses_a_v1_limit_mounted_without_namespace(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path; only the container's own group is mounted, at the root.
    write(tmp_path / "proc", "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    write(tmp_path / "cg/memory/memory.limit_in_bytes", f"{2 * GIB}\n")
    write(tmp_path / "cg/memory/memory.usage_in_bytes", f"{GIB}\n")
    write(tmp_path / "cg/memory/memory.stat", f"cache 9\ntotal_inactive_file {GIB // 4}\n")
    assert SystemSource(tmp_path / "cg", tmp_path / "proc").sample() == (3 * GIB // 4, 2 * GIB)


def test_system_v1_unlimited_is_host(tmp_path: Path) -> None:
    write(tmp_path / "proc", "4:memory:/\n")
    write(tmp_path / "cg/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path / "cg/memory/memory.usage_in_bytes", "5\n")
    assert SystemSource(tmp_path / "cg", tmp_path / "proc").sample()[1] == psutil.virtual_memory().total


def test_system_on_this_machine_is_sane() -> None:
    used, total = SystemSource().sample()
    assert 0 <= used <= total
    assert total > 0


def test_system_source_drives_the_scheduler_without_evicting() -> None:
    sched = PressureScheduler(
        make_source("system"), never_evict, enabled=True, high_watermark=1.0, low_watermark=0.5
    )
    sched.tick()
    assert sched.status()["available"] is True
    assert sched.status()["errors"] == []

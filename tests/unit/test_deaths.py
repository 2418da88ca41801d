"""How a dead daemon is told: the run record beside the socket, the cause read from its log, the sentence
the user sees; and the load-time decode check's verdicts over stand-in children (fast: no model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from barreld.deaths import Death, RunRecord, cause_of_death, find_death, record_path, remove_record
from barreld.engine import decodecheck
from barreld.engine.backend import ModelLoadError
from barreld.engine.decodecheck import DecodeCheck, cmake_args


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def record(tmp_path: Path, text: str, pid: int, *, earlier: str = "", watched: bool = False) -> RunRecord:
    log = tmp_path / "barreld.log"
    log.write_text(earlier + text)
    return RunRecord(pid, time.time(), str(log), len(earlier.encode()), watched)


def test_the_record_round_trips_beside_the_socket_and_a_clean_stop_removes_it(tmp_path: Path) -> None:
    sock = tmp_path / "barreld.sock"
    mine = RunRecord.of_this_process()
    mine.write(sock)
    assert record_path(sock).name == "barreld.sock.run"
    assert RunRecord.read(sock) == mine and mine.alive()
    assert find_death(sock, wait=0) is None  # it runs
    remove_record(sock)
    assert RunRecord.read(sock) is None and find_death(sock) is None
    record_path(sock).write_text("{not json")
    assert RunRecord.read(sock) is None


def test_a_reaped_pid_or_a_zombie_is_dead_and_a_reused_pid_is_not_the_recorded_process() -> None:
    assert not RunRecord(dead_pid(), time.time(), None, 0).alive()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(0.5)  # it has exited; not yet waited for
    assert not RunRecord(zombie.pid, time.time(), None, 0).alive()
    zombie.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        assert RunRecord(sleeper.pid, time.time(), None, 0).alive()
        assert not RunRecord(sleeper.pid, time.time() - 3600, None, 0).alive()  # started after the record
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(
    ("fatal", "name"),
    [("Illegal instruction", "SIGILL"), ("Segmentation fault", "SIGSEGV"), ("Aborted", "SIGABRT"),
     ("Bus error", "SIGBUS"), ("Floating point exception", "SIGFPE")],
)
def test_faulthandler_reports_name_the_signal(tmp_path: Path, fatal: str, name: str) -> None:
    rec = record(tmp_path, f"INFO ready\nFatal Python error: {fatal}\n\nThread 0x1 (most recent call first):\n", 4)
    assert cause_of_death(rec) == Death(4, name, rec.log)


def test_only_this_runs_part_of_the_log_and_this_pid_count(tmp_path: Path) -> None:
    earlier = "Fatal Python error: Segmentation fault\nbarreld.supervise: barreld[9] died of SIGKILL\n"
    rec = record(tmp_path, "barreld.supervise: barreld[8] died of SIGTERM\n", 9, earlier=earlier)
    assert cause_of_death(rec).signal is None
    rec = record(tmp_path, "Fatal Python error: Aborted\nbarreld.supervise: barreld[9] died of SIGABRT\n", 9)
    assert cause_of_death(rec).signal == "SIGABRT"


def test_the_sentence_names_signal_meaning_model_and_log() -> None:
    text = Death(12, "SIGILL", "/tmp/x.log", "smollm2").sentence()
    assert text.startswith("barreld (pid 12) died of SIGILL (illegal instruction: ")
    assert text.endswith('while running model smollm2; see README "Troubleshooting"; log: /tmp/x.log')
    silent = Death(12, None, None).sentence()
    assert "died without writing a cause" in silent and "SIGKILL" in silent and "journalctl" in silent


def test_a_watched_death_waits_for_the_watchers_line(tmp_path: Path) -> None:
    sock = tmp_path / "barreld.sock"
    rec = record(tmp_path, "", dead_pid(), watched=True)
    rec.write(sock)
    t0 = time.monotonic()
    assert find_death(sock, wait=0.3).signal is None and time.monotonic() - t0 >= 0.3
    Path(rec.log).write_text(f"barreld.supervise: barreld[{rec.pid}] died of SIGKILL (killed)\n")
    assert find_death(sock).signal == "SIGKILL"


def test_the_watcher_logs_a_signal_death_and_exits_with_its_status(tmp_path: Path) -> None:
    """barreld.supervise over a real barreld that is SIGKILLed once it answers."""
    sock = tmp_path / "s.sock"
    config = tmp_path / "cfg" / "barrel" / "barreld.toml"  # its own ram_file root: a user's daemon holds the default
    config.parent.mkdir(parents=True)
    config.write_text(f'[tiers.ram_file]\nroot = "{tmp_path / "shm"}"\n')
    env = {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "PATH": "/usr/bin"}
    with open(tmp_path / "log", "wb") as log:
        watcher = subprocess.Popen([sys.executable, "-m", "barreld.supervise", "--socket", str(sock)],
                                   stdout=log, stderr=log, env=env)
    deadline = time.monotonic() + 60
    while RunRecord.read(sock) is None:
        assert watcher.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
        time.sleep(0.05)
    rec = RunRecord.read(sock)
    assert rec.watched and rec.pid != watcher.pid and rec.log == str(tmp_path / "log")
    os.kill(rec.pid, signal.SIGKILL)
    assert watcher.wait(30) == 128 + signal.SIGKILL
    assert find_death(sock) == Death(rec.pid, "SIGKILL", rec.log)


def stand_in(monkeypatch: pytest.MonkeyPatch, code: str) -> list[Path]:
    """The check's child replaced by `python -c code`; returns the models it was run for."""
    ran: list[Path] = []

    def command(model: Path) -> list[str]:
        ran.append(model)
        return [sys.executable, "-c", code]

    monkeypatch.setattr(decodecheck, "child_command", command)
    return ran


def test_a_child_that_dies_after_loading_fails_the_load_with_the_rebuild_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    stand_in(monkeypatch, "import os, sys; sys.stdout.write('loaded\\n'); sys.stdout.flush(); os.abort()")
    check = DecodeCheck(tmp_path / "memo.json")
    with pytest.raises(ModelLoadError, match=r"cannot run on this CPU: .* died of SIGABRT .*CMAKE_ARGS="):
        check(model)
    stand_in(monkeypatch, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(ModelLoadError, match=rf"llama.cpp crashed reading {model} .*SIGSEGV"):
        check(model)
    assert not (tmp_path / "memo.json").exists()  # a failure is never remembered


def test_a_pass_is_remembered_until_the_model_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    ran = stand_in(monkeypatch, "print('loaded')")
    check = DecodeCheck(tmp_path / "cache" / "memo.json")
    check(model)
    check(model)
    assert len(ran) == 1
    model.write_bytes(b"GGUF and more")
    check(model)
    assert len(ran) == 2


def test_a_child_that_exits_with_an_error_leaves_the_verdict_to_the_real_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    ran = stand_in(monkeypatch, "raise SystemExit(3)")
    check = DecodeCheck(tmp_path / "memo.json")
    check(model)
    check(model)
    assert len(ran) == 2 and not (tmp_path / "memo.json").exists()


def test_cmake_args_enable_what_the_cpu_runs_and_nothing_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decodecheck.platform, "machine", lambda: "x86_64")
    amx = frozenset("avx avx2 fma f16c bmi2 avx512f avx512_vnni avx512_bf16 amx_tile amx_int8".split())
    assert cmake_args(amx) == "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    assert cmake_args(frozenset({"avx", "sse4_2"})) == (
        "-DGGML_NATIVE=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF"
    )
    monkeypatch.setattr(decodecheck.platform, "machine", lambda: "aarch64")
    assert cmake_args(amx) == "-DGGML_NATIVE=OFF"


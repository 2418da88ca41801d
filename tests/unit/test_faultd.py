"""The test entry point's hooks: flags parsed strictly, installed through barreld's seams, and a real
tier write failing with the named errno."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from barreld.cache import TierWriteError
from barreld.cache import tiers as tiers_mod
from barreld.cache.tiers import FileTier
from barreld.engine.model_cache import ModelCache
from tests.faultd import install, parse_check_death, parse_fault, parse_nth_decode


def test_fault_specs_name_a_tier_and_an_errno() -> None:
    assert parse_fault("disk:ENOSPC") == ("disk", errno.ENOSPC)
    assert parse_fault("ram") == ("ram", errno.EIO)
    for bad in ("floppy:EIO", "disk:ENOSUCH", "disk:errorcode", ":EIO", ""):
        with pytest.raises(ValueError):
            parse_fault(bad)


def test_death_specs_name_a_count_or_a_glob_and_a_signal() -> None:
    assert parse_nth_decode("5:SIGILL") == (5, signal.SIGILL)
    assert parse_check_death("SIGABRT:doomed*.gguf") == (signal.SIGABRT, "doomed*.gguf")
    for bad in ("0:SIGILL", "x:SIGILL", "5:SIGNOPE", "5"):
        with pytest.raises(ValueError):
            parse_nth_decode(bad)
    for bad in ("SIGILL", "SIGILL:", "ILL:x.gguf"):
        with pytest.raises(ValueError):
            parse_check_death(bad)


def test_a_bad_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        install(["--fault-write", "disk:NOPE"])
    assert e.value.code == 2 and "disk:NOPE" in capsys.readouterr().err


def test_hooks_go_in_through_the_seams_and_barreld_gets_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiers_mod, "fault_hook", None)
    monkeypatch.setattr(ModelCache, "drop_async_saves", False)
    rest = install(["--socket", "/x.sock", "--fault-write", "ram:EIO", "--drop-async-saves",
                    "--fault-write", "disk:ENOSPC", "--log-level", "debug"])
    assert rest == ["--socket", "/x.sock", "--log-level", "debug"]
    assert ModelCache.drop_async_saves is True
    disk = FileTier("disk", tmp_path / "disk", quota=1 << 20)
    with pytest.raises(TierWriteError) as e:
        disk.put("ab" * 32, [b"head", b"tail"])
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(disk.root) == [] and disk.used == 0  # the temp file is gone
    ram_file = FileTier("ram_file", tmp_path / "rf", quota=1 << 20)
    assert ram_file.put("cd" * 32, [b"head", b"tail"]) is not None  # other tiers write as ever


def test_without_flags_nothing_is_hooked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiers_mod, "fault_hook", None)
    monkeypatch.setattr(ModelCache, "drop_async_saves", True)
    assert install(["--config", "c.toml"]) == ["--config", "c.toml"]
    assert tiers_mod.fault_hook is None and ModelCache.drop_async_saves is False

"""The one flock helper every lock goes through (the data dir, the autostart race, the cache tiers, the test models)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from barreld.lifecycle import DataDirLock, StartupError
from barreld.paths import lock_file, locked


def test_a_held_lock_is_refused_without_waiting_and_free_once_closed(tmp_path: Path) -> None:
    path = tmp_path / "a.lock"
    with locked(path):
        assert lock_file(path, wait=False) is None
        assert os.stat(path).st_mode & 0o777 == 0o600
    again = lock_file(path, wait=False)
    assert again is not None
    os.close(again)


def test_a_second_daemon_on_a_data_dir_is_told_the_holders_pid(tmp_path: Path) -> None:
    first = DataDirLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(StartupError, match=rf"in use by barreld pid {os.getpid()};"):
            DataDirLock(tmp_path).acquire()
    finally:
        first.release()
    second = DataDirLock(tmp_path)
    second.acquire()
    second.release()

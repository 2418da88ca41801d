"""Part 3: a tier whose device fills up. The save is dropped and counted (saves_failed), the request
still succeeds, no partial file is published and no temp file is left, and saves succeed again once there
is space. A real small tmpfs when this process may mount one; the write-fault hook of the test entry
point (`python -m tests.faultd --fault-write TIER:ENOSPC`) for every tier either way. And the data dir
itself filling up: the LMDB index cannot commit, saves fail and are counted, and the model keeps serving."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from barrelctl.client import Completion
from tests.support.sandbox import Sandbox

from . import util
from .util import complete, counters, doc, rows

MAX_TOKENS = 8


def mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a tmpfs at path; None on success, else why not."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    path.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True, text=True
    )
    return None if p.returncode == 0 else f"mount -t tmpfs failed: {p.stderr.strip() or p.returncode}"


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def saved(s, key: str) -> bool:
    return key in {r.key for r in rows(s) if r.status == "available"}


def assert_save_failed_cleanly(w: Sandbox, s, reply: Completion, roots: dict[str, Path], failed_before: int) -> None:
    util.wait_for(lambda: counters(s)["saves_failed"] > failed_before, what="the failed save to be counted")
    assert reply.finish_reason == "length" and reply.completion_tokens == MAX_TOKENS  # the request went on
    assert not saved(s, reply.key)
    for root in roots.values():
        assert f"{reply.key}.kvc" not in os.listdir(root), "a partial checkpoint was published"
    util.assert_consistent(w, s, roots)


def test_a_full_tmpfs_drops_the_save_and_saves_resume_when_space_returns() -> None:
    with Sandbox.new() as w:
        mnt = w.base / "small"
        why = mount_tmpfs(mnt, "16m")
        if why:
            pytest.skip(f"no tmpfs to fill here ({why}); the write-fault hook test covers ENOSPC")
        try:
            root = mnt / "kvc"
            roots = {"disk": root, "ram_file": w.shm}
            w.write_config(util.ONE_SAVE_POLICY + f'\n[tiers.disk]\nroot = "{root}"\n' + util.model_config())
            proc = util.start(w)
            s = w.client()
            first = complete(s, doc(1, 190), MAX_TOKENS)  # ~5 MB checkpoint: fits
            util.wait_for(lambda: saved(s, first.key), what="the first save")
            filler = mnt / "filler"
            with open(filler, "wb") as f:  # leave about 1 MB
                for _ in range((free_bytes(mnt) - (1 << 20)) // (1 << 20)):
                    f.write(b"\0" * (1 << 20))
            assert free_bytes(mnt) < 2 << 20
            failed = counters(s)["saves_failed"]
            full = complete(s, doc(2, 190), MAX_TOKENS)
            assert_save_failed_cleanly(w, s, full, roots, failed)
            assert "No space left on device" in w.log_text()
            filler.unlink()  # space returns
            again = complete(s, doc(2, 190), MAX_TOKENS)
            assert again.text == full.text
            util.wait_for(lambda: saved(s, again.key), what="a save once space returned")
            later = complete(s, doc(3, 190), MAX_TOKENS)
            util.wait_for(lambda: saved(s, later.key), what="a later save")
            util.assert_consistent(w, s, roots)
            util.stop(w, proc)
        finally:
            w.stop_all()
            subprocess.run(["umount", str(mnt)], check=False)


def fill(mnt: Path) -> Path:
    """Take every free byte of a filesystem; the filler's path."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 16))
    except OSError:
        pass
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    os.close(fd)
    return filler


def test_a_full_data_dir_fails_saves_without_stopping_the_model() -> None:
    with Sandbox.new() as w:
        mnt = w.base / "idx"
        why = mount_tmpfs(mnt, "4m")
        if why:
            pytest.skip(f"no tmpfs to fill here ({why})")
        try:
            disk = w.base / "kvc"  # the disk tier elsewhere: only the index is short of space
            w.write_config(util.ONE_SAVE_POLICY + f'\n[tiers.disk]\nroot = "{disk}"\n' + util.model_config())
            roots = {"disk": disk, "ram_file": w.shm}
            proc = w.start_daemon("--data-dir", str(mnt / "data"), wait=False)
            w.wait_ready(proc)
            s = w.client()
            first = complete(s, doc(20, 190), MAX_TOKENS)
            util.wait_for(lambda: saved(s, first.key), what="the first save")
            filler = fill(mnt)
            failed = counters(s)["saves_failed"]
            # Each request's finish save fails in the index; the next one's evict save (sync) fails too.
            replies = [complete(s, doc(21 + i, 190), MAX_TOKENS, timeout=120) for i in range(3)]
            assert all(r.finish_reason == "length" for r in replies)
            util.wait_for(lambda: counters(s)["saves_failed"] >= failed + 3, what="failed saves to be counted")
            assert [r.key for r in rows(s)] == [first.key]
            again = complete(s, doc(20, 190), MAX_TOKENS)  # restores still work: reads need no space
            assert again.route == "exact" and again.text == first.text
            filler.unlink()
            later = complete(s, doc(30, 190), MAX_TOKENS)
            util.wait_for(lambda: saved(s, later.key), what="a save once space returned")
            util.assert_consistent(w, s, roots)
            util.stop(w, proc)
        finally:
            w.stop_all()
            subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("tier", ["disk", "ram_file", "ram"])
def test_write_fault_hook_drops_saves_and_a_restart_without_it_saves_again(tier: str) -> None:
    with Sandbox.new(util.ONE_SAVE_POLICY + util.model_config(tier=tier)) as w:
        roots = util.tier_roots(w)
        proc = util.start(w, "--fault-write", f"{tier}:ENOSPC", module="tests.faultd")
        s = w.client()
        failed = counters(s)["saves_failed"]
        full = complete(s, doc(10, 190), MAX_TOKENS)
        assert_save_failed_cleanly(w, s, full, roots, failed)
        # The live sequence is saved again at shutdown, and fails again: the daemon still stops cleanly.
        util.stop(w, proc)
        assert util.temp_files(*roots.values()) == []
        proc = util.start(w)
        s = w.client()
        assert rows(s) == []
        again = complete(s, doc(10, 190), MAX_TOKENS)
        assert again.route == "miss" and again.text == full.text
        util.wait_for(lambda: saved(s, again.key), what="a save once the fault is gone")
        assert counters(s)["saves_failed"] == 0
        util.assert_consistent(w, s)
        util.stop(w, proc)

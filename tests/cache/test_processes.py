"""Real separate processes: SIGKILL at random moments (acceptance 2), restarts (acceptance 3), and a kill
between a gc's commit and its file deletions."""

from __future__ import annotations

import dataclasses
import os
import random
import select
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from barreld.cache import CacheStore, StoreLocked

from . import child

CHILD = Path(child.__file__)
REPO = CHILD.parents[2]
KILLS = 120


def spawn(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(CHILD), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def wait_for_line(proc: subprocess.Popen[bytes], timeout: float = 30) -> bytes:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "child did not answer"
    return proc.stdout.readline()


def complete_lines(text: bytes) -> list[str]:
    """Lines the child finished writing (a kill can cut the last one)."""
    return text.decode().split("\n")[:-1]


@pytest.mark.faults  # 120 child processes killed: the fault run's job, not the fast one's
def test_sigkill_at_random_moments_leaves_a_consistent_cache(tmp_path: Path, shm_root: Path) -> None:
    data, rf_root = tmp_path / "data", shm_root / "rf"
    rng = random.Random(20261129)
    repairs: Counter[str] = Counter()
    durable_checked = 0
    for life in range(KILLS):
        proc = spawn("loop", str(data), str(rf_root), str(life))
        first = b""
        if rng.random() < 0.15:
            time.sleep(rng.uniform(0, 0.08))  # may land in start-up or in open()'s reconcile
        else:
            first = wait_for_line(proc)
            assert first == b"open\n", proc.stderr.read() if proc.stderr else first
            time.sleep(rng.uniform(0, 0.04))
        proc.kill()
        out, err = proc.communicate()
        assert proc.returncode == -9, err.decode()  # it was still running: we killed it
        lines = complete_lines(first + out)
        after_gc = lines[len(lines) - lines[::-1].index("gc") :] if "gc" in lines else lines
        acked = [bytes.fromhex(line.split()[2]) for line in after_gc if line.startswith("pub disk ")]

        with child.open_store(str(data), str(rf_root)) as store:
            assert store.last_reconcile is not None
            repairs.update({k: v for k, v in dataclasses.asdict(store.last_reconcile).items() if v})
            assert store.check() == [], f"life {life}"
            checked, bad = store.verify()
            assert bad == [], f"life {life}: rows failed verification"
            assert checked == len(store.dump())
            for root in (data / "kvc", rf_root):
                assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
            assert store.dump(tier="ram") == []
            for key in acked:  # an acknowledged sync save survives the kill
                assert store.lookup(key) is not None, f"life {life}: lost {key.hex()}"
            durable_checked += len(acked)
            used = store.stats()["tiers"]["disk"]["bytes"]
            if used > child.DISK_QUOTA * 0.4:
                store.evict_bytes(used - int(child.DISK_QUOTA * 0.4), ["disk"])
    print(
        f"\n{KILLS} kills; repairs at reopen: {dict(repairs)}; acknowledged saves checked: {durable_checked}"
    )
    assert durable_checked > 0
    # The kills landed inside publishes, not only between them.
    assert repairs["temps_removed"] + repairs["reservations_cleared"] > 0


def test_a_gc_killed_before_its_deletions_leaves_no_row_and_no_file(tmp_path: Path, shm_root: Path) -> None:
    """The rows were gone when the process died, their files not: the next open deletes those files (their
    gone marks say so) instead of adopting them back."""
    data, rf_root = tmp_path / "data", shm_root / "rf"
    proc = spawn("gcdie", str(data), str(rf_root), "10")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, err.decode()
    assert complete_lines(out) == ["gc"]
    assert len(list((data / "kvc").glob("*.kvc"))) == 9  # one deleted before the kill
    with child.open_store(str(data), str(rf_root)) as store:
        report = store.last_reconcile
        assert report is not None and (report.gone_deleted, report.adopted) == (9, 0)
        assert store.dump() == [] and store.check() == []
    assert list((data / "kvc").glob("*.kvc")) == []


@pytest.mark.parametrize("how", ["close", "exit"])
def test_file_rows_survive_a_restart_ram_rows_do_not(tmp_path: Path, shm_root: Path, how: str) -> None:
    data, rf_root = tmp_path / "data", shm_root / "rf"
    proc = spawn("save", str(data), str(rf_root), how)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    saved = {line.split()[0]: bytes.fromhex(line.split()[1]) for line in complete_lines(out)}
    assert set(saved) == {"ram", "ram_file", "disk"}

    with child.open_store(str(data), str(rf_root)) as store:
        assert store.last_reconcile is not None and store.last_reconcile.ram_rows_dropped == 1
        assert store.lookup(saved["ram"]) is None
        for tier in ("ram_file", "disk"):
            hit = store.lookup(saved[tier])
            assert hit is not None and hit.tier == tier
            with store.restore(hit) as got:
                assert got is not None and bytes(got.state) == tier.encode() * 1000
            prefix = store.lookup(child.SCHEME.key(f"restart {tier}".encode()[:-1]))
            assert prefix is not None and prefix.row_key == saved[tier]
        assert store.check() == []


def test_a_second_process_cannot_open_the_same_cache(tmp_path: Path, shm_root: Path) -> None:
    data, rf_root = tmp_path / "data", shm_root / "rf"
    proc = spawn("hold", str(data), str(rf_root))
    try:
        assert wait_for_line(proc) == b"open\n"
        with pytest.raises(StoreLocked):
            child.open_store(str(data), str(rf_root))
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    store: CacheStore = child.open_store(str(data), str(rf_root))
    store.close()

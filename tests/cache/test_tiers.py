"""Tiers: private files, crash-safe publish, quota before writing, injected faults leave nothing behind."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import psutil
import pytest

from barreld.cache import StoreLocked, TierWriteError
from barreld.cache import tiers as tiers_mod
from barreld.cache.tiers import FileTier, RamTier
from tests.faultd import write_fault

NAME = "ab" * 32
PARTS = [b"head", memoryview(b"payload" * 10), bytearray(b"tail")]
DATA = b"".join(bytes(p) for p in PARTS)


@pytest.fixture
def tier(shm_root: Path) -> FileTier:
    return FileTier("ram_file", shm_root / "rf", quota=1000)


def test_file_tier_is_private(tier: FileTier) -> None:
    location = tier.publish(NAME, PARTS, lambda: True)
    assert location == str(tier.root / f"{NAME}.kvc")
    assert stat.S_IMODE(tier.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(location).st_mode) == 0o600
    assert bytes(tier.read(location)) == DATA
    assert tier.scan() == {location: len(DATA)} and tier.used == len(DATA)


def test_existing_root_is_tightened(shm_root: Path) -> None:
    root = shm_root / "open"
    root.mkdir(mode=0o755)
    FileTier("disk", root, 10)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_lost_claim_publishes_nothing(tier: FileTier) -> None:
    assert tier.publish(NAME, PARTS, lambda: False) is None
    assert os.listdir(tier.root) == [] and tier.used == 0


def test_quota_is_checked_before_writing(tier: FileTier) -> None:
    with pytest.raises(TierWriteError) as e:
        tier.publish(NAME, [bytes(1001)], lambda: True)
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tier.root) == []


def test_ram_tier_quota_and_round_trip() -> None:
    ram = RamTier(quota=100)
    location = ram.put(NAME, PARTS)
    assert location is not None and bytes(ram.read(location)) == DATA
    with pytest.raises(TierWriteError):
        ram.put("other", [bytes(100 - len(DATA) + 1)])
    ram.delete(location)
    assert not ram.exists(location) and ram.used == 0
    ram.delete(location)  # already gone: fine


@pytest.mark.parametrize("how", ["faultd", "hook"])
def test_injected_write_fault_leaves_no_file(
    tier: FileTier, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    if how == "faultd":
        monkeypatch.setattr(tiers_mod, "fault_hook", write_fault({"disk": errno.EIO, "ram_file": errno.ENOSPC}))
    else:

        def hook(name: str) -> None:
            raise OSError(errno.EIO, "hooked")

        monkeypatch.setattr(tiers_mod, "fault_hook", hook)
    with pytest.raises(TierWriteError) as e:
        tier.publish(NAME, PARTS, lambda: True)
    assert e.value.errno == (errno.ENOSPC if how == "faultd" else errno.EIO)
    assert os.listdir(tier.root) == [] and tier.used == 0
    monkeypatch.setattr(tiers_mod, "fault_hook", None)
    assert tier.publish(NAME, PARTS, lambda: True) is not None


def test_injected_fault_in_ram_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiers_mod, "fault_hook", write_fault({"ram": errno.EIO}))
    ram = RamTier(quota=1000)
    with pytest.raises(TierWriteError):
        ram.put(NAME, PARTS)
    assert ram.scan() == {} and ram.used == 0


def test_temps_found_at_open_are_cleaned(tier: FileTier) -> None:
    (tier.root / ".tmp-1-abc").write_bytes(b"x")
    (tier.root / "README").write_bytes(b"not ours")
    assert len(tier.temps()) == 1
    assert tier.cleanup_temps() == 0  # appeared after this tier opened: a live writer's, left alone
    reopened = FileTier(tier.name, tier.root, tier.quota)  # the scan at open finds it
    (tier.root / ".tmp-2-live").write_bytes(b"y")
    assert reopened.cleanup_temps() == 1
    assert [p.name for p in reopened.temps()] == [".tmp-2-live"] and reopened.scan() == {}
    assert (tier.root / "README").exists()  # foreign files are left alone


def test_locations_outside_the_tier_are_refused(tier: FileTier, tmp_path: Path) -> None:
    outside = tmp_path / f"{NAME}.kvc"
    outside.write_bytes(b"x")
    with pytest.raises(ValueError):
        tier.delete(str(outside))
    assert outside.exists()


def test_root_lock_is_exclusive(tier: FileTier, shm_root: Path) -> None:
    tier.lock()
    other = FileTier("ram_file", shm_root / "rf", quota=1000)
    with pytest.raises(StoreLocked):
        other.lock()
    tier.unlock()
    other.lock()
    other.unlock()


def test_deleting_a_ram_payload_returns_memory() -> None:
    proc = psutil.Process()
    ram = RamTier(quota=1 << 30)
    size = 64 << 20
    location = ram.put(NAME, [bytes(1), memoryview(bytearray(b"\x01" * size))])
    assert location is not None
    high = proc.memory_info().rss
    ram.delete(location)
    assert high - proc.memory_info().rss > size // 2


def test_ram_payload_outlives_delete_while_viewed() -> None:
    ram = RamTier(quota=1000)
    location = ram.put(NAME, PARTS)
    assert location is not None
    view = ram.read(location)
    ram.delete(location)  # must not raise although a view is exported
    assert bytes(view) == DATA and ram.used == 0

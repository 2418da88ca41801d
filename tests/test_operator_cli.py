"""The operator's surface through real processes: cache commands against a daemon with saved rows,
SIZE and tier errors, bad config files refused at start, and the systemd readiness notification.

One daemon serves the module: three models on the bundled GGUF, one per tier, with a small save policy
so each ~520-token prompt saves a cold and a finish checkpoint, and the finish supersedes the cold one: two
prompts per model leave two rows per tier. Tests run in file order and share its
cache: the dump and stats tests read it, then verify, evict-bytes and gc take rows away.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from barreld.names import TIER_NAMES
from tests.support.sandbox import Run, Sandbox
from tests.test_cache_paths import POLICY, doc

needs_model = pytest.mark.model   # the rest run barreld without loading a model

MODEL_TIER = {"d": "disk", "f": "ram_file", "r": "ram"}
QUOTA = {"ram": 1 << 30, "ram_file": 512 << 20, "disk": 2 << 30}
ROW_FIELDS = {
    "key": str,
    "model": str,
    "tier": str,
    "size": int,
    "tokens": int,
    "text_bytes": int,
    "save_reason": str,
    "memory": str,
    "frontier": int,
    "status": str,
    "refcount": int,
    "hits": int,
    "last_used": float,
    "created": float,
    "location": (str, type(None)),
    "blocks": int,  # blocks of KV the row names (0: its file holds the whole state)
    "own_bytes": int,  # its file and the blocks no other row names
    "shared_bytes": int,  # the blocks it shares with other rows
    "tenant": str,  # who stored it ("": the default tenant)
    "namespace": str,  # its namespace digest's first 8 bytes, hex ("": the default namespace)
}
CONTRACT_COUNTERS = (
    "hits_exact hits_resume hits_longest_prefix hits_live misses saves_cold saves_continued saves_finish "
    "saves_evict saves_shutdown saves_dropped evictions corrupt_files longest_prefix_probes "
    "lookup_ns restore_ns save_ns"
).split()


def _bundled() -> str:
    from barreld.engine.registry import bundled_model_path

    return str(bundled_model_path("smollm2"))


def _config() -> str:
    # Sandbox.write_config opens the file with `[tiers.ram_file]` and its private root: the quota joins it.
    models = "".join(
        f'\n[[models]]\nname = "{name}"\npath = "{_bundled()}"\ntier = "{tier}"\n' for name, tier in MODEL_TIER.items()
    )
    return (
        f"quota = {QUOTA['ram_file']}\n[tiers.ram]\nquota = \"1G\"\n[tiers.disk]\nquota = \"2GiB\"\n"
        + POLICY
        + models
    )


def ok(run: Run) -> Run:
    assert run.rc == 0, (run.rc, run.err)
    return run


def dump(w: Sandbox, *args: str) -> list[dict]:
    return ok(w.ctl("--json", "cache", "dump", *args)).json()["rows"]


def complete(w: Sandbox, model: str, i: int) -> dict:
    r = ok(w.ctl("--json", "complete", "-", "--model", model, "--max-tokens", "8", input=doc(i, 520).encode()))
    return r.json()


def settle(w: Sandbox, keys: list[str], timeout: float = 30) -> list[dict]:
    """The dump once every finish checkpoint in `keys` is indexed and no save is still in flight."""
    deadline = time.monotonic() + timeout
    while True:
        rows = dump(w)
        present = {r["key"] for r in rows}
        settled = all(r["status"] == "available" and r["save_reason"] != "cold" for r in rows)
        if set(keys) <= present and settled:  # every cold capture superseded by its prompt's finish
            return rows
        assert time.monotonic() < deadline, f"saves did not settle: {rows}"
        time.sleep(0.2)


def stats(w: Sandbox) -> dict:
    return ok(w.ctl("--json", "cache", "stats")).json()


def stored(doc: dict) -> int:
    """Bytes stored in every tier: rows' files and their blocks, each block once."""
    return sum(t["bytes"] for t in doc["tiers"].values())


def one_line(run: Run) -> str:
    lines = run.err.strip().splitlines()
    assert len(lines) == 1, run.err
    assert "Traceback" not in run.err
    return lines[0]


@pytest.fixture(scope="module")
def ops():
    with Sandbox.new(_config()) as w:
        w.start_daemon()
        keys = [complete(w, model, i + k)["key"] for i, model in enumerate(MODEL_TIER) for k in (0, 3)]
        w.finish_keys = keys
        settle(w, keys)
        yield w


# ---- dump and stats -------------------------------------------------------------------------------


@needs_model
def test_dump_json_lists_every_row_with_every_contract_field(ops: Sandbox) -> None:
    rows = dump(ops)
    assert {r["key"] for r in rows} >= set(ops.finish_keys)
    assert {r["tier"] for r in rows} == set(TIER_NAMES)
    now = time.time()
    for r in rows:
        assert set(r) == set(ROW_FIELDS), r
        for field, kind in ROW_FIELDS.items():
            assert isinstance(r[field], kind), (field, r)
        assert len(r["key"]) == 64 and int(r["key"], 16) >= 0
        assert r["tier"] == MODEL_TIER[r["model"]]
        assert r["save_reason"] == "finish" and r["status"] == "available"
        assert r["size"] > 0 and r["tokens"] > 0 and r["text_bytes"] > 0
        assert r["refcount"] >= 0 and r["hits"] >= 0
        assert now - 300 < r["created"] <= r["last_used"] + 1e-3 <= now + 1
        if r["tier"] == "ram":
            assert r["location"] is None
        else:
            assert Path(r["location"]).is_file() and Path(r["location"]).stat().st_size == r["size"]
    assert sorted(r["model"] for r in rows) == sorted([*MODEL_TIER, *MODEL_TIER])
    last_used = [r["last_used"] for r in rows]
    assert last_used == sorted(last_used, reverse=True)   # most recently used first


@needs_model
def test_dump_filters_by_model_and_tier(ops: Sandbox) -> None:
    rows = dump(ops)
    assert dump(ops, "--model", "f") == [r for r in rows if r["model"] == "f"] != []
    by_tier = ok(ops.ctl("cache", "dump", "--tier", "disk", "--json")).json()["rows"]   # --json after the command
    assert by_tier == [r for r in rows if r["tier"] == "disk"] != []
    assert dump(ops, "--model", "d", "--tier", "ram") == []


@needs_model
def test_dump_human_table(ops: Sandbox) -> None:
    rows = dump(ops)
    wide = ok(ops.ctl("cache", "dump", COLUMNS="200")).out
    assert f"{len(rows)} rows" in wide
    for heading in ("key", "model", "memory", "tier", "own", "shared", "tokens", "reason", "refs", "hits", "last used"):
        assert heading in wide
    for r in rows:
        assert r["key"][:12] in wide
    assert "MiB" in wide and "ago" in wide
    narrow = ok(ops.ctl("cache", "dump", COLUMNS="80")).out
    assert max(len(line) for line in narrow.splitlines()) <= 80


@needs_model
def test_stats_counts_and_per_tier_bytes_against_quota(ops: Sandbox) -> None:
    rows = dump(ops)
    doc_ = ok(ops.ctl("--json", "cache", "stats")).json()
    assert set(doc_) == {"counters", "tiers", "redis"} and doc_["redis"] is None  # no [tiers.redis] here
    counters = doc_["counters"]
    for name in CONTRACT_COUNTERS:
        assert isinstance(counters[name], int), name
    assert counters["saves_cold"] >= 6 and counters["saves_finish"] >= 6
    assert counters["superseded"] == counters["saves_cold"]  # each cold capture, once its finish was saved
    assert counters["misses"] >= 1 and counters["save_ns"] > 0 and counters["lookup_ns"] > 0
    assert set(doc_["tiers"]) == set(TIER_NAMES)
    for tier in TIER_NAMES:
        t = doc_["tiers"][tier]
        assert set(t) == {"bytes", "quota", "rows", "stored_bytes", "logical_bytes", "dedup_ratio"}
        assert t["quota"] == QUOTA[tier] and t["stored_bytes"] == t["bytes"]
        mine = [r for r in rows if r["tier"] == tier]
        assert t["logical_bytes"] == sum(r["own_bytes"] + r["shared_bytes"] for r in mine)  # as if none shared
        assert t["logical_bytes"] >= t["bytes"] >= sum(r["own_bytes"] for r in mine) > 0  # a shared block once
        assert t["dedup_ratio"] == pytest.approx(t["logical_bytes"] / t["bytes"])
        assert t["rows"] == sum(1 for r in rows if r["tier"] == tier) >= 2
    human = ok(ops.ctl("cache", "stats", COLUMNS="120")).out
    for word in ("tiers", "quota", "used", *TIER_NAMES, "1.0 GiB", "512.0 MiB", "2.0 GiB", "%", "saves_finish", "ms"):
        assert word in human, word


# ---- verify, evict-bytes, gc ----------------------------------------------------------------------


@needs_model
def test_verify_reports_and_drops_a_corrupted_file(ops: Sandbox) -> None:
    clean = ok(ops.ctl("--json", "cache", "verify")).json()
    rows = dump(ops)
    assert clean == {"checked": len(rows), "bad": []}
    assert "0 bad" in ok(ops.ctl("cache", "verify")).out
    victim = next(r for r in rows if r["tier"] == "disk")
    with open(victim["location"], "r+b") as f:
        f.seek(victim["size"] // 2)
        byte = f.read(1)
        f.seek(victim["size"] // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    before = ok(ops.ctl("--json", "cache", "stats")).json()["counters"]["corrupt_files"]
    result = ok(ops.ctl("--json", "cache", "verify")).json()
    assert result == {"checked": len(rows), "bad": [victim["key"]]}
    after = dump(ops)
    assert victim["key"] not in {r["key"] for r in after}
    assert len(after) == len(rows) - 1
    assert not Path(victim["location"]).exists()
    assert ok(ops.ctl("--json", "cache", "stats")).json()["counters"]["corrupt_files"] == before + 1
    assert ok(ops.ctl("--json", "cache", "verify")).json() == {"checked": len(after), "bad": []}


@needs_model
def test_evict_bytes_1k_from_disk_frees_its_least_recently_used_row(ops: Sandbox) -> None:
    before, before_stats = dump(ops), stats(ops)
    disk = [r for r in before if r["tier"] == "disk" and r["refcount"] == 0]
    assert disk
    lru = min(disk, key=lambda r: r["last_used"])
    reply = ok(ops.ctl("--json", "cache", "evict-bytes", "1K", "--tier", "disk")).json()
    after = dump(ops)
    assert reply == {"evicted": 1, "bytes_freed": lru["own_bytes"]}  # its blocks go unless another row names them
    assert stored(before_stats) - stored(stats(ops)) == reply["bytes_freed"]
    assert [r["key"] for r in after] == [r["key"] for r in before if r["key"] != lru["key"]]
    assert not Path(lru["location"]).exists()
    for r in after:
        if r["location"]:
            assert Path(r["location"]).is_file()


@needs_model
def test_evict_bytes_256m_frees_what_it_says_across_tiers(ops: Sandbox) -> None:
    before, total = dump(ops), stored(stats(ops))
    assert 0 < total < 256 << 20   # less than asked for: it frees every unheld row
    reply = ok(ops.ctl("--json", "cache", "evict-bytes", "256M")).json()
    after = dump(ops)
    gone = [r for r in before if r["key"] not in {a["key"] for a in after}]
    assert reply == {"evicted": len(gone), "bytes_freed": total - stored(stats(ops))}
    assert reply["bytes_freed"] >= sum(r["own_bytes"] for r in gone)
    assert all(r["refcount"] > 0 for r in after)
    assert {r["tier"] for r in gone} == {r["tier"] for r in before} == {"ram", "ram_file"}   # disk: emptied above
    for r in gone:
        if r["location"]:
            assert not Path(r["location"]).exists()
    assert stored(stats(ops)) <= sum(r["own_bytes"] + r["shared_bytes"] for r in after)
    human = ok(ops.ctl("cache", "evict-bytes", "1K")).out
    assert "evicted" in human and "freed" in human


@needs_model
def test_gc_evicts_every_unreferenced_row(ops: Sandbox) -> None:
    before = settle(ops, [complete(ops, "f", 5)["key"]])
    unreferenced = [r for r in before if r["refcount"] == 0]
    assert len(unreferenced) >= 2
    reply = ok(ops.ctl("--json", "cache", "gc")).json()
    assert reply == {"evicted": len(unreferenced)}
    after = dump(ops)
    assert not [r for r in after if r["refcount"] == 0]
    for r in unreferenced:
        if r["location"]:
            assert not Path(r["location"]).exists()
    assert ok(ops.ctl("cache", "gc")).out.strip() == "evicted 0 rows"


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("cache", "evict-bytes", "12Q"), "12Q"),
        (("cache", "evict-bytes", "1.5G"), "1.5G"),
        (("cache", "evict-bytes", "256MBB"), "256MBB"),
        (("cache", "evict-bytes", "G"), "'G'"),
        (("cache", "evict-bytes", ""), "''"),
        (("cache", "evict-bytes", "99999999T"), "99999999T"),
        (("cache", "evict-bytes", "--", "-5"), "-5"),
        (("cache", "evict-bytes", "1K", "--tier", "floppy"), "floppy"),
        (("cache", "evict-bytes", "1K", "--tier", "disk", "--tier", "RAM"), "RAM"),
        (("cache", "dump", "--tier", "tape"), "tape"),
        (("load", "m", "--n-threads", "0"), "--n-threads 0"),
        (("load", "m", "--n-gpu-layers", "-2"), "--n-gpu-layers -2"),
        (("load", "m", "--type-k", "q3_k"), "--type-k 'q3_k'"),
        (("load", "m", "--type-v", "q4_0", "--no-flash-attn"),
         "--type-v 'q4_0': a quantised V cache needs --flash-attn"),
    ],
)
def test_bad_size_or_tier_exits_2_naming_the_value(world: Sandbox, args, needle) -> None:
    """Checked before any daemon is asked: with no daemon and no autostart it is still 2, not 3."""
    r = world.ctl("--no-autostart", *args)
    assert r.rc == 2, (r.rc, r.err)
    assert needle in one_line(r)
    assert world.daemon_pids() == []


def test_evict_bytes_needs_a_size(world: Sandbox) -> None:
    r = world.ctl("--no-autostart", "cache", "evict-bytes")
    assert r.rc == 2 and "size" in one_line(r).lower()


# ---- bad config files -----------------------------------------------------------------------------


def _drop_dac_override() -> list[str] | None:
    """A prefix that runs a command as root without CAP_DAC_OVERRIDE, so file modes bind it; None if
    that cannot be done here."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    probe = subprocess.run([*prefix, "true"], capture_output=True)
    return prefix if probe.returncode == 0 else None


BAD_CONFIGS = [
    ("unknown-key", '[tiers.ram]\nquotas = "1G"\n', "tiers.ram.quotas", "unknown key"),
    ("unknown-table", "[caches]\nsize = 1\n", "caches", "unknown key"),
    ("block-tokens-not-dividing-align", "[cache]\nblock_tokens = 384\n", "cache.block_tokens", "does not divide"),
    ("unknown-policy-key", "[policy]\nmin_tokenz = 5\n", "policy.min_tokenz", "unknown policy key"),
    ("negative-quota", "[tiers.disk]\nquota = -1\n", "tiers.disk.quota", "negative"),
    ("negative-quota-string", '[tiers.ram]\nquota = "-2G"\n', "tiers.ram.quota", "-2G"),
    ("low-above-high", "[scheduler]\nhigh_watermark = 0.5\nlow_watermark = 0.6\n", "scheduler.low_watermark",
     "below"),
    ("low-equals-high", "[scheduler]\nhigh_watermark = 0.7\nlow_watermark = 0.7\n", "scheduler.low_watermark",
     "below"),
    ("unknown-tier-table", '[tiers.floppy]\nquota = "1G"\n', "tiers.floppy", "unknown key"),
    ("unknown-evict-tier", '[scheduler]\nevict_tiers = ["ram", "floppy"]\n', "scheduler.evict_tiers", "floppy"),
    ("unknown-model-tier", '[[models]]\nname = "smollm2"\ntier = "floppy"\n', "models[0].tier", "floppy"),
    ("unreadable-root", "[tiers.disk]\nroot = '{locked}'\n", "tiers.disk.root", "not readable, writable"),
    ("root-is-a-file", "[tiers.disk]\nroot = '{afile}'\n", "tiers.disk.root", "not a directory"),
    ("toml-syntax", "[policy\nmin_tokens = 1\n", "line 1, column 8", "TOML syntax error"),
    ("zero-threads", '[[models]]\nname = "smollm2"\nn_threads = 0\n', "models[0].n_threads", ">= 1"),
    ("gpu-layers", '[[models]]\nname = "smollm2"\nn_gpu_layers = -2\n', "models[0].n_gpu_layers", ">= -1"),
    ("cache-type", '[[models]]\nname = "smollm2"\ntype_k = "fp8"\n', "models[0].type_k", "unknown cache type"),
    ("quantised-v", '[[models]]\nname = "smollm2"\nflash_attn = false\ntype_v = "q4_0"\n', "models[0].type_v",
     "flash_attn = true"),
]


@pytest.mark.parametrize(("name", "body", "key", "problem"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_stops_barreld_with_exit_1_naming_the_key(
    tmp_path: Path, name: str, body: str, key: str, problem: str
) -> None:
    prefix: list[str] = []
    locked = tmp_path / "locked"
    locked.mkdir(mode=0)
    locked.chmod(0)
    if name == "unreadable-root" and os.geteuid() == 0:
        prefix = _drop_dac_override() or pytest.skip("root here, and no setpriv to drop CAP_DAC_OVERRIDE")
    (tmp_path / "afile").write_text("not a directory\n")
    config = tmp_path / "bad.toml"
    config.write_text(body.format(locked=locked, afile=tmp_path / "afile"))
    sock = tmp_path / "run" / "barreld.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BARREL_", "XDG_"))}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), XDG_DATA_HOME=str(tmp_path / "data"),
               XDG_RUNTIME_DIR=str(tmp_path / "run"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    try:
        p = subprocess.run(
            [*prefix, sys.executable, "-m", "barreld", "--config", str(config), "--socket", str(sock)],
            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
        )
    finally:
        locked.chmod(0o700)
    assert p.returncode == 1, (p.returncode, p.stderr)
    line = one_line(Run(p.returncode, p.stdout, p.stderr))
    assert line.startswith(f"barreld: {config}: {key}: "), line
    assert problem in line, line
    assert not sock.exists()
    assert not (tmp_path / "data" / "barrel" / "index.lmdb").exists()   # it never got as far as the cache


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    p = subprocess.run([sys.executable, "-m", "barreld", "--config", str(missing), "--socket",
                        str(tmp_path / "s.sock"), "--data-dir", str(tmp_path / "data")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    line = one_line(Run(p.returncode, p.stdout, p.stderr))
    assert str(missing) in line and "cannot read" in line


# ---- systemd readiness ----------------------------------------------------------------------------


@pytest.mark.slow
def test_ready_is_notified_once_the_socket_answers(world: Sandbox) -> None:
    """Type=notify in the unit relies on this: READY=1 on $NOTIFY_SOCKET after the socket is up."""
    notify = world.base / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind(str(notify))
        sink.settimeout(60)
        with open(world.log, "ab") as log:
            p = subprocess.Popen([sys.executable, "-m", "barreld", "--socket", str(world.socket)],
                                 env=world.env(NOTIFY_SOCKET=str(notify)), stdout=log, stderr=log)
        world.procs.append(p)
        try:
            message = sink.recv(4096).decode()
        except TimeoutError:
            raise AssertionError(f"no READY=1 within 60 s:\n{world.log_text()}") from None
    assert "READY=1" in message.split("\n")
    assert world.socket.exists()
    status = world.ctl("--no-autostart", "--json", "daemon", "status")
    assert status.rc == 0 and status.json()["pid"] == p.pid
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0
    with contextlib.suppress(FileNotFoundError):
        notify.unlink()
    assert not world.socket.exists()

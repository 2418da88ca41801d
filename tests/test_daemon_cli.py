"""The first whole path, end to end: real barrelctl and barreld processes, the real socket and model."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.sandbox import Sandbox
from tests.test_cache_paths import POLICY

pytestmark = pytest.mark.model


def test_autostart_streams_a_reply_and_leaves_the_daemon_running(world: Sandbox) -> None:
    r = world.ctl("complete", "Why is the sky blue?", "--max-tokens", "24")
    assert r.rc == 0, r.err
    assert len(r.out.strip()) > 10
    pids = world.daemon_pids()
    assert len(pids) == 1
    s = world.ctl("daemon", "status", "--json")
    assert s.rc == 0, s.err
    doc = s.json()
    assert doc["pid"] == pids[0]
    assert doc["socket"] == str(world.socket)
    assert doc["data_dir"] == str(world.data_dir)
    assert doc["version"]
    human = world.ctl("daemon", "status")
    assert str(pids[0]) in human.out and "data dir" in human.out


def test_five_racing_autostarts_end_with_one_daemon(world: Sandbox) -> None:
    def one(i: int):
        return world.ctl("complete", f"Count to {i}:", "--max-tokens", "8")

    with ThreadPoolExecutor(5) as pool:
        runs = list(pool.map(one, range(5)))
    assert [r.rc for r in runs] == [0] * 5, [r.err for r in runs]
    assert all(r.out.strip() for r in runs)
    assert len(world.daemon_pids()) == 1


def test_greedy_is_deterministic_and_json_has_the_contract_shape(served: Sandbox) -> None:
    args = ("complete", "Write one sentence about the sea.", "--max-tokens", "20", "--temperature", "0")
    a, b = served.ctl(*args), served.ctl(*args)
    assert a.rc == b.rc == 0
    assert a.out == b.out
    j = served.ctl("--json", *args)
    assert j.rc == 0, j.err
    doc = j.json()
    assert set(doc) == {"text", "model", "finish_reason", "key", "prompt_key", "cache", "tokens", "timings_ms"}
    assert doc["text"] == a.out.rstrip("\n")
    assert doc["model"] == "smollm2"
    assert doc["finish_reason"] in ("stop", "length")
    assert len(doc["key"]) == 64 and len(doc["prompt_key"]) == 64
    assert set(doc["cache"]) - {"divergence"} == {"path", "restored_tokens", "prefilled_tokens", "tier"}
    assert doc["cache"]["path"] in ("miss", "live", "exact", "resume", "longest_prefix")
    assert doc["tokens"]["prompt"] == doc["cache"]["restored_tokens"] + doc["cache"]["prefilled_tokens"]
    assert doc["tokens"]["completion"] >= 1
    t = doc["timings_ms"]
    assert set(t) == {"lookup", "restore", "prefill", "ttft", "total"}
    assert 0 < t["ttft"] <= t["total"]
    # --json after the command works as well as before it.
    assert served.ctl(*args, "--json").json()["text"] == doc["text"]


def test_json_says_where_a_missed_prompt_stopped_matching_the_held_text(served: Sandbox) -> None:
    head = "Meeting notes, written at 09:14 by the harbour master, say that "
    body = "the river rose over the stone garden wall and the lantern by the window went out. " * 3
    assert served.ctl("complete", head + body, "--max-tokens", "2").rc == 0
    moved = served.ctl("--json", "complete", head.replace("09:14", "09:15") + body, "--max-tokens", "2")
    assert moved.rc == 0, moved.err
    cache = moved.json()["cache"]
    d = cache["divergence"]
    assert d["cached"].startswith("4 by the harbour") and d["prompt"].startswith("5 by the harbour"), d
    assert head.index("4 by") <= d["matched_bytes"] <= head.index("4 by") + 8  # BOS's text may come first
    assert d["matched_tokens"] > 0 and cache["restored_tokens"] <= d["matched_tokens"]


def test_cache_explain_names_the_stored_row_a_prompt_left_after_a_restart_and_runs_nothing() -> None:
    with Sandbox.new(POLICY) as world:
        explain_after_a_restart(world)


def explain_after_a_restart(world: Sandbox) -> None:
    head = "Meeting notes, written at 10:42 by the lock keeper, say that "
    body = "the barges waited below the weir while the silver morning letter was read aloud. " * 24
    proc = world.start_daemon()
    assert world.ctl("complete", head + body, "--max-tokens", "2").rc == 0
    assert world.stop(proc) == 0
    world.start_daemon()  # no live sequence: only the stored rows can say where a prompt left them
    rows = {r["key"] for r in world.ctl("--json", "cache", "dump").json()["rows"]}
    before = world.ctl("--json", "cache", "stats").json()["counters"]
    moved = world.data_dir.parent / "moved.txt"
    moved.write_text(head.replace("10:42", "10:43") + body)
    doc = world.ctl("--json", "cache", "explain", str(moved)).json()
    d, cache = doc["cache"]["divergence"], doc["cache"]
    assert d["against"] in rows and d["cached"].startswith("2 by the lock") and d["prompt"].startswith("3 by the lock")
    assert cache["restored_tokens"] <= d["matched_tokens"] < doc["tokens"]["prompt"]
    assert cache["restored_tokens"] + cache["prefilled_tokens"] == doc["tokens"]["prompt"]
    human = world.ctl("cache", "explain", "-", input=moved.read_bytes())
    assert human.rc == 0 and f"row {d['against'][:12]}" in human.out and "would prefill" in human.out, human.out
    after = world.ctl("--json", "cache", "stats").json()["counters"]
    assert {r["key"] for r in world.ctl("--json", "cache", "dump").json()["rows"]} == rows  # nothing ran or saved
    assert [after[k] - before[k] for k in ("misses", "hits_exact", "hits_longest_prefix", "saves_cold")] == [0] * 4
    same = world.data_dir.parent / "same.txt"
    same.write_text(head + body)
    again = world.ctl("--json", "cache", "explain", str(same)).json()["cache"]
    assert again["path"] == "exact" and again["prefilled_tokens"] == 0 and "divergence" not in again
    assert world.ctl("cache", "explain", str(world.data_dir.parent / "absent.txt")).rc == 2


def test_seeded_sampling_repeats_and_chat_uses_the_template(served: Sandbox) -> None:
    args = ("complete", "Name a colour.", "--max-tokens", "12", "--temperature", "0.9", "--seed", "7", "--json")
    assert served.ctl(*args).json()["text"] == served.ctl(*args).json()["text"]
    wide = (*args[:-2], str(2**64 - 1), "--json")  # the seed range every route takes, the CLI's too
    assert served.ctl(*wide).json()["text"] == served.ctl(*wide).json()["text"]
    beyond = served.ctl(*args[:-2], str(2**64), "--json")
    assert beyond.rc == 2 and f"expected 0..{2**64 - 1}" in beyond.err
    chat = served.ctl("--json", "complete", "--chat", "What is 2+2?", "--max-tokens", "16").json()
    plain = served.ctl("--json", "complete", "What is 2+2?", "--max-tokens", "16").json()
    assert chat["tokens"]["prompt"] > plain["tokens"]["prompt"] + 10   # the template's system and role markers


def test_stop_string_and_stdin_prompt(served: Sandbox) -> None:
    r = served.ctl("--json", "complete", "-", "--max-tokens", "40", "--stop", ",", "--stop", ".",
                   input=b"List three fruits: apples")
    doc = r.json()
    assert doc["finish_reason"] == "stop" or doc["tokens"]["completion"] == 40
    assert "," not in doc["text"] and "." not in doc["text"]


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("complete", "hi", "--model", "nosuch"), 1, "unknown model"),
        (("load", "m1", "--path", "/nonexistent/model.gguf"), 1, "not found"),
        (("complete", "hi", "--max-tokens", "-1"), 2, "max-tokens"),
        (("complete", "hi", "--bogus-option"), 2, "bogus"),
        (("load", "m2", "--tier", "floppy"), 2, "tier"),
        (("load", "m3", "--n-ctx", "0"), 2, "n-ctx"),
    ],
)
def test_bad_input_is_one_line_with_the_contract_code(served: Sandbox, args, code, needle) -> None:
    r = served.ctl(*args)
    assert r.rc == code, (r.rc, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert needle in lines[0].lower()
    assert "Traceback" not in r.err
    assert served.ctl("complete", "Still there?", "--max-tokens", "4").rc == 0


def test_random_bytes_gguf_and_overlong_prompt_are_refused(served: Sandbox, tmp_path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    r = served.ctl("load", "junk", "--path", str(junk))
    assert r.rc == 1 and len(r.err.strip().splitlines()) == 1, r.err
    assert "gguf" in r.err.lower()
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + os.urandom(4096))
    r = served.ctl("load", "fake", "--path", str(fake))
    assert r.rc == 1 and len(r.err.strip().splitlines()) == 1, r.err
    long_prompt = ("word " * 5000).encode()
    r = served.ctl("complete", "-", "--max-tokens", "4", input=long_prompt)
    assert r.rc == 2, r.err
    assert "context" in r.err and len(r.err.strip().splitlines()) == 1
    assert served.ctl("complete", "ok?", "--max-tokens", "4").rc == 0


def test_no_autostart_without_daemon_exits_3(world: Sandbox) -> None:
    r = world.ctl("--no-autostart", "complete", "hi")
    assert r.rc == 3
    assert len(r.err.strip().splitlines()) == 1
    assert world.daemon_pids() == []
    assert world.ctl("--no-autostart", "daemon", "status").rc == 3


def test_socket_is_private_and_a_second_daemon_is_refused(served: Sandbox) -> None:
    st = served.socket.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(served.socket.parent.stat().st_mode) == 0o700
    other = served.base / "other.sock"
    p = subprocess.run([sys.executable, "-m", "barreld", "--socket", str(other)], env=served.env(),
                       capture_output=True, timeout=60)
    assert p.returncode == 1
    pid = served.daemon_pids()[0]
    assert f"pid {pid}" in p.stderr.decode()
    assert len(p.stderr.decode().strip().splitlines()) == 1


@pytest.mark.serial
def test_ctrl_c_mid_stream_cancels_in_the_daemon(served: Sandbox) -> None:
    proc = served.ctl_popen("complete", "Write a very long story about a dragon.", "--max-tokens", "2000")
    first = proc.stdout.read(20)
    assert first
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    assert proc.returncode == 130
    deadline = time.monotonic() + 10
    while "cancelled by its client" not in served.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "cancelled by its client" in served.log_text()
    model = served.ctl("--json", "models").json()["models"][0]
    assert (model["running"], model["queued"]) == (0, 0)   # the story no longer holds the sequence
    r = served.ctl("--json", "complete", "Quick one.", "--max-tokens", "4")
    assert r.rc == 0
    assert r.json()["tokens"]["completion"] >= 1


def test_sigterm_exits_0_and_removes_the_socket(world: Sandbox) -> None:
    p = world.start_daemon()
    assert world.ctl("complete", "hello", "--max-tokens", "4").rc == 0
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0
    assert not world.socket.exists()


def test_daemon_stop_command(world: Sandbox) -> None:
    world.start_daemon()
    r = world.ctl("daemon", "stop")
    assert r.rc == 0, r.err
    assert world.daemon_pids() == []
    assert not world.socket.exists()


def test_socket_group_opens_the_socket_to_that_group(world: Sandbox) -> None:
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    world.write_config(f'[daemon]\nsocket_group = "{group}"\n')
    world.start_daemon()
    st = world.socket.stat()
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    assert stat.S_IMODE(world.socket.parent.stat().st_mode) == 0o750
    world.write_config('[daemon]\nsocket_group = "no-such-group-here"\n')
    p = subprocess.run([sys.executable, "-m", "barreld", "--socket", str(world.base / "x.sock")], env=world.env(),
                       capture_output=True, timeout=60)
    assert p.returncode == 1 and "daemon.socket_group" in p.stderr.decode()


def test_a_client_goes_on_across_a_daemon_restart_with_its_peer_token(world: Sandbox) -> None:
    """The token that proves a client's user is an HMAC under a secret in the data dir, so a chat session's
    client is still itself after the daemon restarts (on a shared socket a stale token would be refused)."""
    import grp

    world.write_config(f'[daemon]\nsocket_group = "{grp.getgrgid(os.getgid()).gr_name}"\n')
    proc = world.start_daemon()
    with world.client() as c:
        assert c.daemon_status(timeout=10).pid == proc.pid
        world.stop(proc)
        again = world.start_daemon()
        assert c.daemon_status(timeout=30).pid == again.pid
    key = world.data_dir / "peer.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32

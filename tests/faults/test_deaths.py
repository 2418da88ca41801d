"""Part 6: a daemon that dies, or would die, is never silent. A real signal kills the model's worker
mid-stream (SIGILL, as a llama.cpp build with instructions the CPU traps sends; SIGKILL, as the OOM killer
sends): barrelctl names the signal, the model and the log, exits 1, the log holds the cause, and the next
daemon reconciles the cache with nothing lost or corrupt. A build that cannot decode here and a GGUF that
crashes llama.cpp are found by the load-time check in a child process: the load fails with its cause and
the daemon serves on."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import time
from pathlib import Path

from gguf import GGUFReader

from barreld.engine import exactness
from barreld.engine.registry import bundled_model_path
from tests.support.sandbox import Sandbox

from . import util

STORY = "Tell me a long story about a lighthouse keeper and the sea."


def own_memo(w: Sandbox) -> dict[str, str]:
    """An empty decode-check memo, so this daemon's checks run (the per-user one remembers passes); the
    user's reuse-grain verdicts are copied in, so the models' probes need not run again."""
    mine = w.base / "cache" / "barrel"
    mine.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        shutil.copyfile(exactness.memo_path(), mine / exactness.memo_path().name)
    return {"XDG_CACHE_HOME": str(w.base / "cache")}


def publish_one(w: Sandbox) -> tuple[bytes, str]:
    """A prompt whose finish checkpoint is published, and its reply, from a daemon that then stops."""
    proc = util.start(w)
    s = w.client()
    prompt = util.doc(7, 190)
    done = util.complete(s, prompt, 6)
    util.wait_for(lambda: any(r.key == done.key and r.status == "available" for r in util.rows(s)),
                  what="the finish save")
    util.stop(w, proc)
    return prompt, done.text


def health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/health")
    body = json.loads(conn.getresponse().read())
    conn.close()
    return body


def assert_recovered(w: Sandbox, prompt: bytes, text: str, cause: str) -> None:
    """A fresh daemon: the cache is whole, the published prompt starts warm with its reply, and both the
    log and /health tell how the last daemon ended."""
    said = "the previous run did not stop: barreld (pid"
    before = w.log_text().count(said)
    proc = util.start(w, "--http", "127.0.0.1:0")
    s = w.client()
    assert util.counters(s)["corrupt_files"] == 0
    util.assert_consistent(w, s)
    again = util.complete(s, prompt, 6)
    assert again.route != "miss" and again.text == text
    log = w.log_text()
    assert log.count(said) == before + 1 and cause in log.rpartition(said)[2]
    port = int(s.daemon_status().http.rpartition(":")[2])
    assert cause in health(port)["previous_run"]
    util.stop(w, proc)


def test_a_worker_killed_by_sigill_mid_stream_is_named_with_its_stack_and_log() -> None:
    with Sandbox.new(util.ONE_SAVE_POLICY + util.model_config()) as w:
        prompt, text = publish_one(w)
        # Decode 1 is the warm-up at load, 2 the prompt's prefill, then one a token: the 5th dies mid-stream.
        proc = util.start(w, "--die-in-decode", "5:SIGILL", module="tests.faultd")
        r = w.ctl("--no-autostart", "complete", STORY, "--max-tokens", "40")
        assert proc.wait(30) == -signal.SIGILL
        assert r.rc == 1 and r.out, (r.rc, r.out, r.err)  # some tokens came before the death
        line = r.err.strip()
        assert "\n" not in line and line.startswith(f"barrelctl: barreld (pid {proc.pid}) died of SIGILL (illegal")
        assert "while running model smollm2" in line and 'README "Troubleshooting"' in line
        assert line.endswith(f"log: {w.log}")
        log = w.log_text()
        assert "Fatal Python error: Illegal instruction" in log
        assert "barreld/engine/worker.py" in log.rpartition("Fatal Python error")[2]  # every thread's stack
        assert_recovered(w, prompt, text, "died of SIGILL")


def test_an_autostarted_daemon_killed_as_the_oom_killer_kills_is_named() -> None:
    with Sandbox.new(util.ONE_SAVE_POLICY + util.model_config()) as w:
        prompt, text = publish_one(w)
        long = w.ctl_popen("complete", STORY, "--max-tokens", "400")  # autostarts barreld under its watcher
        assert long.stdout.read(1)  # mid-stream: the reply has begun
        [pid] = w.daemon_pids()
        os.kill(pid, signal.SIGKILL)
        out, err = long.communicate(timeout=60)
        line = err.decode().strip()
        assert long.returncode == 1, line
        assert line.startswith(f"barrelctl: barreld (pid {pid}) died of SIGKILL (killed: by the kernel's OOM killer")
        assert "while running model smollm2" in line and line.endswith(f"log: {w.socket.parent / 'barreld.log'}")
        assert f"barreld.supervise: barreld[{pid}] died of SIGKILL" in w.log_text()
        assert_recovered(w, prompt, text, "died of SIGKILL")


def test_a_build_that_cannot_decode_here_fails_its_load_and_the_daemon_serves_on() -> None:
    with Sandbox.new(util.model_config()) as w:
        doomed = w.base / "doomed.gguf"
        shutil.copy(bundled_model_path("smollm2"), doomed)
        proc = w.start_daemon("--decode-check-dies", "SIGILL:doomed*.gguf", module="tests.faultd", env=own_memo(w))
        w.wait_models({"smollm2"})
        r = w.ctl("--no-autostart", "load", "doomed", "--path", str(doomed))
        assert r.rc == 1
        assert "this llama.cpp build cannot run on this CPU" in r.err and "died of SIGILL" in r.err
        assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF' in r.err and "pip install --force-reinstall" in r.err
        listed = {m["name"]: m for m in w.ctl("--no-autostart", "--json", "models").json()["models"]}
        assert listed["doomed"]["state"] == "failed" and "SIGILL" in listed["doomed"]["error"]
        assert listed["smollm2"]["state"] == "ready" and listed["smollm2"]["error"] == ""
        table = w.ctl("--no-autostart", "models")
        assert "failed" in table.out and "doomed failed to load: cannot load 'doomed'" in table.out
        ok = w.ctl("--no-autostart", "--json", "complete", "Once upon a time", "--model", "smollm2", "-n", "4")
        assert ok.rc == 0 and ok.json()["tokens"]["completion"] == 4
        assert w.ctl("--no-autostart", "unload", "doomed").rc == 0
        assert "doomed" not in w.ctl("--no-autostart", "models").out
        util.stop(w, proc)


def test_the_default_model_that_cannot_decode_here_fails_complete_with_the_cause() -> None:
    with Sandbox.new() as w:
        proc = w.start_daemon("--decode-check-dies", "SIGILL:SmolLM2*.gguf", module="tests.faultd", env=own_memo(w))
        r = w.ctl("--no-autostart", "complete", "Once upon a time", "-n", "4")
        assert r.rc == 1 and r.err.count("\n") == 1, r.err
        assert "cannot run on this CPU" in r.err and "died of SIGILL" in r.err and "Troubleshooting" in r.err
        assert proc.poll() is None and w.ctl("--no-autostart", "daemon", "status").rc == 0
        util.stop(w, proc)


def duplicate_a_token(path: Path) -> None:
    """Makes two vocabulary entries equal: llama.cpp then aborts on an assertion while it reads the file."""
    reader = GGUFReader(path, "r+")
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [field.parts[i] for i in field.data]
    i = next(i for i in range(1000, len(tokens) - 1) if len(tokens[i]) == len(tokens[i + 1]))
    tokens[i + 1][:] = tokens[i][:]
    reader.data.flush()


def test_truncated_and_corrupt_gguf_files_fail_their_load_and_the_daemon_serves_on() -> None:
    with Sandbox.new(util.ONE_SAVE_POLICY + util.model_config()) as w:
        model = bundled_model_path("smollm2")
        truncated, corrupt = w.base / "truncated.gguf", w.base / "corrupt.gguf"
        with open(model, "rb") as src, open(truncated, "wb") as dst:
            dst.write(src.read(model.stat().st_size // 2))
        shutil.copy(model, corrupt)
        duplicate_a_token(corrupt)
        proc = w.start_daemon(env=own_memo(w))
        w.wait_models({"smollm2"})
        s = w.client()
        warm = util.complete(s, util.doc(3, 190), 4)
        for name, path, cause in (("truncated", truncated, "corrupt or unsupported GGUF"),
                                  ("corrupt", corrupt, "died of SIGABRT")):
            t0 = time.monotonic()
            r = w.ctl("--no-autostart", "load", name, "--path", str(path))
            assert r.rc == 1 and str(path) in r.err and cause in r.err, r.err
            assert proc.poll() is None, f"{name}: the daemon died ({time.monotonic() - t0:.1f} s)"
        listed = {m["name"]: m["state"] for m in w.ctl("--no-autostart", "--json", "models").json()["models"]}
        assert listed == {"smollm2": "ready", "truncated": "failed", "corrupt": "failed"}
        again = util.complete(s, util.doc(3, 190), 4)
        assert again.text == warm.text and again.route != "miss"
        util.stop(w, proc)

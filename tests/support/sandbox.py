"""A private barreld, for tests, benchmarks and trying Barrel without touching a user's cache.

A sandbox has its own XDG directories (so its own socket, index, disk tier and config file), its own
ram_file root under /dev/shm, and a short socket path (a Unix socket path holds about 107 bytes). The
daemons and barrelctl processes it starts run the code this module belongs to: their PYTHONPATH names the
checkout that holds it (and barreld, barrelctl), so a checkout's tests run that checkout.

    with Sandbox.new('[policy]\\nmin_tokens = 128\\n') as box:
        box.start_daemon()
        print(box.client().complete(b"Once upon a time", max_tokens=8).result().text)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from barrelctl.client import Client
from barrelctl.errors import ClientError

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/support/sandbox.py


@dataclass
class Run:
    """One finished barrelctl process."""

    rc: int
    out: str
    err: str

    def json(self) -> Any:
        try:
            return json.loads(self.out)
        except ValueError:
            raise AssertionError(f"barrelctl (exit {self.rc}) printed no JSON: {self.out!r}; {self.err}") from None


@dataclass
class Sandbox:
    base: Path
    shm: Path
    extra_config: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    modules: set[str] = field(default_factory=lambda: {"barreld"})  # what its daemons run as `python -m`

    @classmethod
    def new(cls, extra_config: str = "", label: str = "sandbox") -> Sandbox:
        """Fresh directories and a config file holding the ram_file root and `extra_config`."""
        base = Path(tempfile.mkdtemp(prefix=f"barrel-{label}-", dir="/tmp"))
        shm = Path(tempfile.mkdtemp(prefix=f"barrel-{label}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        box = cls(base, shm, extra_config)
        box.write_config()
        return box

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops every daemon on the socket and removes the directories."""
        self.stop_all()
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)

    @property
    def socket(self) -> Path:
        return self.base / "run" / "barrel" / "barreld.sock"

    @property
    def data_dir(self) -> Path:
        return self.base / "data" / "barrel"

    @property
    def config(self) -> Path:
        return self.base / "barreld.toml"

    @property
    def log(self) -> Path:
        return self.base / "barreld.log"

    def env(self, **extra: str) -> dict[str, str]:
        """This environment without the caller's BARREL_ and XDG_ variables, pointed at the sandbox."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BARREL_", "XDG_"))}
        env.update(
            PYTHONPATH=str(SOURCE_ROOT),
            XDG_RUNTIME_DIR=str(self.base / "run"),
            XDG_DATA_HOME=str(self.base / "data"),
            XDG_CONFIG_HOME=str(self.base / "config"),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def write_config(self, text: str = "") -> Path:
        """The config file barreld finds by default: the sandbox's ram_file root, then `text` (or the
        sandbox's extra config). It opens a `[tiers.ram_file]` table, so TOML that follows may add to it."""
        cfg_dir = self.base / "config" / "barrel"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        body = f'[tiers.ram_file]\nroot = "{self.shm}"\n' + (text or self.extra_config)
        (cfg_dir / "barreld.toml").write_text(body)
        self.config.write_text(body)
        return self.config

    def client(self) -> Client:
        """A client of this sandbox's socket that never starts a daemon itself."""
        return Client(self.socket, autostart=False)

    def ctl(self, *args: str, input: bytes | None = None, timeout: float = 300, **env: str) -> Run:
        """Runs barrelctl in the sandbox to the end."""
        p = subprocess.run([sys.executable, "-m", "barrelctl", *args], input=input, capture_output=True,
                           timeout=timeout, env=self.env(**env), cwd=self.base)
        return Run(p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"))

    def ctl_popen(self, *args: str, **kw: Any) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "barrelctl", *args], env=self.env(), cwd=self.base,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)

    def start_daemon(
        self,
        *args: str,
        wait: bool = True,
        env: dict[str, str] | None = None,
        module: str = "barreld",
        timeout: float = 180,  # a first load of a model file decode-checks it and probes its reuse grain
    ) -> subprocess.Popen:
        """Starts `python -m <module> --socket <socket> *args` (barreld, or an entry point that wraps its
        main), its output appended to the sandbox's log; with `wait`, returns once it answers."""
        self.modules.add(module)
        with open(self.log, "ab") as log:
            p = subprocess.Popen([sys.executable, "-m", module, "--socket", str(self.socket), *args],
                                 env=self.env(**(env or {})), cwd=self.base, stdout=log, stderr=log)
        self.procs.append(p)
        if wait:
            self.wait_ready(p, timeout)
        return p

    def wait_ready(self, proc: subprocess.Popen | None = None, timeout: float = 180) -> None:
        """Until a daemon (`proc` itself, when given) answers a status call on the socket.

        Each poll opens a fresh channel: one that failed to connect would wait out a reconnect backoff."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"barreld exited with {proc.returncode}:\n{self.log_text()[-4000:]}")
            with self.client() as c, contextlib.suppress(ClientError):
                if proc is None or c.daemon_status(timeout=2).pid == proc.pid:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"barreld not ready after {timeout}s:\n{self.log_text()[-4000:]}")

    def wait_models(self, names: set[str], timeout: float = 300) -> None:
        """Until every one of `names` is loaded: the daemon answers while it still loads its configured models."""
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while not names <= {m.name for m in c.models()}:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{sorted(names)} not all loaded after {timeout}s:\n{self.log_text()[-4000:]}")
                time.sleep(0.1)

    def http_port(self, timeout: float = 900) -> int:
        """The loopback port of the daemon's HTTP API, once /health stops answering 'loading': the daemon
        serves while it loads its configured models (a first load decode-checks and probes the file)."""
        port = int(self.ctl("--json", "daemon", "status").json()["http"].rpartition(":")[2])
        deadline = time.monotonic() + timeout
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("GET", "/health")
            loading = json.loads(conn.getresponse().read()).get("status") == "loading"
            conn.close()
            if not loading:
                return port
            if time.monotonic() > deadline:
                raise RuntimeError(f"models still loading after {timeout}s:\n{self.log_text()[-4000:]}")
            time.sleep(0.1)

    def stop(self, proc: subprocess.Popen, timeout: float = 60) -> int:
        """SIGTERM (the shutdown saves run) and its exit status; SIGKILL only if it outlasts `timeout`."""
        proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def log_text(self) -> str:
        """The daemons' output: those started here, and one that barrelctl started in the background."""
        logs = [self.log, self.socket.parent / "barreld.log"]
        return "\n".join(p.read_text(errors="replace") for p in logs if p.exists())

    def daemon_pids(self) -> list[int]:
        """Every daemon process serving (or starting on) this sandbox's socket."""
        import psutil

        pids = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if str(self.socket) in cmd and not self.modules.isdisjoint(cmd):
                pids.append(p.pid)
        return pids

    def stop_all(self) -> None:
        """SIGTERM every daemon on the socket; SIGKILL those still there after 30 s."""
        for pid in self.daemon_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while self.daemon_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.daemon_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)

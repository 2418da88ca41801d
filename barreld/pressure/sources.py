"""Pressure sources: where the scheduler learns how full memory is.

A source answers `sample() -> (used_bytes, total_bytes)`. It raises `SourceUnavailable` when it cannot
work on this machine at all (no nvidia-smi, no driver), which the scheduler reports and re-checks slowly;
any other exception is a failed tick. Specs, as the config file writes them: `noop`, `system`,
`nvidia_smi`, `module:pkg.mod`.
"""

import importlib
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from typing import Protocol

import psutil

SPEC_HELP = "expected 'noop', 'system', 'nvidia_smi' or 'module:pkg.mod'"
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_MIB = 1024 * 1024


class SourceUnavailable(Exception):
    """The source cannot sample on this machine; the message says why, for `scheduler status`."""


class PressureSource(Protocol):
    """What the scheduler polls. `name` is the spec it was made from, shown in status."""

    name: str

    def sample(self) -> tuple[int, int]:
        """Return (used_bytes, total_bytes) of the memory this source watches."""
        ...


class NoopSource:
    """Always zero pressure: the scheduler runs and never evicts."""

    name = "noop"

    def sample(self) -> tuple[int, int]:
        """Nothing used out of one byte."""
        return (0, 1)


class SystemSource:
    """Host RAM from psutil, or the memory limit of the cgroup this process runs in when it has one.

    Inside a container the host's free memory is irrelevant: the OOM killer acts at the cgroup limit. The
    nearest cgroup (walking up from this process's own) with a finite limit below host RAM is used, and
    its usage minus inactive file cache, the "working set" the kernel reclaims last, as kubelet does.
    """

    name = "system"

    def __init__(
        self, cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
    ):
        self._cgroup_root = cgroup_root
        self._proc_cgroup = proc_cgroup

    def sample(self) -> tuple[int, int]:
        """(used, total): cgroup working set and limit when limited, else host total minus available."""
        vm = psutil.virtual_memory()
        limited = self._cgroup_sample(vm.total)
        if limited is not None:
            return limited
        return (vm.total - vm.available, vm.total)

    def _cgroup_sample(self, host_total: int) -> tuple[int, int] | None:
        """The limited cgroup's (working set, limit), or None when no cgroup limits this process."""
        try:
            lines = self._proc_cgroup.read_text().splitlines()
        except OSError:
            return None
        v1_path = v2_path = None
        for line in lines:
            fields = line.split(":", 2)
            if len(fields) != 3:
                continue
            _, controllers, path = fields
            if "memory" in controllers.split(","):
                v1_path = path
            elif controllers == "":
                v2_path = path
        if v1_path is not None:
            base, path = self._cgroup_root / "memory", v1_path
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
            inactive_key = "total_inactive_file"
        elif v2_path is not None:
            base, path = self._cgroup_root, v2_path
            limit_file, usage_file, inactive_key = "memory.max", "memory.current", "inactive_file"
        else:
            return None
        # Without a cgroup namespace the path names the host's hierarchy and only a suffix of it (often
        # just the root) is mounted here; so try each ancestor, deepest first, among those that exist.
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            directory = base.joinpath(*parts[:depth])
            limit = _read_int(directory / limit_file)
            if limit is None or limit <= 0 or limit >= host_total:
                continue  # "max", unreadable, or a "limit" roomier than the host: not what binds
            usage = _read_int(directory / usage_file)
            if usage is None:
                continue
            inactive = _read_stat(directory / "memory.stat", inactive_key)
            return (min(limit, max(0, usage - inactive)), limit)
        return None


class NvidiaSmiSource:
    """VRAM used and total, summed over every GPU `nvidia-smi` lists.

    The tool is looked up on PATH at each sample, so installing a driver later makes it available without
    a restart. Absent tool or failing driver: `SourceUnavailable`, never a crash.
    """

    name = "nvidia_smi"
    QUERY = ("--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits")

    def __init__(self, timeout_s: float = 5.0) -> None:
        self._timeout_s = timeout_s

    def sample(self) -> tuple[int, int]:
        """Sum the MiB figures of every GPU and return bytes."""
        tool = shutil.which("nvidia-smi")
        if tool is None:
            raise SourceUnavailable("nvidia-smi not found on PATH")
        try:
            done = subprocess.run(
                [tool, *self.QUERY], capture_output=True, text=True, timeout=self._timeout_s, check=False
            )
        except OSError as e:
            raise SourceUnavailable(f"cannot run {tool}: {e}") from e
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            reason = detail[0] if detail else "no output"
            raise SourceUnavailable(f"nvidia-smi exited {done.returncode}: {reason}")
        used = total = 0
        rows = [line for line in done.stdout.splitlines() if line.strip()]
        if not rows:
            raise SourceUnavailable("nvidia-smi lists no GPU")
        for row in rows:
            fields = [f.strip() for f in row.split(",")]
            if len(fields) != 2 or not all(f.isdigit() for f in fields):
                raise ValueError(f"unexpected nvidia-smi line: {row!r}")
            used += int(fields[0]) * _MIB
            total += int(fields[1]) * _MIB
        return (used, total)


class ModuleSource:
    """An operator's own source: a module with `sample() -> (used_bytes, total_bytes)`.

    The module is imported once, here, so a missing module fails at start; `sample` is looked up on each
    call, so a module that rebinds it is followed.
    """

    def __init__(self, module: str) -> None:
        self.name = f"module:{module}"
        try:
            self._module = importlib.import_module(module)
        except Exception as e:
            raise ValueError(f"pressure source {self.name!r}: cannot import {module}: {e}") from e
        if not callable(getattr(self._module, "sample", None)):
            raise ValueError(f"pressure source {self.name!r}: {module} has no sample() function")

    def sample(self) -> tuple[int, int]:
        """Whatever the module's sample() returns; the scheduler checks it is sane."""
        return self._module.sample()


_BUILTIN: dict[str, type[PressureSource]] = {
    "noop": NoopSource,
    "system": SystemSource,
    "nvidia_smi": NvidiaSmiSource,
}


def check_source_spec(spec: str) -> None:
    """Raise ValueError unless `spec` names a source: a known name, or a module that can be found.

    Used by the config loader, so a typo stops the daemon at start; nothing is imported beyond the
    parents of a dotted module name.
    """
    if spec in _BUILTIN:
        return
    module = _module_of(spec)
    try:
        found = importlib.util.find_spec(module)
    except Exception as e:  # a parent package that fails to import, whatever it raises
        raise ValueError(f"unknown pressure source {spec!r}: cannot find module {module}: {e}") from e
    if found is None:
        raise ValueError(f"unknown pressure source {spec!r}: no module named {module}")


def make_source(spec: str) -> PressureSource:
    """The source `spec` names; ValueError for an unknown spec or a module that does not import."""
    if spec in _BUILTIN:
        return _BUILTIN[spec]()
    return ModuleSource(_module_of(spec))


def _module_of(spec: str) -> str:
    """The module name of a `module:pkg.mod` spec; ValueError for anything else."""
    prefix, sep, module = spec.partition(":")
    if prefix != "module" or not sep or not _MODULE_NAME.fullmatch(module):
        raise ValueError(f"unknown pressure source {spec!r}: {SPEC_HELP}")
    return module


def _read_int(path: Path) -> int | None:
    """A cgroup file's integer, or None for "max", a missing file, or anything unparsable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(path: Path, key: str) -> int:
    """One counter from a memory.stat file; 0 when absent, which errs towards more pressure, not less."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0

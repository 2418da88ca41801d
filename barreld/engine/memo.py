"""Verdicts worth keeping between runs (a decode check passed, a model's reuse grain), in one small JSON file
per kind under the user's cache directory, shared by that user's daemons.

A verdict holds for what its key hashes: the llama.cpp library files, the CPU and the model file (by name,
size and mtime), plus whatever settings the caller adds. A damaged file or a read-only home only makes the
check run again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/barrel (~/.cache/barrel when unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "barrel"


def cpu_identity() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags, as the kernel lists them for the first processor."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block ends
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags") or fields.get("Features") or ""
    return fields.get("model name") or platform.machine(), frozenset(flags.split())


def _library_files() -> list[tuple[str, int, int]]:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return []
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    found = []
    for p in sorted(lib.glob("*")) if lib.is_dir() else []:
        st = p.stat()
        found.append((str(p), st.st_size, st.st_mtime_ns))
    return found


def verdict_key(model: Path, **settings: Any) -> str:
    """What a verdict on `model` holds for: the llama.cpp library files, the CPU, the model file, settings."""
    st = model.stat()
    name, flags = cpu_identity()
    what = {"lib": _library_files(), "cpu": [name, sorted(flags)], "model": [str(model), st.st_size, st.st_mtime_ns],
            **settings}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


class JsonMemo:
    """A file of verdicts by key; every read goes to the file, so daemons sharing it see each other's."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def all(self) -> dict[str, Any]:
        try:
            kept = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return kept if isinstance(kept, dict) else {}

    def get(self, key: str) -> Any:
        return self.all().get(key)

    def put(self, key: str, value: Any) -> None:
        kept = self.all()
        kept[key] = value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")  # loads are threads
            tmp.write_text(json.dumps(kept, indent=1))
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only home: the check runs again next time, nothing worse
            log.info("cannot remember a verdict in %s: %s", self.path, exc.strerror)

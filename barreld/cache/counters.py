"""Thread-safe counters, under the names `cache stats` reports them by."""

from __future__ import annotations

import threading

from barreld.names import Route, SaveReason

COUNTER_NAMES: tuple[str, ...] = (
    *(route.counter for route in Route),  # requests by how they were warm-started
    *(reason.counter for reason in SaveReason),  # saves by their moment
    "saves_dropped",
    "saves_duplicate",
    "saves_failed",
    "evictions",
    "superseded",
    "corrupt_files",
    "corrupt_blocks",
    "longest_prefix_probes",
    "resume_waits",
    "reuse_refused",
    "settled_tokens",
    "opening_tokens",
    "next_forms",  # replies settled in the form the next turn writes them (a call rewritten, thoughts dropped)
    "boundary_snapshots",
    "end_snapshots",  # a prompt's state at its own end, where its finish row keeps it only at a chunk boundary
    "lookup_ns",
    "restore_ns",
    "save_ns",
    "snapshot_ns",
)


class Counters:
    """A fixed set of named integers; unknown names raise so a typo never hides a count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTER_NAMES, 0)

    def count(self, name: str, n: int = 1) -> None:
        """Add n to a counter."""
        with self._lock:
            if name not in self._values:
                raise KeyError(f"unknown counter {name!r}")
            self._values[name] += n

    def add_ns(self, name: str, ns: int) -> None:
        """Add a latency in nanoseconds to one of the `*_ns` totals."""
        if not name.endswith("_ns"):
            raise KeyError(f"{name!r} is not a latency total")
        self.count(name, ns)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of every counter."""
        with self._lock:
            return dict(self._values)

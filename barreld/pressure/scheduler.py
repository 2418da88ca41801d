"""The memory-pressure scheduler: poll a source, and past the high watermark ask the cache to evict.

When `used / total >= high_watermark` it asks `evict` for `ceil(used - low_watermark * total)` bytes from
`evict_tiers`, enough to bring the ratio below the low watermark if the freed bytes leave the process.
Every failure (a raising source, a nonsense sample, a raising evict) is logged, kept in `status()` and
costs only that tick; an unavailable source is re-checked at a slow rate instead of every interval.
"""

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from barreld.names import MEMORY_TIERS
from barreld.pressure.sources import PressureSource, SourceUnavailable

log = logging.getLogger(__name__)

Evict = Callable[[int, list[str]], tuple[int, int]]
"""evict(n_bytes, tiers) -> (rows_evicted, bytes_freed), as the cache's evict_bytes."""

UNAVAILABLE_RETRY_MS = 60_000
"""How often an unavailable source is tried again: rare enough that a missing tool costs nothing."""

_ERRORS_KEPT = 10


def check_watermarks(high_watermark: float, low_watermark: float) -> None:
    """Raise ValueError unless 0 <= low < high <= 1: the scheduler needs room between the two."""
    for name, value in (("high_watermark", high_watermark), ("low_watermark", low_watermark)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be a number from 0 to 1, got {value!r}")
    if low_watermark >= high_watermark:
        raise ValueError(f"low_watermark ({low_watermark}) must be below high_watermark ({high_watermark})")


class PressureScheduler:
    """A daemon thread that polls `source` every `interval_ms` and evicts past `high_watermark`.

    `enabled=False` (the default) makes `start()` do nothing; `status()` still answers.
    `tick()` runs one poll synchronously, for tests and for the thread itself.
    """

    def __init__(
        self,
        source: PressureSource,
        evict: Evict,
        *,
        enabled: bool = False,
        interval_ms: int = 5000,
        high_watermark: float = 0.85,
        low_watermark: float = 0.75,
        evict_tiers: Sequence[str] = MEMORY_TIERS,
        unavailable_retry_ms: int = UNAVAILABLE_RETRY_MS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_watermarks(high_watermark, low_watermark)
        if interval_ms < 1 or unavailable_retry_ms < 1:
            raise ValueError("interval_ms and unavailable_retry_ms must be at least 1")
        if not evict_tiers:
            raise ValueError("evict_tiers must name at least one tier")
        self._source = source
        self._evict = evict
        self._enabled = enabled
        self._interval_ms = interval_ms
        self._high = high_watermark
        self._low = low_watermark
        self._tiers = list(evict_tiers)
        self._retry_ms = max(interval_ms, unavailable_retry_ms)
        self._clock = clock
        self._lock = threading.Lock()  # guards the status fields below
        self._tick_lock = threading.Lock()  # one tick at a time, thread or caller
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._available: bool | None = None  # None until the first sample is tried
        self._unavailable_reason: str | None = None
        self._last_sample: dict[str, Any] | None = None
        self._last_eviction: dict[str, Any] | None = None
        self._evictions_total = 0
        self._bytes_freed_total = 0
        self._errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=_ERRORS_KEPT)
        self._ticks = 0

    def start(self) -> None:
        """Start polling in a daemon thread, first tick at once; no-op when disabled or running."""
        if not self._enabled or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="barrel-pressure", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and join it: it wakes from its wait at once; only a tick in flight delays it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def tick(self) -> None:
        """Sample once; past the high watermark, evict down towards the low one. Never raises."""
        with self._tick_lock:
            at = self._clock()
            with self._lock:
                self._ticks += 1
            try:
                used, total = _checked(self._source.sample())
            except SourceUnavailable as e:
                self._set_unavailable(str(e))
                return
            except Exception as e:
                self._error(at, f"pressure source {self._source.name} failed: {e}")
                return
            with self._lock:
                if self._available is False:
                    log.info("pressure source %s is available again", self._source.name)
                self._available, self._unavailable_reason = True, None
                self._last_sample = {"used": used, "total": total, "ratio": used / total, "at": at}
            if used / total < self._high:
                return
            # Fraction keeps the arithmetic exact: float error must not under-evict by a byte.
            wanted = math.ceil(used - Fraction(self._low) * total)
            try:
                evicted, freed = (int(n) for n in self._evict(wanted, list(self._tiers)))
            except Exception as e:
                self._error(at, f"evicting {wanted} bytes from {', '.join(self._tiers)} failed: {e}")
                return
            if evicted == 0:
                # Nothing evictable is left in these tiers: keep the last real eviction on show.
                log.debug("memory pressure %.3f: nothing left to evict in %s", used / total, ",".join(self._tiers))
                return
            log.info(
                "memory pressure %.3f >= %.3f: asked for %d bytes from %s, evicted %d rows, freed %d bytes",
                used / total,
                self._high,
                wanted,
                ",".join(self._tiers),
                evicted,
                freed,
            )
            with self._lock:
                self._last_eviction = {
                    "at": at,
                    "requested": wanted,
                    "evicted": evicted,
                    "bytes_freed": freed,
                }
                self._evictions_total += 1
                self._bytes_freed_total += freed

    def status(self) -> dict[str, Any]:
        """Everything `barrelctl scheduler status` shows, as plain JSON-able values."""
        with self._lock:
            return {
                "enabled": self._enabled,
                "running": self._thread is not None and self._thread.is_alive(),
                "source": self._source.name,
                "high_watermark": self._high,
                "low_watermark": self._low,
                "interval_ms": self._interval_ms,
                "evict_tiers": list(self._tiers),
                "available": self._available,
                "unavailable_reason": self._unavailable_reason,
                "last_sample": dict(self._last_sample) if self._last_sample else None,
                "last_eviction": dict(self._last_eviction) if self._last_eviction else None,
                "evictions_total": self._evictions_total,
                "bytes_freed_total": self._bytes_freed_total,
                "errors": [dict(e) for e in self._errors],
                "ticks": self._ticks,
            }

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            with self._lock:
                wait_ms = self._retry_ms if self._available is False else self._interval_ms
            self._stop.wait(wait_ms / 1000)

    def _set_unavailable(self, reason: str) -> None:
        with self._lock:
            if self._available is not False or self._unavailable_reason != reason:
                log.warning("pressure source %s unavailable: %s", self._source.name, reason)
            self._available, self._unavailable_reason = False, reason

    def _error(self, at: float, message: str) -> None:
        log.warning("%s; skipping this tick", message)
        with self._lock:
            self._errors.append({"at": at, "message": message})


def _checked(sample: object) -> tuple[int, int]:
    """`sample` as (used, total) when it is two ints with 0 <= used <= total and total > 0."""
    if not isinstance(sample, tuple | list) or len(sample) != 2:
        raise ValueError(f"sample() returned {sample!r}, not (used_bytes, total_bytes)")
    used, total = sample
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (used, total)):
        raise ValueError(f"sample() returned {sample!r}: both values must be whole numbers of bytes")
    if total <= 0 or used < 0 or used > total:
        raise ValueError(f"sample() returned {sample!r}: expected 0 <= used <= total and total > 0")
    return used, total

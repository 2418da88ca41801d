"""Buffers for a backend's state reads, handed out again once nothing else refers to them.

A fresh buffer for a 13,000-token Gemma 3 state (48 MB) cost 35 ms of page faults and zero-filling on the bench
machine, and llama.cpp's copy into it 9 ms. A ring reads its state twice on every agent call (the snapshot its
next call restores, and the prompt's end), so most of each read was the allocation.
"""

from __future__ import annotations

import sys
import threading

KEPT_BUFFERS = 3
"""A ring's call holds two reads (its snapshot and its end's) while a third may still be with the writers."""


def _alone_count() -> int:
    """What sys.getrefcount gives for an item of a list that nothing else refers to, read as `take` reads it
    (the interpreter's own temporary references differ between versions)."""
    held = [bytearray(1)]
    return sys.getrefcount(held[0])


class StateBuffers:
    """The latest KEPT_BUFFERS buffers handed out. One is handed out again only when this pool alone refers to
    it: no snapshot, row or writer holds it and no view of it is alive, which CPython's reference count tells
    exactly; the read then overwrites every byte of it. Otherwise a fresh one is made."""

    def __init__(self, kept: int = KEPT_BUFFERS) -> None:
        self._kept = kept
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()
        self._alone = _alone_count()

    def take(self, size: int) -> bytearray:
        """A buffer of exactly `size` bytes, of unspecified content."""
        with self._lock:
            free = next((i for i in range(len(self._buffers)) if self._is_free(i)), None)
            if free is None:
                buf = bytearray(size)
            else:
                buf = self._buffers.pop(free)
                if len(buf) > size:
                    del buf[size:]
                elif len(buf) < size:
                    buf.extend(bytes(size - len(buf)))
            self._buffers.append(buf)
            if len(self._buffers) > self._kept:
                drop = next((i for i in range(len(self._buffers) - 1) if self._is_free(i)), 0)
                del self._buffers[drop]
            return buf

    def _is_free(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) == self._alone

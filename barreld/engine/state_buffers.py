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
KEPT_BYTES = 512 << 20
"""At most this much is kept: an idle buffer is memory the process holds between calls, and a large model's
state (4 GB for 32,768 tokens of a 7B model) is better given back than kept for a 35 ms saving."""


def _alone_count() -> int:
    """What sys.getrefcount gives for an item of a list that nothing else refers to, read as `take` reads it
    (the interpreter's own temporary references differ between versions)."""
    held = [bytearray(1)]
    return sys.getrefcount(held[0])


class StateBuffers:
    """The latest KEPT_BUFFERS buffers handed out, KEPT_BYTES in all. One is handed out again only when this
    pool alone refers to it: no snapshot, row or writer holds it and no view of it is alive, which CPython's
    reference count tells exactly; the read then overwrites every byte of it. Otherwise a fresh one is made."""

    def __init__(self, kept: int = KEPT_BUFFERS, kept_bytes: int = KEPT_BYTES) -> None:
        self._kept, self._kept_bytes = kept, kept_bytes
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
            while len(self._buffers) > self._kept or sum(map(len, self._buffers)) > self._kept_bytes:
                drop = next((i for i in range(len(self._buffers) - 1) if self._is_free(i)), 0)
                del self._buffers[drop]
            return buf

    def _is_free(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) == self._alone

"""The index's two locks: the writers' first-come first-served lock, and the readers' hold on the memory map."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class FairLock:
    """A first-come first-served lock: a writer waiting for it gets it before its holder can take it back,
    so the back-to-back transactions of a gc cannot starve a save (a plain lock lets the releasing thread
    take it again before the woken waiter runs)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket that may hold the lock

    def acquire(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class MapGuard:
    """Read transactions share the memory map; growing it replaces the map, so it waits for them to end."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._growing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._growing:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._growing = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._growing = False
                self._cond.notify_all()

"""A bounded pool of writer threads: a full queue refuses work at once instead of blocking the caller."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .errors import WriterQueueFull


class WriterPool:
    """`threads` workers draining a queue of at most `queue_size` waiting jobs.

    Urgent jobs (sync saves: evict, shutdown) jump the queue and are never refused for lack of room:
    the caller is already waiting on them, bounded by its own timeout.
    """

    def __init__(self, threads: int = 2, queue_size: int = 16, name: str = "barrel-writer") -> None:
        if threads < 1 or queue_size < 1:
            raise ValueError("a writer pool needs at least one thread and one queue slot")
        self.queue_size = queue_size
        self._jobs: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: Callable[[], Any], *, urgent: bool = False) -> Future:
        """Queue a job; raises WriterQueueFull (never blocks) when the queue is full and it is not urgent."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("writer pool is closed")
            if urgent:
                self._jobs.appendleft((fut, job))
            elif len(self._jobs) >= self.queue_size:
                raise WriterQueueFull(f"writer queue full ({self.queue_size} saves waiting)")
            else:
                self._jobs.append((fut, job))
            self._cond.notify()
        return fut

    def _work(self) -> None:
        while self._run_next():
            pass

    def _run_next(self) -> bool:
        """Runs the next job; False once closed with none left. Its references (a save's checkpoint, tens of
        megabytes of state) go with this frame, rather than staying held while the thread waits for another."""
        with self._cond:
            while not self._jobs and not self._closed:
                self._cond.wait()
            if not self._jobs:
                return False
            fut, job = self._jobs.popleft()
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(job())
            except BaseException as e:
                fut.set_exception(e)
        return True

    def close(self) -> None:
        """Stop taking jobs, finish every queued one, and join the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

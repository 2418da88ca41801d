"""The writer pool: bounded, never blocks the submitter, urgent jobs first, close drains."""

from __future__ import annotations

import threading
import weakref

import pytest

from barreld.cache import WriterQueueFull
from barreld.cache.writer import WriterPool


def test_full_queue_refuses_instead_of_blocking() -> None:
    gate = threading.Event()
    pool = WriterPool(threads=1, queue_size=2)
    started = threading.Event()
    first = pool.submit(lambda: (started.set(), gate.wait(10)))
    started.wait(10)
    queued = [pool.submit(lambda i=i: i) for i in range(2)]
    with pytest.raises(WriterQueueFull):
        pool.submit(lambda: "dropped")
    gate.set()
    assert first.result(10)[1] is True
    assert [f.result(10) for f in queued] == [0, 1]
    pool.close()


def test_urgent_jobs_jump_a_full_queue() -> None:
    gate = threading.Event()
    started = threading.Event()
    order: list[str] = []
    pool = WriterPool(threads=1, queue_size=1)
    pool.submit(lambda: (started.set(), gate.wait(10)))
    started.wait(10)
    pool.submit(lambda: order.append("async"))
    urgent = pool.submit(lambda: order.append("urgent"), urgent=True)
    gate.set()
    urgent.result(10)
    pool.close()
    assert order == ["urgent", "async"]


def test_close_finishes_queued_jobs_and_errors_reach_the_future() -> None:
    pool = WriterPool(threads=2, queue_size=16)
    done: list[int] = []
    futures = [pool.submit(lambda i=i: done.append(i)) for i in range(10)]
    bad = pool.submit(lambda: 1 / 0)
    pool.close()
    assert sorted(done) == list(range(10)) and all(f.done() for f in futures)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)


def test_an_idle_writer_holds_nothing_of_its_last_job() -> None:
    """A save's job holds its checkpoint (tens of megabytes of state); once done, the thread waiting for the next
    job must not keep it, or the state's buffer is never read into again (StateBuffers) nor freed."""

    class State:
        pass

    pool = WriterPool(threads=1, queue_size=2)
    state = State()
    gone = threading.Event()
    weakref.finalize(state, gone.set)
    done = pool.submit(lambda held=state: held is not None)
    assert done.result(10) is True
    del state, done
    assert gone.wait(10)
    pool.close()

"""The HTTP front end's mailbox: events posted from the worker's thread reach the event loop in order, with one
wake of the loop for all posted while it was busy, and nothing is written once the loop is gone."""

from __future__ import annotations

import array
import asyncio
import fcntl
import gc
import os
import termios
import threading

import pytest

from barreld.http.streaming import Mailbox, mailbox


def test_posts_from_another_thread_arrive_in_order_with_one_wake_while_the_loop_is_busy() -> None:
    async def main() -> tuple[list[int], list[int], int]:
        box = mailbox()
        assert mailbox() is box
        first, second = asyncio.Queue(), asyncio.Queue()

        def post() -> None:
            for i in range(50):
                box.post(first if i % 2 else second, i)

        # The loop is held here, as a worker holding the GIL holds it: every post lands before it can run.
        thread = threading.Thread(target=post)
        thread.start()
        thread.join()
        pending = array.array("i", [0])
        fcntl.ioctl(box._read, termios.FIONREAD, pending)
        return [await first.get() for _ in range(25)], [await second.get() for _ in range(25)], pending[0]

    got_first, got_second, written = asyncio.run(main())
    assert written == 1
    assert got_first == list(range(1, 50, 2))
    assert got_second == list(range(0, 50, 2))


def test_a_post_after_the_loop_is_gone_is_dropped_and_its_pipe_is_closed() -> None:
    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    fds = (box._read, box._write)
    loop.close()
    del loop
    gc.collect()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    box.post(asyncio.Queue(), 1)  # no write to a closed descriptor, nor to another file given its number

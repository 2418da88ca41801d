"""StateBuffers hands a buffer out again only when nothing else refers to it."""

from __future__ import annotations

import numpy as np

from barreld.engine.state_buffers import StateBuffers


def test_a_buffer_nothing_holds_is_handed_out_again_at_the_size_asked() -> None:
    pool = StateBuffers()
    first = pool.take(1000)
    address = np.frombuffer(first, dtype=np.uint8).ctypes.data
    del first
    again = pool.take(900)
    assert len(again) == 900 and np.frombuffer(again, dtype=np.uint8).ctypes.data == address
    del again
    assert len(pool.take(1200)) == 1200


def test_a_buffer_still_held_is_never_overwritten() -> None:
    pool = StateBuffers()
    kept = pool.take(64)
    kept[:] = b"k" * 64
    other = pool.take(64)
    other[:] = b"o" * 64
    assert kept is not other and bytes(kept) == b"k" * 64


def test_a_live_view_or_array_holds_its_buffer() -> None:
    pool = StateBuffers()
    first = pool.take(32)
    first[:] = b"v" * 32
    view = memoryview(first)[:8]
    second = pool.take(32)
    second[:] = b"a" * 32
    array = np.frombuffer(second, dtype=np.uint8)
    del first, second
    third = pool.take(32)
    third[:] = b"t" * 32
    assert bytes(view) == b"v" * 8 and array.tobytes() == b"a" * 32


def test_only_the_latest_buffers_are_kept() -> None:
    pool = StateBuffers(kept=2)
    held = [pool.take(16) for _ in range(4)]
    del held
    fresh = [pool.take(16) for _ in range(3)]
    assert len({id(b) for b in fresh}) == 3


def test_no_more_than_the_byte_budget_is_kept() -> None:
    pool = StateBuffers(kept=3, kept_bytes=100)
    large = pool.take(150)
    assert not any(b is large for b in pool._buffers)  # beyond the budget alone: never kept
    held = [pool.take(40) for _ in range(3)]
    assert [id(b) for b in pool._buffers] == [id(b) for b in held[1:]]  # 120 bytes: the oldest let go

"""barrelctl's client against a real barreld (no model loaded, so it runs in the fast suite): every typed
call answers with typed values, and every failure is one ClientError with the contract's exit code."""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from barrelctl.client import Client
from barrelctl.errors import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE, ClientError
from barreld.rpc import barrel_pb2 as pb
from barreld.rpc import barrel_pb2_grpc as pb_grpc
from tests.support.sandbox import Sandbox


def test_no_daemon_is_unavailable_with_exit_3(tmp_path: Path) -> None:
    sock = tmp_path / "none.sock"
    with pytest.raises(ClientError) as e:
        Client(sock).cache_stats()
    assert (e.value.status, e.value.code) == ("UNAVAILABLE", EXIT_UNREACHABLE)
    assert str(sock) in str(e.value) and "\n" not in str(e.value)


def test_typed_calls_and_their_errors(served: Sandbox) -> None:
    with served.client() as c:
        status = c.daemon_status(timeout=10)
        assert status.pid in served.daemon_pids() and status.socket == str(served.socket)
        assert c.models() == [] and c.cache_dump() == [] and c.cache_gc() == 0
        assert set(c.cache_stats().tiers) == {"ram", "ram_file", "disk"}
        freed = c.cache_evict_bytes(1 << 20, tiers=["disk"])
        assert (freed.evicted, freed.bytes_freed) == (0, 0)
        seen: list[tuple[int, int]] = []
        result = c.cache_verify(progress=lambda done, total: seen.append((done, total)))
        assert (result.checked, list(result.bad)) == (0, [])
        assert all(done <= total for done, total in seen)
        assert c.scheduler_status()["enabled"] is False

        with pytest.raises(ClientError) as e:
            c.cache_dump(tier="floppy")
        assert (e.value.status, e.value.code) == ("INVALID_ARGUMENT", EXIT_USAGE) and "floppy" in e.value.details
        with pytest.raises(ClientError) as e:  # a stream fails when it is read
            c.complete(b"hello", model="m" * 500).result()
        assert (e.value.status, e.value.code) == ("INVALID_ARGUMENT", EXIT_USAGE)
        assert "bad model name" in e.value.details
        with pytest.raises(ClientError) as e:
            c.unload("nosuch")
        assert (e.value.status, e.value.code) == ("NOT_FOUND", EXIT_FAILED) and "nosuch" in str(e.value)


@pytest.mark.parametrize(
    ("knobs", "needle"),
    [
        ({"n_threads": 0}, "bad n_threads 0"),
        ({"n_gpu_layers": -2}, "bad n_gpu_layers -2"),
        ({"type_k": "q3_k"}, "bad type_k 'q3_k'"),
        ({"type_v": "q4_0", "flash_attn": False}, "bad type_v 'q4_0': a quantised V cache needs flash_attn"),
    ],
)
def test_the_daemon_refuses_bad_model_knobs_itself(served: Sandbox, knobs: dict, needle: str) -> None:
    """What barrelctl checks before sending, the daemon checks again for any other client."""
    with served.client() as c, pytest.raises(ClientError) as e:
        c.load("smollm2", **knobs)
    assert (e.value.status, e.value.code) == ("INVALID_ARGUMENT", EXIT_USAGE) and needle in e.value.details
    assert served.client().models() == []


@pytest.mark.slow
def test_shutdown_stops_the_daemon(world: Sandbox) -> None:
    proc = world.start_daemon()
    with world.client() as c:
        c.shutdown(timeout=10)
    assert proc.wait(60) == 0
    with pytest.raises(ClientError) as e:
        world.client().daemon_status(timeout=5)
    assert e.value.code == EXIT_UNREACHABLE


class _Streamer(pb_grpc.BarrelServicer):
    """A daemon that streams a reply of max_tokens one-byte tokens as fast as gRPC carries them."""

    def Complete(self, request: pb.CompleteRequest, context: grpc.ServicerContext) -> Iterator[pb.CompleteEvent]:
        yield pb.CompleteEvent(started=pb.CompleteStarted(model="fake"))
        for _ in range(request.max_tokens):
            if not context.is_active():
                return
            yield pb.CompleteEvent(token=pb.CompleteToken(text=b"x"))
        yield pb.CompleteEvent(done=pb.CompleteDone(text=b"x" * request.max_tokens, finish_reason="length"))


class _Interrupt(Exception):
    """What the test's SIGINT handler raises, in place of KeyboardInterrupt (which would stop pytest)."""


@pytest.fixture
def streamer(tmp_path: Path) -> Iterator[Path]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_BarrelServicer_to_server(_Streamer(), server)
    sock = tmp_path / "streamer.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    yield sock
    server.stop(None)


def _finishes(call: Callable[[], object], timeout: float) -> bool:
    """Whether call returns within timeout, run on a thread of its own (a hung call must not hang the test)."""
    ended = threading.Event()
    threading.Thread(target=lambda: (call(), ended.set()), daemon=True).start()
    return ended.wait(timeout)


def test_an_interrupt_while_a_reply_streams_never_hangs_the_next_call(streamer: Path) -> None:
    """`barrelctl chat` goes on after a Ctrl-C. An interrupt raised in gRPC's own Python code can leave one of its
    locks held, and every later call on the channel hangs: the reply is read on a thread of its own, so the
    interrupt lands outside gRPC. Real SIGINTs, at random moments of a dense stream, each followed by a call
    that must finish. With the reply read on the main thread, this test failed in 5 runs out of 5."""
    armed = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if armed.is_set():
            armed.clear()
            raise _Interrupt

    before = signal.signal(signal.SIGINT, handler)
    rng = random.Random(7)
    try:
        with Client(streamer) as c:
            for _ in range(40):
                stream = c.complete(b"p", max_tokens=1_000_000)
                armed.set()
                timer = threading.Timer(rng.uniform(0, 0.03), signal.pthread_kill,
                                        (threading.main_thread().ident, signal.SIGINT))
                with pytest.raises(_Interrupt):  # under load the timer can fire before its start() returns
                    timer.start()
                    for _ in stream:
                        pass
                stream.cancel()
                timer.join()
                assert _finishes(lambda: c.complete(b"p", max_tokens=3).result(), 30), "a call after it hung"
    finally:
        armed.clear()
        signal.signal(signal.SIGINT, before)

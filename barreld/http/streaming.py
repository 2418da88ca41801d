"""One call over HTTP, whatever the API: the engine's events carried from the model's worker to the event loop,
framed by the API's reply shape as one JSON document or as server-sent events with keep-alives.

A call waits for its first event before it answers, so a request refused at start (prompt longer than the
context, unknown model, full queue) gets its own status instead of a 200 with an error in the stream. A client
that hangs up, streaming or not, cancels its request: the worker stops generating.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from barreld.engine.registry import LoadedModel, ModelRegistry
from barreld.engine.reply import Finish, ReplyEvent
from barreld.errors import InvalidArgument
from barreld.http.errors import ApiError, api_error
from barreld.service.calls import Call, Deliver, Outcome, start_call
from barreld.service.metrics import Metrics
from barreld.service.request import CallRequest

MAX_BODY = 16 << 20
PING_SECONDS = 5.0  # keep-alives while a prefill runs, so clients waiting for a token do not time out


class Stream(Protocol):
    """An API's reply shapes, as `run` drives them."""

    ping: bytes
    tail: bytes

    def document(self, finish: Finish) -> dict[str, Any]: ...
    def frames(self, ev: ReplyEvent) -> list[bytes]: ...
    def error(self, error: ApiError) -> bytes: ...


async def run(request: Request, registry: ModelRegistry, metrics: Metrics, call: CallRequest,
              shape: Callable[[LoadedModel], Stream]) -> Response:
    """Runs `call` and answers in the shape `shape` gives for the model that serves it."""
    events = Events(lambda deliver: start_call(registry, call, metrics, "http", deliver))
    try:
        first = await until_disconnected(request, events.cancel, events.next())
        stream = shape(events.loaded)
        if call.stream:
            return StreamingResponse(_sse(events, stream, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finish = first if isinstance(first, Finish) else await until_disconnected(request, events.cancel,
                                                                                  events.finish())
        return JSONResponse(stream.document(finish))
    except BaseException:
        events.cancel()
        raise


async def _sse(events: Events, stream: Stream, ev: ReplyEvent) -> AsyncIterator[bytes]:
    """The stream of events, with a keep-alive every PING_SECONDS while none comes (a long prefill); a failure
    after the first event ends it with an error event (the status line is sent by then)."""
    try:
        while True:
            for frame in stream.frames(ev):
                yield frame
            if isinstance(ev, Finish):
                break
            while (ev := await events.next_within(PING_SECONDS)) is None:
                yield stream.ping
        yield stream.tail
    except Exception as exc:  # noqa: BLE001 - the client hears of it in the stream
        yield stream.error(api_error(exc, "stream"))
    finally:
        events.cancel()


class Mailbox:
    """Items from other threads for one event loop's queues, with one wake of the loop for all that arrive
    before it runs: a worker decoding four streams posts four tokens a step, while it holds the GIL that the
    loop would need to take them, so one wake carries the step, not four. The wake is a byte on a pipe of its
    own: a write to a pipe costs the worker a third of what `call_soon_threadsafe`'s send on the loop's socket
    pair does (20 against 60 microseconds here), and comes once a token while one stream decodes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._lock = threading.Lock()
        self._items: deque[tuple[asyncio.Queue[Outcome], Outcome]] = deque()
        self._woken = False
        self._closed = False
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        loop.add_reader(self._read, self._deliver)
        weakref.finalize(loop, self.close)

    def post(self, queue: asyncio.Queue[Outcome], item: Outcome) -> None:
        """Queues `item` on `queue` in the loop; dropped once the loop is gone (barreld is stopping)."""
        with self._lock:
            if self._closed:
                return
            self._items.append((queue, item))
            if not self._woken:
                self._woken = True
                os.write(self._write, b"\0")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read)
                os.close(self._write)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._woken = False
            os.read(self._read, 64)  # the one byte the first post wrote (the loop runs this only while it lives)
        for queue, item in items:
            queue.put_nowait(item)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def mailbox() -> Mailbox:
    """The running loop's mailbox (made on the loop's own thread, so once)."""
    loop = asyncio.get_running_loop()
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = Mailbox(loop)
    return box


class Events:
    """One call's events, handed by the model's worker straight to the event loop.

    A thread of its own submits the request (finding the model may wait for a load); from then on the
    worker puts each event on the loop, one hop from the token to the socket. The worker delivers every
    event even after the client has gone, so the call counts itself (a cancelled request's tokens too).
    """

    def __init__(self, start: Callable[[Deliver], Call]) -> None:
        self._mailbox = mailbox()
        self._queue: asyncio.Queue[Outcome] = asyncio.Queue()
        self._call: Call | None = None
        self._cancelled = False
        threading.Thread(target=self._start, args=(start,), name="http-call", daemon=True).start()

    @property
    def loaded(self) -> LoadedModel:
        """The model serving the call, known once the first event has arrived."""
        assert self._call is not None
        return self._call.model

    def cancel(self) -> None:
        """The client is gone: stop the call, now or as soon as it has started."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def _start(self, start: Callable[[Deliver], Call]) -> None:
        try:
            self._call = start(self._hand)
        except Exception as exc:  # noqa: BLE001 - raised again on the event loop
            self._hand(None, exc)
            return
        if self._cancelled:
            self._call.cancel()

    def _hand(self, call: Call | None, item: Outcome) -> None:
        if call is not None:
            self._call = call  # before the item: whoever reads it may ask for the model
        self._mailbox.post(self._queue, item)

    async def next(self) -> ReplyEvent:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def next_within(self, seconds: float) -> ReplyEvent | None:
        """The next event, or None when none came within `seconds` (nothing is lost: it waits queued). An event
        already queued is taken at once, without wait_for's task and timer, which most tokens would pay."""
        if not self._queue.empty():
            return await self.next()
        try:
            return await asyncio.wait_for(self.next(), seconds)
        except TimeoutError:
            return None

    async def finish(self) -> Finish:
        while not isinstance(ev := await self.next(), Finish):
            pass
        return ev


def sse_line(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object: 415 unless it says it is JSON, 413 past MAX_BODY (read no further), 400
    when it does not parse or is not an object."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {ctype[:60] or 'none'!r}",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(413, f"request body over {MAX_BODY} bytes", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY} bytes", code="request_too_large")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"the body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"the body must be a JSON object, got {type(doc).__name__}")
    return doc


async def until_disconnected(request: Request, cancel: Callable[[], None], wait: Awaitable[Any]) -> Any:
    """Awaits `wait` while listening for the client hanging up; if it does, `cancel()` is called and
    ClientGone raised (nobody is left to answer). What `wait` raises is raised as it is."""
    outcome: list[Any] = []

    async def listen(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel()
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(listen, tg.cancel_scope)
        try:
            outcome.append(await wait)
        except Exception as exc:  # noqa: BLE001 - raised again outside the task group, as it was
            outcome.append(exc)
        tg.cancel_scope.cancel()
    if not outcome:
        raise ClientGone
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


class ClientGone(Exception):
    """The client hung up before the answer was ready."""

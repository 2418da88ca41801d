"""The Starlette app: OpenAI's and Anthropic's routes under /v1, /health and /metrics, over the same registry,
workers and error rules as the gRPC servicer (barreld.frontend.calls); each route only translates shapes.

A completion waits for the worker's first event before it answers, so a request refused at start (prompt
longer than the context, unknown model, full queue) gets its own status instead of a 200 with an error in
the stream. A client that hangs up, streaming or not, cancels its request: the worker stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from barreld.engine.chat import Message
from barreld.engine.registry import LoadedModel, ModelRegistry
from barreld.engine.request import Done, Started, Token
from barreld.engine.tools import ToolCall, split_calls
from barreld.errors import InvalidArgument, Unavailable
from barreld.frontend.calls import Call, Deliver, Outcome, check_model_name, client_error, start_call
from barreld.frontend.metrics import CONTENT_TYPE, Metrics
from barreld.http.anthropic import PING, MessagesReply, error_doc, event, parse_messages, resent_tool_use
from barreld.http.openai import DONE_LINE, ApiRequest, Reply, parse_request
from barreld.names import DEFAULT_TENANT
from barreld.tenants import Tenants

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20
RETRY_AFTER = {"Retry-After": "1"}
PING_SECONDS = 5.0  # keep-alives while a prefill runs, so clients waiting for a token do not time out
CLIENT_GONE = 499  # logged only: nobody is left to read it
# A domain error's category -> HTTP status, OpenAI error type and code.
STATUS: dict[str, tuple[int, str, str | None]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "FAILED_PRECONDITION": (400, "invalid_request_error", None),
    "NOT_FOUND": (404, "invalid_request_error", "model_not_found"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "queue_full"),
    "UNAVAILABLE": (503, "server_error", "unavailable"),
}


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code

    def doc(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.code}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        """The answer in OpenAI's shape, or in Anthropic's for the Messages API."""
        headers = RETRY_AFTER if self.status in (429, 503) else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        doc = error_doc(self.status, self.message) if anthropic else self.doc()
        return JSONResponse(doc, self.status, headers=headers)


def api_error(exc: Exception, where: str) -> ApiError:
    """The answer to an exception raised while serving `where`; a bug is logged and answered 500."""
    if isinstance(exc, ApiError):
        return exc
    known = client_error(exc)
    if known is not None and known.code in STATUS:
        status, kind, code = STATUS[known.code]
        return ApiError(status, str(known), kind, code)
    if known is None:
        log.error("%s failed", where, exc_info=exc)
    return ApiError(500, f"internal error in {where}: {exc}; see the daemon log", "server_error", "internal_error")


@dataclass
class DaemonState:
    """What the app asks of the daemon around it."""

    ready: Callable[[], bool]  # the configured models are loaded
    stopping: Callable[[], bool]
    previous_death: str | None = None  # how the daemon before this one on the socket died, if it did


class HttpApi:
    def __init__(
        self,
        registry: ModelRegistry,
        metrics: Metrics,
        state: DaemonState,
        tenants: Tenants | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.state = state
        self.tenants = tenants or Tenants()
        routes = [
            Route("/health", self._guard(self.health, auth=False), methods=["GET"]),
            Route("/metrics", self._guard(self.metrics_text), methods=["GET"]),
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/v1/models/{name}", self._guard(self.model), methods=["GET"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guard(self.chat_completions), methods=["POST"]),
            Route("/v1/messages", self._guard(self.messages, anthropic=True), methods=["POST"]),
            Route("/v1/messages/count_tokens", self._guard(self.count_tokens, anthropic=True), methods=["POST"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_exception})

    # ---- plumbing ---------------------------------------------------------------------------------

    def _guard(
        self, handler: Callable[[Request], Awaitable[Response]], auth: bool = True, anthropic: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        """Checks the key and notes its tenant (`request.state.tenant`), then runs the handler; whatever it
        raises is answered in the route's own shape (OpenAI's, or Anthropic's for the Messages API)."""

        async def endpoint(request: Request) -> Response:
            try:
                request.state.tenant = self._authorize(request) if auth else DEFAULT_TENANT
                return await handler(request)
            except ClientGone:
                return Response(status_code=CLIENT_GONE)
            except Exception as exc:  # noqa: BLE001 - every error is answered, none takes the daemon down
                return api_error(exc, request.url.path).response(anthropic)

        return endpoint

    def _authorize(self, request: Request) -> str:
        """The tenant of the key sent as a bearer token or as Anthropic's x-api-key (see `Tenants.identify`);
        without keys, the default tenant."""
        if not self.tenants.guarded:
            return DEFAULT_TENANT
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if "x-api-key" in request.headers:
            scheme, given = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "missing API key: send Authorization: Bearer KEY (or x-api-key: KEY)",
                           code="invalid_api_key")
        tenant = self.tenants.identify(given.strip().encode())
        if tenant is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key")
        return tenant

    def _owned(self, request: Request, req: ApiRequest) -> ApiRequest:
        """The request in its tenant's namespace, with its salt: what it may find in the cache, and where its
        states are stored."""
        return dataclasses.replace(req, namespace=self.tenants.namespace(request.state.tenant, req.cache_salt))

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        """Unknown paths and wrong methods, in the same error shape as everything else."""
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    def _check_open(self) -> None:
        if self.state.stopping():
            raise Unavailable("barreld is shutting down; retry in a moment")
        if not self.state.ready():
            raise ApiError(503, "barreld is loading its models; retry in a moment", "server_error", "loading")

    # ---- routes -----------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.state.stopping():
            return JSONResponse({"status": "stopping"}, 503, headers=RETRY_AFTER)
        if not self.state.ready():
            return JSONResponse({"status": "loading"}, 503, headers=RETRY_AFTER)
        body = {"status": "ok"}
        if self.state.previous_death:
            body["previous_run"] = self.state.previous_death
        return JSONResponse(body)

    async def metrics_text(self, request: Request) -> Response:
        body = await anyio.to_thread.run_sync(self.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_doc(m) for m in self.registry.models()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["name"]
        for m in self.registry.models():
            if m.name == name:
                return JSONResponse(model_doc(m))
        raise ApiError(404, f"model {name[:80]!r} is not loaded", code="model_not_found")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, chat: bool) -> Response:
        self._check_open()
        req = self._owned(request, parse_request(await read_json(request), chat))
        return await self._run(request, req, lambda model: OpenAIStream(Reply(req, model)))

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API over the same calls as the OpenAI routes."""
        self._check_open()
        req = self._owned(request, parse_messages(await read_json(request)))
        return await self._run(request, req, lambda model: AnthropicStream(MessagesReply(req, model)))

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's length in tokens as /v1/messages would render it; nothing runs on the model."""
        self._check_open()
        req = parse_messages(await read_json(request), counting=True)

        def count() -> int:
            check_model_name(req.model)
            model = self.registry.get(req.model)
            return model.worker.count_tokens(req.params(model.options.n_ctx))

        return JSONResponse({"input_tokens": await anyio.to_thread.run_sync(count)})

    async def _run(self, request: Request, req: ApiRequest, shape: Callable[[str], Stream]) -> Response:
        events = Events(lambda deliver: start_call(self.registry, req.model, req.params, self.metrics, "http", deliver))
        try:
            first = await until_disconnected(request, events.cancel, events.next())
            stream = shape(events.model)
            if req.stream:
                return StreamingResponse(self._sse(events, stream, req, first), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            done = first if isinstance(first, Done) else await until_disconnected(request, events.cancel,
                                                                                  events.done())
            return JSONResponse(stream.document(await self._checked(events, req, stream, done)))
        except BaseException:
            events.cancel()
            raise

    @staticmethod
    async def _checked(events: Events, req: ApiRequest, stream: Stream, done: Done) -> Done:
        """The reply, with whether it keeps the prefix when it called tools (a template's render, off the loop)."""
        if req.tools is None or not req.messages:
            return done
        kept = await anyio.to_thread.run_sync(prefix_kept, events.loaded, req, events.prompt, done, stream.resend)
        return done if kept is None else dataclasses.replace(done, prefix_kept=kept)

    async def _sse(self, events: Events, stream: Stream, req: ApiRequest,
                   ev: Started | Token | Done) -> AsyncIterator[bytes]:
        """The stream of events, with a keep-alive every PING_SECONDS while none comes (a long prefill); a
        failure after the first event ends it with an error event (the status line is sent by then)."""
        try:
            while True:
                if isinstance(ev, Done):
                    ev = await self._checked(events, req, stream, ev)
                for frame in stream.frames(ev):
                    yield frame
                if isinstance(ev, Done):
                    break
                while (ev := await events.next_within(PING_SECONDS)) is None:
                    yield stream.ping
            yield stream.tail
        except Exception as exc:  # noqa: BLE001 - the client hears of it in the stream
            yield stream.error(api_error(exc, "stream"))
        finally:
            events.cancel()


def prefix_kept(model: LoadedModel, req: ApiRequest, prompt: bytes, done: Done,
                resend: Callable[[ToolCall], ToolCall]) -> bool | None:
    """Whether a reply that called tools, sent back in the history as the route's clients send it (`resend`),
    renders through the model's template to the bytes it was generated from (`prompt`, as the worker rendered
    it, then the reply), so that the next turn restores through it; None for a reply without calls."""
    assert req.tools is not None
    content, calls = split_calls(done.text.decode("utf-8", "replace"), req.tools)
    if not calls:
        return None
    params = req.params(model.options.n_ctx)
    turn = Message("assistant", content, tuple(resend(c) for c in calls))
    after = model.worker.render(dataclasses.replace(params, messages=(*params.messages, turn)))
    return after.startswith(prompt + done.text)


class Stream(Protocol):
    """A route's reply shapes, as the shared loop drives them; `resend` is a call as the route's clients send
    it back in the history."""

    ping: bytes
    tail: bytes

    def resend(self, call: ToolCall) -> ToolCall: ...

    def document(self, done: Done) -> dict[str, Any]: ...
    def frames(self, ev: Started | Token | Done) -> list[bytes]: ...
    def error(self, error: ApiError) -> bytes: ...


@dataclass
class OpenAIStream:
    reply: Reply
    ping: bytes = b": keep-alive\n\n"
    tail: bytes = DONE_LINE

    @staticmethod
    def resend(call: ToolCall) -> ToolCall:
        return call  # OpenAI's clients send `arguments` back as the text they were given

    def document(self, done: Done) -> dict[str, Any]:
        return self.reply.document(done)

    def frames(self, ev: Started | Token | Done) -> list[bytes]:
        return [sse_line(chunk) for chunk in self.reply.chunks(ev)]

    def error(self, error: ApiError) -> bytes:
        return sse_line(error.doc())


@dataclass
class AnthropicStream:
    reply: MessagesReply
    ping: bytes = PING
    tail: bytes = b""

    @staticmethod
    def resend(call: ToolCall) -> ToolCall:
        return resent_tool_use(call)

    def document(self, done: Done) -> dict[str, Any]:
        return self.reply.document(done)

    def frames(self, ev: Started | Token | Done) -> list[bytes]:
        return self.reply.events(ev)

    def error(self, error: ApiError) -> bytes:
        return event("error", {"error": error_doc(error.status, error.message)["error"]})


class Events:
    """One call's events, handed by the model's worker straight to the event loop.

    A thread of its own submits the request (finding the model may wait for a load); from then on the
    worker puts each event on the loop, one hop from the token to the socket. The worker delivers every
    event even after the client has gone, so the call counts itself (a cancelled request's tokens too).
    """

    def __init__(self, start: Callable[[Deliver], Call]) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Outcome] = asyncio.Queue()
        self._call: Call | None = None
        self._cancelled = False
        threading.Thread(target=self._start, args=(start,), name="http-call", daemon=True).start()

    @property
    def model(self) -> str:
        """The model's name, known once the first event has arrived."""
        return self.loaded.name

    @property
    def prompt(self) -> bytes:
        """The prompt's bytes as the worker rendered them, known once the first event has arrived."""
        assert self._call is not None
        return self._call.request.params.prompt

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
        """Queues `item` for the event loop, unless the loop has closed (barreld is stopping)."""
        if call is not None:
            self._call = call  # before the item: whoever reads it may ask for the model
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def next(self) -> Started | Token | Done:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def next_within(self, seconds: float) -> Started | Token | Done | None:
        """The next event, or None when none came within `seconds` (nothing is lost: it waits queued). An event
        already queued is taken at once, without wait_for's task and timer, which most tokens would pay."""
        if not self._queue.empty():
            return await self.next()
        try:
            return await asyncio.wait_for(self.next(), seconds)
        except TimeoutError:
            return None

    async def done(self) -> Done:
        while not isinstance(ev := await self.next(), Done):
            pass
        return ev


def model_doc(m: LoadedModel) -> dict[str, Any]:
    try:
        created = int(m.path.stat().st_mtime)
    except OSError:
        created = 0
    return {"id": m.name, "object": "model", "created": created, "owned_by": "barrel"}


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

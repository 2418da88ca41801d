"""The Starlette app: each API's routes (OpenAI's chat and completions, OpenAI's Responses, Anthropic's Messages),
with and without /v1, beside /health and /metrics, over one registry. Each API module turns its body into the
one request type and the engine's reply events into its frames; this module only routes, checks the caller's
key and answers errors in the route's own shape.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from barreld.engine.registry import LoadedModel, ModelRegistry
from barreld.engine.tools import SchemaChecks
from barreld.errors import Unavailable
from barreld.http.anthropic import MessagesReply, error_doc, parse_messages
from barreld.http.errors import RETRY_AFTER, ApiError, api_error
from barreld.http.openai import Reply, parse_request
from barreld.http.responses import ResponsesRoutes, ResponseStore
from barreld.http.streaming import ClientGone, read_json, run
from barreld.names import DEFAULT_TENANT
from barreld.service.calls import check_model_name
from barreld.service.metrics import CONTENT_TYPE, Metrics
from barreld.service.request import CallRequest
from barreld.tenants import Tenants

CLIENT_GONE = 499  # logged only: nobody is left to read it
ErrorShape = Callable[[ApiError], dict[str, Any]]


def openai_error(error: ApiError) -> dict[str, Any]:
    return error.doc()


def anthropic_error(error: ApiError) -> dict[str, Any]:
    return error_doc(error.status, error.message)


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
        responses: ResponseStore | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.state = state
        self.tenants = tenants or Tenants()
        self.schema_checks: defaultdict[str, SchemaChecks] = defaultdict(SchemaChecks)  # a tenant's own
        responses_api = ResponsesRoutes(self._guard, self._check_open, self._run,
                                        lambda call: count_tokens(self.registry, call),
                                        responses or ResponseStore(None))
        routes = [
            Route("/health", self._guard(self.health, auth=False), methods=["GET"]),
            Route("/metrics", self._guard(self.metrics_text), methods=["GET"]),
            *self._versioned(
                Route("/models", self._guard(self.models), methods=["GET"]),
                Route("/models/{name}", self._guard(self.model), methods=["GET"]),
                Route("/completions", self._guard(self.completions), methods=["POST"]),
                Route("/chat/completions", self._guard(self.chat_completions), methods=["POST"]),
                Route("/messages", self._guard(self.messages, anthropic_error), methods=["POST"]),
                Route("/messages/count_tokens", self._guard(self.count_tokens, anthropic_error), methods=["POST"]),
                *responses_api.routes(),
            ),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_exception})

    @staticmethod
    def _versioned(*routes: Route) -> list[Route]:
        """Each API route under /v1, and also without it: llama.cpp's server answers both, and clients use both."""
        return [r for route in routes for r in (Route("/v1" + route.path, route.endpoint, methods=route.methods),
                                                route)]

    # ---- plumbing ---------------------------------------------------------------------------------

    def _guard(self, handler: Callable[[Request], Awaitable[Response]], shape: ErrorShape = openai_error,
               auth: bool = True) -> Callable[[Request], Awaitable[Response]]:
        """Checks the key and notes its tenant (`request.state.tenant`, and its tool schema verdicts as
        `request.state.schema_checks`), then runs the handler; whatever it raises is answered in the route's own
        shape (`shape`: OpenAI's, or Anthropic's for the Messages API)."""

        async def endpoint(request: Request) -> Response:
            try:
                tenant = request.state.tenant = self._authorize(request) if auth else DEFAULT_TENANT
                request.state.schema_checks = self.schema_checks[tenant]
                return await handler(request)
            except ClientGone:
                return Response(status_code=CLIENT_GONE)
            except Exception as exc:  # noqa: BLE001 - every error is answered, none takes the daemon down
                error = api_error(exc, request.url.path)
                return error.response(shape(error))

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

    def _owned(self, request: Request, call: CallRequest) -> CallRequest:
        """The request in its tenant's namespace, with its salt: what it may find in the cache, and where its
        states are stored."""
        return dataclasses.replace(call, namespace=self.tenants.namespace(request.state.tenant, call.cache_salt))

    async def _run(self, request: Request, call: CallRequest, shape: Callable[[LoadedModel], Any]) -> Response:
        return await run(request, self.registry, self.metrics, self._owned(request, call), shape)

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
        req = parse_request(await read_json(request), chat, request.state.schema_checks)
        return await self._run(request, req.call, lambda model: Reply(req, model))

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API over the same calls as the OpenAI routes."""
        self._check_open()
        call = parse_messages(await read_json(request), checks=request.state.schema_checks)
        return await self._run(request, call, MessagesReply)

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's length in tokens as /v1/messages would render it; nothing runs on the model."""
        self._check_open()
        call = parse_messages(await read_json(request), counting=True, checks=request.state.schema_checks)
        return JSONResponse({"input_tokens": await count_tokens(self.registry, call)})


async def count_tokens(registry: ModelRegistry, call: CallRequest) -> int:
    """The prompt's length in tokens, rendered as the call would render it (off the event loop)."""

    def count() -> int:
        check_model_name(call.model)
        model = registry.get(call.model)
        return model.worker.count_tokens(call.params(model.options.n_ctx))

    return await anyio.to_thread.run_sync(count)


def model_doc(m: LoadedModel) -> dict[str, Any]:
    try:
        created = int(m.path.stat().st_mtime)
    except OSError:
        created = 0
    return {"id": m.name, "object": "model", "created": created, "owned_by": "barrel"}

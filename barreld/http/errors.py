"""How every HTTP API answers an error: OpenAI's shape by default, each API's own where it has one."""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

from barreld.errors import ContextLengthExceeded
from barreld.service.calls import client_error

log = logging.getLogger("barreld.http")

RETRY_AFTER = {"Retry-After": "1"}
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

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def doc(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str] | None:
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        return RETRY_AFTER if self.status in (429, 503) else None

    def response(self, doc: dict[str, Any] | None = None) -> JSONResponse:
        """The answer: OpenAI's document, or `doc` for an API with its own shape."""
        return JSONResponse(self.doc() if doc is None else doc, self.status, headers=self.headers())


def api_error(exc: Exception, where: str) -> ApiError:
    """The answer to an exception raised while serving `where`; a bug is logged and answered 500."""
    if isinstance(exc, ApiError):
        return exc
    known = client_error(exc)
    if known is not None and known.code in STATUS:
        status, kind, code = STATUS[known.code]
        if isinstance(known, ContextLengthExceeded):
            code = "context_length_exceeded"
        return ApiError(status, str(known), kind, code)
    if known is None:
        log.error("%s failed", where, exc_info=exc)
    return ApiError(500, f"internal error in {where}: {exc}; see the daemon log", "server_error", "internal_error")

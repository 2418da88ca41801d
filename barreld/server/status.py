"""The one place where domain errors become gRPC status codes."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import grpc

from barreld.cache.errors import IndexWriteError
from barreld.errors import BarrelError, FailedPrecondition

log = logging.getLogger(__name__)


def grpc_code(exc: BarrelError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


def rpc(method: Callable) -> Callable:
    """Wraps a servicer method: a BarrelError aborts the call with its code and message; anything else
    is logged with its traceback and answered INTERNAL, and never takes the daemon down."""

    def fail(context: grpc.ServicerContext, exc: Exception) -> None:
        if isinstance(exc, IndexWriteError):
            exc = FailedPrecondition(f"{exc}; free space where the data dir lives, then retry")
        if isinstance(exc, BarrelError):
            context.abort(grpc_code(exc), str(exc))
        log.exception("%s failed", method.__name__)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {exc}; see the daemon log")

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - every error is answered, none kills the daemon
                if context.is_active():
                    fail(context, exc)

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            fail(context, exc)

    return unary

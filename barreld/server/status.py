"""The one place where domain errors become gRPC status codes (`client_error` decides what a client is told)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import grpc

from barreld.errors import BarrelError
from barreld.service.calls import client_error

log = logging.getLogger(__name__)


def grpc_code(exc: BarrelError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


def rpc(method: Callable) -> Callable:
    """Wraps a servicer method: the servicer's `admit(context)` runs first (who may call at all); a BarrelError
    aborts the call with its code and message; anything else is logged with its traceback and answered
    INTERNAL, and never takes the daemon down."""

    def fail(context: grpc.ServicerContext, exc: Exception) -> None:
        known = client_error(exc)
        if known is not None:
            context.abort(grpc_code(known), str(known))
        log.exception("%s failed", method.__name__)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {exc}; see the daemon log")

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self, request, context):
            try:
                self.admit(context)
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - every error is answered, none kills the daemon
                if context.is_active():
                    fail(context, exc)

        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            self.admit(context)
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            fail(context, exc)

    return unary

"""The gRPC server on barreld's Unix socket: it parses requests itself and hands them to the servicer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from barreld.lifecycle import StartupError, prepare_socket
from barreld.rpc import barrel_pb2 as pb
from barreld.rpc import barrel_pb2_grpc as pb_grpc

MAX_MESSAGE = 64 * 1024 * 1024


def _parsed(impl, request_type):
    def call(raw: bytes, context: grpc.ServicerContext):
        try:
            request = request_type.FromString(raw)
        except DecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}: {exc}")
        return impl(request, context)

    return call


def parsing_handler(servicer: pb_grpc.BarrelServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, parsing requests themselves: bytes that are not a valid request get
    INVALID_ARGUMENT with a message, where gRPC's own deserializer would answer INTERNAL."""
    service = pb.DESCRIPTOR.services_by_name["Barrel"]
    handlers = {}
    for method in service.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            _parsed(getattr(servicer, method.name), getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


class GrpcServer:
    def __init__(
        self, servicer: pb_grpc.BarrelServicer, socket: Path, *, group: int | None = None, workers: int = 32
    ) -> None:
        self.socket = socket
        self.group = group
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)],
        )
        self._server.add_generic_rpc_handlers((parsing_handler(servicer),))

    def start(self, before_serving: Callable[[], None] = lambda: None) -> None:
        """Listens on the socket; `before_serving` runs once its directory is ready, before any call is taken
        (the identity socket starts there, so no client finds the one without the other)."""
        prepare_socket(self.socket, self.group)
        old = os.umask(0o177)
        try:
            bound = self._server.add_insecure_port(f"unix:{self.socket}")
        finally:
            os.umask(old)
        if not bound:
            raise StartupError(f"cannot listen on {self.socket}")
        if self.group is not None:
            os.chown(self.socket, -1, self.group)
            os.chmod(self.socket, 0o660)
        else:
            os.chmod(self.socket, 0o600)
        before_serving()
        self._server.start()

    def stop_accepting(self) -> None:
        """Removes the socket first, so no client races a dying daemon, then stops taking new calls."""
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def stop(self, grace: float) -> None:
        self._server.stop(grace).wait(grace + 1)

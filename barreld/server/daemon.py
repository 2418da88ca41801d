"""barreld's lifecycle: data-dir lock, socket, gRPC server, signals, and an orderly shutdown."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import socket as socketlib
import threading
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from barreld.paths import private_dir, socket_answers
from barreld.rpc import barrel_pb2 as pb
from barreld.rpc import barrel_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 * 1024 * 1024
LOCK_NAME = "barreld.lock"


class StartupError(Exception):
    """barreld cannot start; the message is the one line printed before exiting 1."""


class DataDirLock:
    """An exclusive flock on <data_dir>/barreld.lock holding the owner's pid: one daemon per data dir.

    flock dies with its process, so a SIGKILLed daemon never leaves a stale lock behind.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StartupError(
                f"data dir {self.path.parent} is in use by barreld pid {holder}; "
                f"stop it (`barrelctl daemon stop`) or pass another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def prepare_socket(path: Path, group: int | None = None) -> None:
    """Creates the socket's directory (0700, or 0750 with a group) and removes a stale socket file."""
    parent = path.parent
    if not parent.exists():
        private_dir(parent)
    st = parent.stat()
    if st.st_uid != os.getuid():
        raise StartupError(f"socket directory {parent} belongs to uid {st.st_uid}, not to us; choose another")
    if group is not None:
        os.chown(parent, -1, group)
        os.chmod(parent, 0o750)
    elif st.st_mode & 0o077:
        os.chmod(parent, 0o700)
    if path.exists() or path.is_symlink():
        if socket_answers(path):
            raise StartupError(f"another process already answers on {path}; stop it or choose another path")
        path.unlink()


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

    def start(self) -> None:
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
        self._server.start()

    def stop_accepting(self) -> None:
        """Removes the socket first, so no client races a dying daemon, then stops taking new calls."""
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def stop(self, grace: float) -> None:
        self._server.stop(grace).wait(grace + 1)


def notify_systemd(message: str) -> None:
    """sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET, if systemd gave us one."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM) as s:
        s.connect(addr)
        s.send(message.encode())


class ShutdownSignal:
    """SIGTERM/SIGINT (or a Shutdown RPC) set one event the main thread waits on."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        self.event.set()

    def request(self) -> None:
        self.event.set()

    def wait(self) -> None:
        while not self.event.wait(1.0):
            pass

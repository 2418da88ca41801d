"""The one client of barreld: find its socket, start it when nobody answers, and call it through typed
methods. Every failed call raises ClientError, which carries the gRPC status, the daemon's message and
the exit code the contract gives that status.

grpc and the generated modules are imported on first use, so that `barrelctl --help` stays instant.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from barrelctl.errors import ClientError, DaemonDied
from barreld.deaths import find_death
from barreld.engine.chat import Message
from barreld.engine.divergence import Divergence
from barreld.paths import SYSTEM_SOCKET, default_socket, locked, peer_token, private_dir, socket_answers

if TYPE_CHECKING:
    import grpc

    from barreld.rpc import barrel_pb2 as pb

READY_TIMEOUT = 60.0
# How gRPC describes a connection that broke under a call (the daemon's own UNAVAILABLE errors say more).
BROKEN = ("socket closed", "stream removed", "connection reset", "broken pipe", "failed to connect", "eof")
MAX_MESSAGE = 64 << 20  # a cache dump of many rows is larger than gRPC's 4 MiB default


def _pb() -> Any:
    from barreld.rpc import barrel_pb2

    return barrel_pb2


def forbidden(path: Path) -> ClientError | None:
    """An error naming the socket's owner when this user may not use it (another user's daemon)."""
    import pwd

    try:
        st = path.stat()
        if os.access(path, os.R_OK | os.W_OK):
            return None
    except FileNotFoundError:
        return None
    except PermissionError:  # a directory on the way is closed to us: its owner is the socket's
        st = next(p.stat() for p in path.parents if os.access(p, os.F_OK))
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    who = "root" if owner == "root" else f"{owner} or root"
    return _unreachable(
        f"cannot use barreld's socket {path}: permission denied (it belongs to {owner}); run barrelctl as {who}, "
        f"pass --socket to your own daemon's, or ask for a [daemon] socket_group you are in"
    )


def _answers(path: Path, timeout: float = 5.0) -> bool:
    """Whether a daemon answers on path. A socket nobody listens on refuses at once, so only a live daemon
    is given `timeout` to answer: a busy machine can keep one from answering within a second."""
    import grpc

    if not os.access(path, os.F_OK) or forbidden(path) is not None or not socket_answers(path):
        return False
    channel = grpc.insecure_channel(f"unix:{path}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def rpc_error(exc: grpc.RpcError) -> ClientError:
    """The one mapping of a failed call; a refused connection reads as an unreachable daemon."""
    status = exc.code().name
    details = exc.details() or ""
    if status == "UNAVAILABLE" and "connect" in details.lower():
        return ClientError(status, details, f"barreld is not reachable: {details}")
    return ClientError(status, details)


def _unreachable(message: str) -> ClientError:
    return ClientError("UNAVAILABLE", "", message)


def call_error(exc: grpc.RpcError, socket: Path, model: str | None = None) -> ClientError:
    """rpc_error, unless the connection broke because the daemon died: then DaemonDied says of what."""
    error = rpc_error(exc)
    if error.status == "UNAVAILABLE" and any(w in error.details.lower() for w in BROKEN):
        death = find_death(socket, model)
        if death is not None:
            return DaemonDied(error.details, death.sentence())
    return error


def _mapped(events: Iterable[Any], socket: Path, model: Callable[[], str | None] = lambda: None) -> Iterator[Any]:
    """The events of a streaming call, a failure part-way mapped like any other."""
    import grpc

    try:
        yield from events
    except grpc.RpcError as exc:
        raise call_error(exc, socket, model()) from None


POLL_S = 0.1  # how long the main thread may wait before a pending Ctrl-C gets through


def _received(events: Iterable[Any]) -> Iterator[tuple[float, Any]]:
    """The events of a call with the time each arrived, read on a thread of their own.

    A Ctrl-C raises KeyboardInterrupt in the main thread at any point of the Python code it runs. Raised in
    gRPC's code, it can land just after one of gRPC's locks was taken (`Condition.__enter__` is Python) and
    leave that lock held, and every later call on the channel then hangs: a chat that goes on after a Ctrl-C
    would wait for its next reply forever. So the main thread only waits on a C queue, in short waits, where
    the interrupt lands in this function and holds nothing."""
    box: queue.SimpleQueue[tuple[str, float, Any]] = queue.SimpleQueue()

    def read() -> None:
        try:
            for ev in events:
                box.put(("event", time.perf_counter(), ev))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            box.put(("error", 0.0, exc))
        else:
            box.put(("end", 0.0, None))

    threading.Thread(target=read, name="barrelctl-events", daemon=True).start()
    while True:
        try:
            kind, at, item = box.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if kind == "end":
            return
        if kind == "error":
            raise item
        yield at, item


@dataclass(frozen=True)
class ReplyStarted:
    """The daemon has taken the request: how much of the prompt came warm, by which lookup route."""

    route: str  # exact | resume | longest_prefix | live | miss
    tier: str | None  # where a restored state came from; None when none came from a tier
    restored: int
    prefilled: int
    prompt_tokens: int
    prompt_key: str


@dataclass(frozen=True)
class ReplyToken:
    text: bytes  # may split a UTF-8 character: concatenate before decoding


@dataclass(frozen=True)
class Completion:
    """A finished completion: the daemon's report, and the times this client saw."""

    text: bytes
    model: str
    finish_reason: str  # stop | length | cancelled
    key: str  # the next turn's parent_key
    prompt_key: str
    route: str
    tier: str | None
    restored: int
    prefilled: int
    prompt_tokens: int
    completion_tokens: int
    timings_ms: dict[str, float]  # the daemon's: lookup, restore, prefill, ttft, total
    client_ttft_ms: float  # the call to its first token (to its end when no token carried text)
    client_total_ms: float
    logprobs: tuple[Any, ...] = ()  # pb.TokenLogprob per token of the text, when asked for
    divergence: Divergence | None = None  # on a miss or partial hit: where the prompt stopped matching


def _divergence(cache: pb.CacheInfo) -> Divergence | None:
    if not cache.HasField("divergence"):
        return None
    d = cache.divergence
    return Divergence(d.matched_tokens, d.matched_bytes, d.cached, d.prompt, d.against)


class CompletionStream:
    """A Complete call in flight: iterating yields its ReplyStarted and ReplyToken events as they arrive,
    `result()` waits for its end, `cancel()` ends it early (the daemon then frees its place)."""

    def __init__(self, call: Any, socket: Path, model: str) -> None:
        self._call = call
        self._socket = socket
        self._model = model or None  # the daemon names it when it starts: an empty request means its default
        self._t0 = time.perf_counter()
        self._first: float | None = None
        self._result: Completion | None = None

    def __iter__(self) -> Iterator[ReplyStarted | ReplyToken]:
        for at, ev in _received(_mapped(self._call, self._socket, lambda: self._model)):
            kind = ev.WhichOneof("event")
            if kind == "token":
                if self._first is None:
                    self._first = at
                yield ReplyToken(ev.token.text)
            elif kind == "started":
                s, c = ev.started, ev.started.cache
                self._model = s.model or self._model
                yield ReplyStarted(c.path, c.tier or None, c.restored_tokens, c.prefilled_tokens, s.prompt_tokens,
                              s.prompt_key)
            else:
                self._result = self._completion(ev.done, at)

    def _completion(self, done: pb.CompleteDone, end: float) -> Completion:
        c, t = done.cache, done.timings_ms
        return Completion(
            text=done.text,
            model=done.model,
            finish_reason=done.finish_reason,
            key=done.key,
            prompt_key=done.prompt_key,
            route=c.path,
            tier=c.tier or None,
            restored=c.restored_tokens,
            prefilled=c.prefilled_tokens,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            timings_ms={f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields},
            client_ttft_ms=((self._first or end) - self._t0) * 1000,
            client_total_ms=(end - self._t0) * 1000,
            logprobs=tuple(done.logprobs),
            divergence=_divergence(c),
        )

    def result(self) -> Completion:
        for _ in self:
            pass
        if self._result is None:
            raise ClientError("UNKNOWN", "", "the daemon closed the stream without finishing the completion")
        return self._result

    def cancel(self) -> None:
        self._call.cancel()


class Client:
    """One channel to one daemon, opened on the first call.

    `socket` None means $BARREL_SOCKET, else the per-user default, falling back to the system daemon's
    socket when only that one answers. `autostart` starts barreld in the background when none answers.
    """

    def __init__(self, socket: Path | None = None, *, autostart: bool = False) -> None:
        self.explicit = socket is not None or bool(os.environ.get("BARREL_SOCKET"))
        self.socket = socket or default_socket()
        self.autostart = autostart
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._metadata: tuple[tuple[str, str], ...] = ()  # the peer token that proves this process's user
        self._lock = threading.Lock()  # threads may share a client: one of them connects

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def channel(self) -> grpc.Channel:
        """The connected channel, for requests that no typed method builds (malformed bytes in tests)."""
        self._connected()
        return self._channel

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None

    # ---- the calls ----------------------------------------------------------------------------------

    def complete(
        self,
        prompt: bytes,
        *,
        model: str = "",
        max_tokens: int | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        parent_key: str = "",
        chat: bool = False,
        messages: Sequence[Message] = (),
        chat_template: str = "",
        sampling: Mapping[str, Any] | None = None,
        logprobs: int | None = None,
        explain: bool = False,
        cache_salt: str = "",
        tenant: str = "",
        timeout: float | None = None,
    ) -> CompletionStream:
        """Starts a completion of `prompt`, or of `messages` (then pass an empty prompt) rendered by the model's
        chat template or `chat_template`; None leaves max_tokens to the daemon's default and the sampler
        unseeded. `sampling` holds the Sampling message's fields (top_k, ..., grammar, json_schema). With
        `explain`, nothing runs: the result says what would be restored and where the prompt left the closest
        text held. `cache_salt` separates requests further within the caller's tenant; `tenant` (the daemon's
        own user only) looks up as a tenant of the HTTP keys file."""
        pb = _pb()
        request = pb.CompleteRequest(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                     seed=seed, stop=list(stop), parent_key=parent_key, chat=chat,
                                     messages=[pb.Message(role=m.role, content=m.content) for m in messages],
                                     chat_template=chat_template, sampling=pb.Sampling(**(sampling or {})),
                                     logprobs=logprobs, explain=explain, cache_salt=cache_salt, tenant=tenant)
        return CompletionStream(self._call("Complete", request, timeout), self.socket, model)

    def load(
        self,
        name: str,
        *,
        path: str = "",
        tier: str = "",
        n_ctx: int = 0,
        n_batch: int = 0,
        n_seq_max: int = 0,
        policy: Mapping[str, str] | None = None,
        fingerprint: str = "",
        n_threads: int | None = None,
        n_gpu_layers: int | None = None,
        flash_attn: bool | None = None,
        type_k: str = "",
        type_v: str = "",
        swa_full: bool | None = None,
        aliases: Sequence[str] = (),
        stop: Sequence[str] = (),
        timeout: float | None = None,
    ) -> pb.ModelInfo:
        """Loads a model under `name`; an empty, zero or None field takes the daemon's default."""
        knobs = {k: v for k, v in (("n_threads", n_threads), ("n_gpu_layers", n_gpu_layers),
                                   ("flash_attn", flash_attn), ("swa_full", swa_full)) if v is not None}
        request = _pb().LoadModelRequest(name=name, path=path, tier=tier, n_ctx=n_ctx, n_batch=n_batch,
                                         n_seq_max=n_seq_max, policy=dict(policy or {}), fingerprint=fingerprint,
                                         type_k=type_k, type_v=type_v, aliases=list(aliases), stop=list(stop),
                                         **knobs)
        return self._call("LoadModel", request, timeout)

    def unload(self, name: str, *, timeout: float | None = None) -> int:
        """Frees a model after its shutdown saves; how many it saved."""
        return self._call("UnloadModel", _pb().UnloadModelRequest(name=name), timeout).saved

    def models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        return list(self._call("ListModels", _pb().ListModelsRequest(), timeout).models)

    def cache_dump(self, *, model: str = "", tier: str = "", tenant: str | None = None,
                   timeout: float | None = None) -> list[pb.CacheRow]:
        """Every row (of `tenant`, when given; "" is the daemon's own user) the caller may see."""
        request = _pb().CacheDumpRequest(model=model, tier=tier, tenant=tenant)
        return list(self._call("CacheDump", request, timeout).rows)

    def cache_stats(self, *, timeout: float | None = None) -> pb.CacheStatsReply:
        return self._call("CacheStats", _pb().CacheStatsRequest(), timeout)

    def cache_gc(self, *, tiers: Sequence[str] = (), timeout: float | None = None) -> int:
        """Evicts every unreferenced row of `tiers` (empty: every local tier); how many."""
        return self._call("CacheGc", _pb().CacheGcRequest(tiers=list(tiers)), timeout).evicted

    def cache_evict_bytes(
        self, n: int, *, tiers: Sequence[str] = (), timeout: float | None = None
    ) -> pb.CacheEvictBytesReply:
        """Frees at least n bytes, least recently used first, from `tiers` (empty: every local tier)."""
        return self._call("CacheEvictBytes", _pb().CacheEvictBytesRequest(bytes=n, tiers=list(tiers)), timeout)

    def cache_verify(
        self, *, progress: Callable[[int, int], None] | None = None, timeout: float | None = None
    ) -> pb.CacheVerifyResult:
        """Re-reads every row (the daemon drops bad ones); `progress(done, total)` as it goes."""
        result = None
        for ev in _mapped(self._call("CacheVerify", _pb().CacheVerifyRequest(), timeout), self.socket):
            if ev.WhichOneof("event") == "result":
                result = ev.result
            elif progress is not None:
                progress(ev.progress.done, ev.progress.total)
        if result is None:
            raise ClientError("UNKNOWN", "", "the daemon closed the verify stream without a result")
        return result

    def scheduler_status(self, *, timeout: float | None = None) -> dict[str, Any]:
        return json.loads(self._call("SchedulerStatus", _pb().SchedulerStatusRequest(), timeout).status_json)

    def daemon_status(self, *, timeout: float | None = None) -> pb.DaemonStatusReply:
        return self._call("DaemonStatus", _pb().DaemonStatusRequest(), timeout)

    def shutdown(self, *, timeout: float | None = None) -> None:
        """Asks the daemon to stop cleanly; it answers before it has gone."""
        self._call("Shutdown", _pb().ShutdownRequest(), timeout)

    def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        import grpc

        stub = self._connected()
        try:
            return getattr(stub, method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise call_error(exc, self.socket) from None

    # ---- finding the daemon -------------------------------------------------------------------------

    def _connected(self) -> Any:
        """The stub, connecting first when no call has yet."""
        with self._lock:
            if self._stub is None:
                self._connect()
            return self._stub

    def _connect(self) -> None:
        import grpc

        from barreld.rpc import barrel_pb2_grpc as pb_grpc

        if not _answers(self.socket):
            if not self.explicit and _answers(SYSTEM_SOCKET):
                self.socket = SYSTEM_SOCKET
            elif (refused := forbidden(self.socket)) is not None:
                raise refused
            elif self.autostart:
                self._start_daemon()
            else:
                raise _unreachable(
                    f"no barreld answers on {self.socket}; start it with `barreld` or drop --no-autostart"
                )
        self._channel = grpc.insecure_channel(
            f"unix:{self.socket}", options=[("grpc.max_receive_message_length", MAX_MESSAGE)]
        )
        self._stub = pb_grpc.BarrelStub(self._channel)
        token = peer_token(self.socket)
        self._metadata = (("barrel-peer", token),) if token else ()

    def _start_daemon(self) -> None:
        """Starts barreld in the background under a lock, so racing clients end with one daemon."""
        sock_dir = self.socket.parent
        private_dir(sock_dir)
        with locked(sock_dir / "autostart.lock"):
            if _answers(self.socket):
                return
            log_path = sock_dir / "barreld.log"
            with open(log_path, "ab") as log:
                os.chmod(log_path, 0o600)
                proc = subprocess.Popen(  # under a watcher that logs how it ends (barreld.supervise)
                    [sys.executable, "-m", "barreld.supervise", "--socket", str(self.socket)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            self._wait_started(proc, log_path)

    def _wait_started(self, proc: subprocess.Popen, log_path: Path) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise _unreachable(
                    f"barreld exited with code {proc.returncode} while starting: {tail[0]} (log: {log_path})"
                )
            if _answers(self.socket, timeout=0.5):
                return
            time.sleep(0.05)
        raise _unreachable(
            f"barreld did not become ready on {self.socket} within {READY_TIMEOUT:.0f}s (log: {log_path})"
        )

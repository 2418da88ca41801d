"""gRPC servicer: validates requests, calls the registry or the cache, and converts results to messages."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc

import barreld
from barreld.cache.key import Namespace
from barreld.engine.callformats import family_of
from barreld.engine.chat import messages_from
from barreld.engine.registry import LoadedModel, LoadOptions, ModelRegistry
from barreld.engine.reply import Finish, TextDelta
from barreld.engine.request import Alternative, Started, TokenLogprob
from barreld.engine.sampling import KNOBS, SamplingParams
from barreld.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from barreld.names import DEFAULT_TENANT, REDIS_TIER, TIER_NAMES, Fingerprint, tenant_label
from barreld.rpc import barrel_pb2 as pb
from barreld.rpc import barrel_pb2_grpc as pb_grpc
from barreld.server.status import rpc
from barreld.service.calls import check_cache_salt, check_model_name, parse_schema, show, start_call
from barreld.service.request import CallRequest
from barreld.tenants import Tenants

if TYPE_CHECKING:
    from barreld.cache import CacheStore
    from barreld.cache.remote.tier import RemoteTier
    from barreld.server.peers import Peers
    from barreld.service.metrics import Metrics

MAX_PATH = 4096  # PATH_MAX
MAX_POLICY_ITEMS = 32
MAX_POLICY_TEXT = 64
T = TypeVar("T")


def check_tier(tier: str, *, remote: bool = False) -> None:
    """A local tier's name, or with `remote` also the shared tier's (operations that may act on it)."""
    names = (*TIER_NAMES, REDIS_TIER) if remote else TIER_NAMES
    if tier not in names:
        raise InvalidArgument(f"unknown tier {show(tier)}; use one of {', '.join(names)}")


def split_tiers(tiers: list[str]) -> tuple[list[str] | None, bool]:
    """(the local tiers named, None for every local one when none is named at all; whether redis is)."""
    for tier in tiers:
        check_tier(tier, remote=True)
    local = [t for t in tiers if t != REDIS_TIER]
    return (local if tiers else None), REDIS_TIER in tiers


def check_load(request: pb.LoadModelRequest) -> None:
    """Bounds on a load's strings, before any of them reaches a message, the file system or a parser."""
    check_model_name(request.name)
    if request.tier:
        check_tier(request.tier)
    if len(request.path) > MAX_PATH or "\0" in request.path:
        raise InvalidArgument(f"bad path {show(request.path)}: expected a file path of at most {MAX_PATH} bytes")
    if len(request.policy) > MAX_POLICY_ITEMS:
        raise InvalidArgument(f"too many policy settings ({len(request.policy)}); at most {MAX_POLICY_ITEMS}")
    for key, value in request.policy.items():
        if len(key) > MAX_POLICY_TEXT or len(value) > MAX_POLICY_TEXT:
            raise InvalidArgument(
                f"bad policy setting {show(key)}: keys and values are at most {MAX_POLICY_TEXT} characters"
            )


def load_fingerprint(text: str, default: Fingerprint) -> Fingerprint:
    try:
        return Fingerprint.parse(text) if text else default
    except ValueError as exc:
        raise InvalidArgument(f"bad fingerprint {show(text)}: {exc}") from None


def grpc_request(req: pb.CompleteRequest, namespace: Namespace) -> CallRequest:
    """The one request type, filled from a gRPC request; the sampler's fields that are set, the rest at their
    defaults."""
    s = req.sampling
    return CallRequest(
        model=req.model,
        prompt=req.prompt,
        chat=req.chat,
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        messages=messages_from({"role": m.role, "content": m.content} for m in req.messages) if req.messages else (),
        chat_template=req.chat_template or None,
        sampling=SamplingParams(
            temperature=req.temperature,
            seed=req.seed if req.HasField("seed") else None,
            logit_bias=tuple(sorted(s.logit_bias.items())),
            **{name: getattr(s, name) for name in KNOBS if s.HasField(name)},
        ),
        constraint=(s.grammar, parse_schema(s.json_schema) if s.json_schema else None, s.json_object),
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        stop=tuple(req.stop),
        parent_key=req.parent_key,
        explain=req.explain,
        namespace=namespace,
    )


def logprob_messages(entries: tuple[TokenLogprob, ...]) -> list[pb.TokenLogprob]:
    def alt(a: Alternative) -> pb.Alternative:
        return pb.Alternative(token=a.token, text=a.text, logprob=a.logprob)

    return [pb.TokenLogprob(chosen=alt(e.chosen), top=[alt(a) for a in e.top]) for e in entries]


def model_info(m: LoadedModel, default: str | None) -> pb.ModelInfo:
    counts = m.worker.counts()
    state = "busy" if counts["running"] else "ready"
    return pb.ModelInfo(
        name=m.name,
        path=str(m.path),
        fingerprint=m.fingerprint.hex(),
        tier=m.options.tier,
        n_ctx=m.options.n_ctx,
        n_batch=m.options.n_batch,
        n_seq_max=m.options.n_seq_max,
        state=state,
        running=counts["running"],
        queued=counts["queued"],
        live=counts["live"],
        settling=bool(counts["settling"]),
        policy={k: str(v) for k, v in m.policy.as_dict().items()},
        quant=m.quant,
        is_default=m.name == default,
        memory=m.memory.kind.value,
        swa_window=m.memory.window,
        reuse=m.memory.summary,
        n_threads=m.options.n_threads or 0,
        n_gpu_layers=m.options.n_gpu_layers,
        gpu_layers=m.gpu_layers,
        flash_attn=m.worker.backend.flash_attn,
        type_k=m.options.type_k,
        type_v=m.options.type_v,
        swa_full=m.memory.swa_full,
        prefill_chunk=m.memory.chunk,
        aliases=list(m.options.aliases),
        stop=list(m.options.stop),
        tool_format=family_of(m.worker.backend.chat_template).name,
        exact_reuse=pb.ExactReuse(**m.exact_reuse.as_dict(m.memory.chunk)),
    )


def cache_info(c) -> pb.CacheInfo:
    d = c.divergence
    return pb.CacheInfo(
        path=c.route.value, restored_tokens=c.restored_tokens, prefilled_tokens=c.prefilled_tokens, tier=c.tier or "",
        divergence=None if d is None else pb.Divergence(matched_tokens=d.matched_tokens, matched_bytes=d.matched_bytes,
                                                        cached=d.cached, prompt=d.prompt, against=d.against),
    )


def done_message(finish: Finish, model: str) -> pb.CompleteDone:
    ev = finish.done
    t = ev.timings
    return pb.CompleteDone(
        text=ev.text,
        model=model,
        finish_reason=ev.finish_reason,
        key=ev.key.hex(),
        prompt_key=ev.prompt_key.hex(),
        cache=cache_info(ev.cache),
        prompt_tokens=ev.prompt_tokens,
        completion_tokens=ev.completion_tokens,
        timings_ms=pb.Timings(lookup=t.lookup, restore=t.restore, prefill=t.prefill, ttft=t.ttft, total=t.total),
        logprobs=logprob_messages(ev.logprobs),
    )


class Servicer(pb_grpc.BarrelServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        store: CacheStore | None,
        *,
        socket: Path,
        data_dir: Path,
        config: Path | None,
        load_defaults: Callable[[], LoadOptions],
        scheduler_status: Callable[[], dict],
        request_shutdown: Callable[[], None],
        metrics: Metrics | None = None,
        http_address: str = "",
        peers: Peers | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.registry = registry
        self.store = store
        self.socket = socket
        self.data_dir = data_dir
        self.config = config
        self.load_defaults = load_defaults
        self.scheduler_status = scheduler_status
        self.request_shutdown = request_shutdown
        self.metrics = metrics
        self.http_address = http_address
        self.peers = peers  # None: every caller is the daemon's own user (a private socket, in tests)
        self.tenants = tenants or Tenants()
        self.started = time.time()
        self.stopping = False

    def _check_open(self) -> None:
        if self.stopping:
            raise Unavailable("barreld is shutting down; retry in a moment")

    def admit(self, context: grpc.ServicerContext) -> None:
        """Every call on a shared socket proves its user first (`Peers.uid`), whatever it asks."""
        if self.peers is not None:
            self.peers.uid(context)

    def _tenant(self, context: grpc.ServicerContext) -> str:
        return DEFAULT_TENANT if self.peers is None else self.peers.tenant(context)

    def _operator(self, context: grpc.ServicerContext, what: str) -> None:
        """Only the daemon's own user (or root) may `what`: it touches every tenant's rows, or the daemon."""
        if self.peers is not None and not self.peers.operator(context):
            raise PermissionDenied(f"only the daemon's user (uid {self.peers.owner}) or root may {what}")

    def _namespace(self, request: pb.CompleteRequest, context: grpc.ServicerContext) -> Namespace:
        """The caller's namespace with the request's salt; a keys file's tenant's, when the operator asks."""
        salt = check_cache_salt(request.cache_salt)
        if not request.tenant:
            return Namespace.of(self._tenant(context), salt)
        self._operator(context, "act as another tenant")
        if request.tenant not in self.tenants.names:
            raise InvalidArgument(f"no tenant {show(request.tenant)} in the HTTP keys file; "
                                  f"its tenants: {', '.join(self.tenants.names) or 'none'}")
        return self.tenants.namespace(request.tenant, salt)

    @rpc
    def Complete(self, request: pb.CompleteRequest, context: grpc.ServicerContext) -> Iterator[pb.CompleteEvent]:
        self._check_open()
        namespace = self._namespace(request, context)
        call = start_call(self.registry, grpc_request(request, namespace), self.metrics, "grpc")
        context.add_callback(call.cancel)
        for ev in call:
            if isinstance(ev, Started):
                yield pb.CompleteEvent(
                    started=pb.CompleteStarted(
                        cache=cache_info(ev.cache), prompt_tokens=ev.prompt_tokens, prompt_key=ev.prompt_key.hex(),
                        model=call.model.name,
                    )
                )
            elif isinstance(ev, TextDelta):
                yield pb.CompleteEvent(token=pb.CompleteToken(text=ev.raw, logprobs=logprob_messages(ev.logprobs)))
            elif isinstance(ev, Finish):
                yield pb.CompleteEvent(done=done_message(ev, call.model.name))

    @rpc
    def LoadModel(self, request: pb.LoadModelRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        self._check_open()
        self._operator(context, "load a model (barreld opens the file as its own user)")
        base = self.load_defaults()
        check_load(request)
        opts = LoadOptions(
            path=Path(request.path) if request.path else None,
            tier=request.tier or base.tier,
            n_ctx=request.n_ctx or base.n_ctx,
            n_batch=request.n_batch or base.n_batch,
            n_seq_max=request.n_seq_max or base.n_seq_max,
            policy={**base.policy, **dict(request.policy)},
            fingerprint=load_fingerprint(request.fingerprint, base.fingerprint),
            n_threads=request.n_threads if request.HasField("n_threads") else base.n_threads,
            n_gpu_layers=request.n_gpu_layers if request.HasField("n_gpu_layers") else base.n_gpu_layers,
            flash_attn=request.flash_attn if request.HasField("flash_attn") else base.flash_attn,
            type_k=request.type_k or base.type_k,
            type_v=request.type_v or base.type_v,
            swa_full=request.swa_full if request.HasField("swa_full") else base.swa_full,
            aliases=tuple(request.aliases) or base.aliases,
            stop=tuple(request.stop) or base.stop,
        )
        for what, value in (("n_ctx", request.n_ctx), ("n_batch", request.n_batch), ("n_seq_max", request.n_seq_max)):
            if value < 0:
                raise InvalidArgument(f"bad {what} {value}: must be positive")
        model = self.registry.load(request.name, opts)
        return model_info(model, self.registry.default_name)

    @rpc
    def UnloadModel(self, request: pb.UnloadModelRequest, context: grpc.ServicerContext) -> pb.UnloadModelReply:
        check_model_name(request.name)
        self._operator(context, "unload a model")
        return pb.UnloadModelReply(saved=self.registry.unload(request.name))

    @rpc
    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsReply:
        default = self.registry.default_name
        failed = [pb.ModelInfo(name=f.name, path=str(f.path), state="failed", error=f.error)
                  for f in self.registry.failed()]
        return pb.ListModelsReply(models=[*(model_info(m, default) for m in self.registry.models()), *failed])

    def _cache(self) -> CacheStore:
        if self.store is None:
            raise Unavailable("the cache is not open")
        return self.store

    def _remote(self) -> RemoteTier:
        remote = self._cache().remote
        if remote is None:
            raise FailedPrecondition("no redis tier is configured: set [tiers.redis] url or $BARREL_REDIS_URL")
        return remote

    @staticmethod
    def _reached(result: T | None) -> T:
        """A remote operation's result; None means Redis could not be read or told (the daemon itself is
        there, so not UNAVAILABLE, which clients read as no daemon)."""
        if result is None:
            raise FailedPrecondition("the redis tier could not be reached; see `barrelctl cache stats` and the log")
        return result

    def _fingerprints(self, model: str) -> dict[bytes, str] | None:
        """The loaded model's fingerprint (for remote rows, which other hosts may name otherwise)."""
        if not model:
            return None
        found = {m.fingerprint: m.name for m in self.registry.models() if m.name == model}
        if not found:
            raise NotFound(f"model {show(model)} is not loaded, so its fingerprint is unknown; load it first")
        return found

    @rpc
    def CacheDump(self, request: pb.CacheDumpRequest, context: grpc.ServicerContext) -> pb.CacheDumpReply:
        if request.tier:
            check_tier(request.tier, remote=True)
        tenant = request.tenant if request.HasField("tenant") else None
        caller = self._tenant(context)
        if self.peers is not None and not self.peers.operator(context):
            if tenant not in (None, caller):
                raise PermissionDenied(f"you see your own rows only (tenant {tenant_label(caller)})")
            tenant = caller
        if request.tier == REDIS_TIER:
            if tenant is not None:
                raise FailedPrecondition("the redis tier's rows are listed whole, to the daemon's user only")
            rows = self._reached(self._remote().dump(self._fingerprints(request.model)))
        else:
            rows = self._cache().dump(model=request.model or None, tier=request.tier or None, tenant=tenant)
        return pb.CacheDumpReply(rows=[pb.CacheRow(**{**r, "location": r["location"] or ""}) for r in rows])

    @rpc
    def CacheStats(self, request: pb.CacheStatsRequest, context: grpc.ServicerContext) -> pb.CacheStatsReply:
        stats = self._cache().stats()
        return pb.CacheStatsReply(
            counters=stats["counters"],
            tiers={
                name: pb.TierUsage(**t)
                for name, t in stats["tiers"].items()
            },
            redis_json=json.dumps(stats[REDIS_TIER]) if stats[REDIS_TIER] is not None else "",
        )

    @rpc
    def CacheGc(self, request: pb.CacheGcRequest, context: grpc.ServicerContext) -> pb.CacheGcReply:
        self._operator(context, "evict rows")
        local, remote = split_tiers(list(request.tiers))
        evicted = self._cache().gc(local) if local != [] else 0
        if remote:
            evicted += self._reached(self._remote().gc())
        return pb.CacheGcReply(evicted=evicted)

    @rpc
    def CacheEvictBytes(
        self, request: pb.CacheEvictBytesRequest, context: grpc.ServicerContext
    ) -> pb.CacheEvictBytesReply:
        if request.bytes < 0:
            raise InvalidArgument(f"bad size {request.bytes}: must be >= 0")
        self._operator(context, "evict rows")
        local, remote = split_tiers(list(request.tiers))
        evicted, freed = self._cache().evict_bytes(request.bytes, local) if local != [] else (0, 0)
        if remote and freed < request.bytes:  # the local tiers named go first: they are this host's own
            more, more_freed = self._reached(self._remote().evict(request.bytes - freed))
            evicted, freed = evicted + more, freed + more_freed
        return pb.CacheEvictBytesReply(evicted=evicted, bytes_freed=freed)

    @rpc
    def CacheVerify(
        self, request: pb.CacheVerifyRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.CacheVerifyEvent]:
        self._operator(context, "verify the cache (it reads every tenant's rows)")
        store = self._cache()
        progress: queue.Queue = queue.Queue()
        result: list = []

        def work() -> None:
            try:
                result.append(store.verify(lambda done, total: progress.put((done, total))))
            except Exception as exc:  # noqa: BLE001 - handed to the RPC thread below
                result.append(exc)
            progress.put(None)

        threading.Thread(target=work, name="verify", daemon=True).start()
        while (item := progress.get()) is not None:
            yield pb.CacheVerifyEvent(progress=pb.CacheVerifyProgress(done=item[0], total=item[1]))
        if isinstance(result[0], Exception):
            raise result[0]
        checked, bad = result[0]
        yield pb.CacheVerifyEvent(result=pb.CacheVerifyResult(checked=checked, bad=bad))

    @rpc
    def SchedulerStatus(self, request, context) -> pb.SchedulerStatusReply:
        return pb.SchedulerStatusReply(status_json=json.dumps(self.scheduler_status()))

    @rpc
    def DaemonStatus(self, request, context) -> pb.DaemonStatusReply:
        return pb.DaemonStatusReply(
            pid=os.getpid(),
            uptime_s=time.time() - self.started,
            socket=str(self.socket),
            data_dir=str(self.data_dir),
            version=barreld.__version__,
            models=len(self.registry.models()),
            config=str(self.config or ""),
            http=self.http_address,
        )

    @rpc
    def Shutdown(self, request, context) -> pb.ShutdownReply:
        self._operator(context, "stop the daemon")
        self.request_shutdown()
        return pb.ShutdownReply()

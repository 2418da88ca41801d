"""Wires one daemon together: config → cache store → models → pressure scheduler → gRPC server, and the
HTTP API when the config asks for it."""

from __future__ import annotations

import grp
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from barreld.config import Config
from barreld.deaths import Death, RunRecord, cause_of_death, remove_record
from barreld.engine.decodecheck import DecodeCheck
from barreld.engine.exactness import ReuseProbe
from barreld.engine.registry import LoadOptions, ModelRegistry
from barreld.errors import BarrelError
from barreld.lifecycle import DataDirLock, ShutdownSignal, StartupError, notify_systemd
from barreld.pressure.scheduler import PressureScheduler
from barreld.pressure.sources import make_source
from barreld.server.grpc_server import GrpcServer
from barreld.server.peers import Peers
from barreld.server.servicer import Servicer
from barreld.service.metrics import Metrics

if TYPE_CHECKING:
    from barreld.http.response_store import ResponseStore
    from barreld.http.server import HttpServer

log = logging.getLogger(__name__)

RESPONSES_FILE = "responses.sqlite"  # in the data directory


class Daemon:
    def __init__(self, config: Config, *, data_dir: Path, socket: Path, config_path: Path | None) -> None:
        self.config = config
        self.data_dir = data_dir
        self.socket = socket
        self.config_path = config_path
        self.lock = DataDirLock(data_dir)
        self.signal = ShutdownSignal()
        self.store = None
        self.scheduler = None
        self.registry: ModelRegistry | None = None
        self.server: GrpcServer | None = None
        self.servicer: Servicer | None = None
        self.peers: Peers | None = None
        self.http: HttpServer | None = None
        self.responses: ResponseStore | None = None  # the Responses API's stored responses, with HTTP
        self.previous_death: Death | None = None  # how the last daemon on this socket ended, if it died

    def start(self) -> None:
        group = grp.getgrnam(self.config.socket_group).gr_gid if self.config.socket_group else None
        self.lock.acquire()
        try:
            self._start(group)
        except BaseException:
            remove_record(self.socket)
            raise

    def _take_over_run_record(self) -> None:
        """Reports how the previous daemon on this socket died, if it did, then records this one."""
        previous = RunRecord.read(self.socket)
        if previous is not None and not previous.alive():
            self.previous_death = cause_of_death(previous)
            log.warning("the previous run did not stop: %s", self.previous_death.sentence())
        RunRecord.of_this_process().write(self.socket)

    def _start(self, group: int | None) -> None:
        self.http = self._bind_http(group)
        self.signal.install()
        self.store = self._open_store()
        self.registry = ModelRegistry(self.store, self.config.policy, max_queue=self.config.max_queue,
                                      blocks_required=self.config.block_tokens is not None, load_check=DecodeCheck(),
                                      reuse_probe=ReuseProbe(), configuring=True)
        self.scheduler = self._start_scheduler()
        metrics = Metrics(self.store, self.registry.models)
        self.peers = Peers(self.socket, group, self.data_dir / "peer.key")
        self.servicer = Servicer(
            self.registry,
            self.store,
            socket=self.socket,
            data_dir=self.data_dir,
            config=self.config_path,
            load_defaults=lambda: LoadOptions(),
            scheduler_status=self._scheduler_status,
            request_shutdown=self.signal.request,
            metrics=metrics,
            http_address=str(self.http.address) if self.http else "",
            peers=self.peers,
            tenants=self.config.http.tenants,
        )
        self.server = GrpcServer(self.servicer, self.socket, group=group)
        self.server.start(before_serving=self.peers.start)
        self._take_over_run_record()  # beside the socket, whose directory the server has made
        if self.http is not None:
            self._start_http(metrics)
        self._load_configured_models()
        notify_systemd("READY=1")

    def _bind_http(self, group: int | None) -> HttpServer | None:
        """Binds the HTTP listener early, so a refused address or a taken port stops the start at once."""
        http = self.config.http
        if http.listen is None:
            return None
        from barreld.http.server import HttpServer, check_exposure

        check_exposure(http.listen, http.tenants.guarded)
        server = HttpServer(http.listen, group=group)
        server.bind()
        return server

    def _start_http(self, metrics: Metrics) -> None:
        from barreld.http.app import DaemonState, HttpApi
        from barreld.http.response_store import ResponseStore

        death = self.previous_death.sentence() if self.previous_death else None
        state = DaemonState(ready=self.registry.ready, stopping=lambda: self.servicer.stopping, previous_death=death)
        self.responses = ResponseStore(self.data_dir / RESPONSES_FILE)
        api = HttpApi(self.registry, metrics, state, self.config.http.tenants, self.responses)
        self.http.start(api.app)

    def _open_store(self):
        from barreld.cache import CacheStore
        from barreld.cache.blocks import DEFAULT_BLOCK_TOKENS

        tiers = dict(self.config.tiers)
        kwargs = {"writers": self.config.writers} if self.config.writers else {}
        block_tokens = self.config.block_tokens
        kwargs["block_tokens"] = DEFAULT_BLOCK_TOKENS if block_tokens is None else block_tokens
        try:
            store = CacheStore(self.data_dir, tiers, remote=self._open_remote(), **kwargs)
            store.open()
        except Exception as exc:
            raise StartupError(f"cannot open the cache in {self.data_dir}: {exc}") from exc
        return store

    def _open_remote(self):
        """The shared tier when configured. Redis need not answer now: until it does, lookups miss and
        mirrors fail (counted), and the daemon serves from its own tiers."""
        if self.config.redis is None:
            return None
        from barreld.cache.remote.redis import RedisStore
        from barreld.cache.remote.tier import RemoteTier

        remote = RemoteTier(RedisStore(self.config.redis))
        reachable = remote.store.ping()
        log.info("redis tier %s (prefix %r, %s): %s", self.config.redis.redacted_url, self.config.redis.prefix,
                 "read-write" if remote.writes else "read-only", "reachable" if reachable else "not reachable yet")
        return remote

    def _load_configured_models(self) -> None:
        try:
            for m in self.config.models:
                opts = LoadOptions(policy=m.policy.as_dict(), aliases=m.aliases, **m.load_settings())
                try:
                    self.registry.load(m.name, opts)
                except BarrelError as exc:
                    log.error("config model %s not loaded: %s", m.name, exc)
        finally:
            self.registry.configured()

    def _start_scheduler(self) -> PressureScheduler:
        """Off by default (memory is the operator's to manage); when on, it evicts rows from its tiers."""
        s = self.config.scheduler
        try:
            source = make_source(s.pressure_source)
        except ValueError as exc:
            raise StartupError(f"scheduler.pressure_source: {exc}") from None
        scheduler = PressureScheduler(
            source,
            self.store.evict_bytes,
            enabled=s.enabled,
            interval_ms=s.interval_ms,
            high_watermark=s.high_watermark,
            low_watermark=s.low_watermark,
            evict_tiers=s.evict_tiers,
        )
        scheduler.start()
        return scheduler

    def _scheduler_status(self) -> dict:
        return self.scheduler.status()

    def wait(self) -> None:
        self.signal.wait()

    def shutdown(self) -> None:
        """Stop accepting, cancel in-flight work, run shutdown saves, flush writers, close LMDB."""
        log.info("shutting down")
        notify_systemd("STOPPING=1")
        self.servicer.stopping = True
        self.server.stop_accepting()
        if self.peers is not None:
            self.peers.stop()
        if self.http is not None:
            self.http.stop_accepting()
        stopper = threading.Thread(target=self.server.stop, args=(5.0,), daemon=True)
        stopper.start()
        saved = self.registry.close()
        stopper.join(6.0)
        if self.http is not None:
            self.http.join(6.0)
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.store is not None:
            self.store.close()
        if self.responses is not None:
            self.responses.close()
        remove_record(self.socket)
        self.lock.release()
        log.info("stopped (%d shutdown saves)", saved)

"""Prometheus metrics for one daemon, served as text at the HTTP API's /metrics.

Per-request figures (requests, tokens, time to first token) are counted as each completion ends, by
whichever front end served it; cache and queue figures are read from the store's counters and the workers
at scrape time, so they cover every request and never drift from `barrelctl cache stats`. The registry is
the daemon's own, not prometheus_client's global one: two daemons in one process (tests) stay apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from barreld.engine.request import Done
from barreld.names import REDIS_TIER, SAVE_REASONS, Route, tenant_label

if TYPE_CHECKING:
    from barreld.cache import CacheStore
    from barreld.engine.registry import LoadedModel

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SAVE_FAILURES = ("failed", "dropped")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, store: CacheStore | None, models: Callable[[], list[LoadedModel]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "barrel_requests", "Completion requests ended, by API and outcome", ["api", "model", "outcome"], registry=r
        )
        self.prompt_tokens = Counter("barrel_prompt_tokens", "Prompt tokens of ended requests", ["model"], registry=r)
        self.generated_tokens = Counter("barrel_generated_tokens", "Tokens generated", ["model"], registry=r)
        self.restored_tokens = Counter(
            "barrel_restored_tokens", "Prompt tokens warm-started from the cache instead of prefilled", ["model"],
            registry=r,
        )
        # Per tenant, the requests and what the cache gave them: counts only, never a prompt's bytes.
        self.tenant_requests = Counter("barrel_tenant_requests", "Completion requests ended, by tenant", ["tenant"],
                                       registry=r)
        self.tenant_restored = Counter("barrel_tenant_restored_tokens", "Prompt tokens restored, by tenant",
                                       ["tenant"], registry=r)
        self.tenant_prompt = Counter("barrel_tenant_prompt_tokens", "Prompt tokens of ended requests, by tenant",
                                     ["tenant"], registry=r)
        self.ttft = Histogram(
            "barrel_time_to_first_token_seconds", "From a request's arrival to its first token", ["model"],
            buckets=TTFT_BUCKETS, registry=r,
        )
        r.register(_StateCollector(store, models))

    def finished(self, api: str, model: str, done: Done, tenant: str = "") -> None:
        self.requests.labels(api, model, done.finish_reason).inc()
        who = tenant_label(tenant)
        self.tenant_requests.labels(who).inc()
        self.tenant_prompt.labels(who).inc(done.prompt_tokens)
        self.tenant_restored.labels(who).inc(done.cache.restored_tokens)
        self.prompt_tokens.labels(model).inc(done.prompt_tokens)
        self.generated_tokens.labels(model).inc(done.completion_tokens)
        self.restored_tokens.labels(model).inc(done.cache.restored_tokens)
        if done.completion_tokens and done.finish_reason != "cancelled":
            self.ttft.labels(model).observe(done.timings.ttft / 1000.0)

    def failed(self, api: str, model: str) -> None:
        self.requests.labels(api, model, "error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Reads the cache counters, tier usage and worker queues when scraped."""

    def __init__(self, store: CacheStore | None, models: Callable[[], list[LoadedModel]]) -> None:
        self.store = store
        self.models = models

    def collect(self) -> Iterator[Metric]:
        yield from self._workers()
        if self.store is None:
            return
        stats = self.store.stats()
        c = stats["counters"]
        hits = CounterMetricFamily("barrel_cache_hits", "Requests warm-started, by lookup route", labels=["route"])
        for route in Route:
            if route is not Route.MISS:
                hits.add_metric([route.value], c[route.counter])
        yield hits
        yield CounterMetricFamily("barrel_cache_misses", "Requests with nothing to restore", value=c["misses"])
        saves = CounterMetricFamily("barrel_cache_saves", "Checkpoints saved, by reason", labels=["reason"])
        for reason in SAVE_REASONS:
            saves.add_metric([reason], c[f"saves_{reason}"])
        yield saves
        failures = CounterMetricFamily("barrel_cache_save_failures", "Saves not stored, by cause", labels=["cause"])
        for cause in SAVE_FAILURES:
            failures.add_metric([cause], c[f"saves_{cause}"])
        yield failures
        yield CounterMetricFamily("barrel_cache_evictions", "Checkpoints evicted", value=c["evictions"])
        yield from self._tiers(stats["tiers"])
        if stats[REDIS_TIER] is not None:
            yield from self._redis(stats[REDIS_TIER])

    @staticmethod
    def _tiers(tiers: dict[str, dict[str, int]]) -> Iterator[Metric]:
        for key, name, doc in (
            ("bytes", "barrel_cache_tier_bytes", "Bytes stored in each tier"),
            ("quota", "barrel_cache_tier_quota_bytes", "Each tier's quota in bytes"),
            ("rows", "barrel_cache_tier_rows", "Checkpoints held in each tier"),
        ):
            family = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, usage in tiers.items():
                family.add_metric([tier], usage[key])
            yield family

    @staticmethod
    def _redis(r: dict[str, Any]) -> Iterator[Metric]:
        """The shared tier: traffic, blocks written and skipped (and the bytes skipping saved), errors by kind
        and, for a cluster, by node."""
        moved = CounterMetricFamily("barrel_redis_bytes", "Bytes of values read from and written to Redis",
                                    labels=["direction"])
        moved.add_metric(["read"], r["bytes_read"])
        moved.add_metric(["written"], r["bytes_written"])
        yield moved
        blocks = CounterMetricFamily("barrel_redis_blocks", "Blocks by what a mirror or restore did with them",
                                     labels=["outcome"])
        for outcome in ("written", "skipped", "fetched", "local"):
            blocks.add_metric([outcome], r[f"blocks_{outcome}"])
        yield blocks
        yield CounterMetricFamily("barrel_redis_bytes_skipped", "Block bytes not sent: Redis already held them",
                                  value=r["bytes_skipped"])
        yield CounterMetricFamily("barrel_redis_hits", "Restores served from Redis", value=r["hits"])
        errors = CounterMetricFamily("barrel_redis_errors", "Failed Redis calls, by kind and node",
                                     labels=["kind", "node"])
        for node, kinds in r["node_errors"].items():
            for kind, n in kinds.items():
                errors.add_metric([kind, node], n)
        yield errors

    def _workers(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily("barrel_queue_depth", "Requests waiting for a sequence", labels=["model"])
        running = GaugeMetricFamily("barrel_requests_running", "Requests holding a sequence", labels=["model"])
        for m in self.models():
            counts = m.worker.counts()
            queued.add_metric([m.name], counts["queued"])
            running.add_metric([m.name], counts["running"])
        yield queued
        yield running

"""Prometheus metrics: the engine's gauges read at scrape time, latencies measured per request.

Each app has its own registry, so several apps (tests, or two engines in one process) do not
collide in prometheus-client's global one. Latencies follow ``vllm bench serve``'s definitions,
measured where the client sees them: TTFT from the request's arrival to its first tokens, ITL
between chunks that carry tokens, end-to-end from arrival to the last chunk.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pyserve.http.loop_lag import LoopLagProbe
from pyserve.outputs import GenerationChunk

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0,
)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


def disk_hit_tokens(stats: dict) -> int:
    """Prompt tokens served from the disk tier (loaded, then matched) since the start."""
    return stats.get("disk_loaded_blocks", 0) * stats.get("block_size", 0)


class EngineCollector(Collector):
    """The KV pool and queue gauges, from ``engine.stats()`` at every scrape."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Any]:
        stats = self._engine.stats()
        total = stats.get("num_blocks", 0)
        gauges = {
            "pyserve_kv_blocks_total": ("KV cache blocks in the pool", total),
            "pyserve_kv_blocks_free": ("KV blocks free", stats.get("num_free_blocks", total)),
            "pyserve_kv_blocks_cached": (
                "KV blocks held by the prefix cache",
                stats.get("cached_blocks", 0),
            ),
            "pyserve_kv_block_size": ("Tokens per KV block", stats.get("block_size", 0)),
            "pyserve_disk_cache_blocks": (
                "KV blocks the disk tier holds",
                stats.get("disk_blocks", 0),
            ),
            "pyserve_disk_cache_budget_blocks": (
                "KV blocks the disk tier may hold (0: off)",
                stats.get("disk_budget", 0),
            ),
            "pyserve_requests_running": ("Requests being computed", stats.get("num_running", 0)),
            "pyserve_requests_waiting": ("Requests waiting to start", stats.get("num_waiting", 0)),
            "pyserve_ready": (
                "1 when the engine serves and /health answers 200",
                int(bool(stats.get("healthy"))),
            ),
            # The step watchdog (engine/step_watch.py): a worker stuck inside a step.
            "pyserve_worker_step_stalled": (
                "1 while a step has gone unanswered by the worker longer than the step timeout",
                int(bool(stats.get("worker_stalled"))),
            ),
            "pyserve_worker_oldest_step_age_seconds": (
                "Seconds the worker has had its oldest unanswered step; 0 when none",
                stats.get("oldest_step_age_seconds", 0.0),
            ),
            # Where request state lives; all 0 when idle (the idle self-check's accounts).
            "pyserve_engine_requests": (
                "Request states in the main process",
                stats.get("num_requests", 0),
            ),
            "pyserve_core_requests": (
                "Requests known to the scheduling core",
                stats.get("core_requests", 0),
            ),
            "pyserve_worker_requests": (
                "Requests the worker holds state for (as of its last step)",
                stats.get("worker_requests", 0),
            ),
            "pyserve_detokenizer_requests": (
                "Requests the detokenizer holds state for (as of its last step)",
                stats.get("detokenizer_requests", 0),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "pyserve_prefix_cache_queried_tokens": ("Prompt tokens looked up", "query_tokens"),
            "pyserve_prefix_cache_hit_tokens": ("Prompt tokens found cached", "hit_tokens"),
            "pyserve_retractions": (
                "Running requests preempted (for KV space, a more important request, or a "
                "less-served tenant), to be recomputed",
                "retractions",
            ),
            "pyserve_fairness_retractions": (
                "Running requests preempted for a tenant served fewer tokens (--fairness "
                "tenant; part of the retractions)",
                "fairness_retractions",
            ),
            # the disk tier (0 while it is off)
            "pyserve_disk_cache_saved_blocks": (
                "KV blocks written to the disk tier (evicted, or at a clean stop)",
                "saved_blocks",
            ),
            "pyserve_disk_cache_loaded_blocks": (
                "KV blocks loaded back from the disk tier for a prompt",
                "disk_loaded_blocks",
            ),
            "pyserve_disk_cache_failed_loads": (
                "Disk-tier blocks that failed to load (damaged or missing; recomputed)",
                "disk_failed_blocks",
            ),
            # utilisation = Δbusy / Δwall; busy = from a step's arrival to its tokens' sending
            "pyserve_worker_busy_seconds": (
                "Seconds the worker spent handling steps and requests",
                "worker_busy_seconds",
            ),
            "pyserve_worker_steps": ("Steps the worker has run", "worker_steps"),
            "pyserve_streamed_tokens": (
                "Tokens handed to running requests, counted as each step completes",
                "handed_tokens",
            ),
            "pyserve_idle_checks": ("Idle accounting self-checks run", "idle_checks"),
            "pyserve_idle_check_failures": (
                "Idle accounting self-checks that found a leak",
                "idle_check_failures",
            ),
            "pyserve_worker_step_stalls": (
                "Steps the worker left unanswered longer than the step timeout",
                "worker_stalls",
            ),
            # speculative decoding (0 while it is off)
            "pyserve_spec_draft_tokens": ("Drafted tokens verified", "spec_draft_tokens"),
            "pyserve_spec_accepted_tokens": (
                "Drafted tokens accepted by verification",
                "spec_accepted_tokens",
            ),
            "pyserve_spec_verify_entries": (
                "Requests' verify passes (a request's drafts in one step)",
                "spec_verify_entries",
            ),
            "pyserve_spec_chained_entries": (
                "Entries planned behind their request's unreported verify pass",
                "spec_chained_entries",
            ),
            "pyserve_spec_chained_fallbacks": (
                "Chained entries run as a plain decode (the verify before them kept fewer drafts)",
                "spec_chained_fallbacks",
            ),
        }
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
        yield CounterMetricFamily(
            "pyserve_prefix_cache_disk_hit_tokens",
            "Prompt tokens found cached on disk and loaded (part of the hit tokens)",
            value=disk_hit_tokens(stats),
        )
        tenants = stats.get("tenants")
        if tenants is not None:  # --fairness tenant
            yield from _tenant_metrics(tenants)
        histogram = stats.get("spec_accepted_histogram")
        if histogram and len(histogram) > 1:  # one bucket: no drafts are ever verified
            yield _accepted_histogram(histogram)


def _tenant_metrics(tenants: dict) -> Iterator[Any]:
    """Tenants are named by requests: labelled by the few of the largest counts only, so that
    distinct ``user`` values cannot grow the scrape without bound."""
    yield GaugeMetricFamily(
        "pyserve_tenants_active", "Tenants with a request in the server", value=tenants["active"]
    )
    tokens = GaugeMetricFamily(
        "pyserve_tenant_tokens",
        "The fair scheduler's count of prompt and output tokens planned for a tenant's "
        'requests, for the few tenants of the largest counts (tenant="": requests that name '
        "none)",
        labels=["tenant"],
    )
    for row in tenants["top"]:
        tokens.add_metric([row["name"] or ""], row["tokens"])
    yield tokens


def _accepted_histogram(counts: list[int]) -> HistogramMetricFamily:
    """Drafts accepted per verify pass: bucket ``le=a`` counts the passes that accepted at most
    ``a`` drafts (from the core's exact counts, so no observation is ever lost)."""
    cumulative, buckets = 0, []
    for accepted, count in enumerate(counts):
        cumulative += count
        buckets.append((floatToGoString(accepted), cumulative))
    buckets.append(("+Inf", cumulative))
    total = sum(a * c for a, c in enumerate(counts))
    return HistogramMetricFamily(
        "pyserve_spec_accepted_per_verify",
        "Drafted tokens accepted per verify pass",
        buckets=buckets,
        sum_value=total,
    )


class LoopHistogram(Collector):
    """A histogram for the event loop's thread alone: no lock and no label machinery, so that
    observing once a token stays cheap (prometheus-client's Histogram takes a mutex and walks
    its buckets in Python on every observation)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le is inclusive
        self.sum += value

    def collect(self) -> Iterator[Any]:
        cumulative, buckets = 0, []
        bounds = (*map(floatToGoString, self.bounds), "+Inf")
        for bound, count in zip(bounds, self.counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(
            self.name, self.documentation, buckets=buckets, sum_value=self.sum
        )


class RequestLatencies:
    """One request's latencies, fed every chunk as the handler takes it."""

    __slots__ = ("_arrival", "_last_text_at", "_metrics", "generated")

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last_text_at: float | None = None
        self.generated = 0

    def chunk(self, chunk: GenerationChunk) -> None:
        now = time.perf_counter()
        metrics = self._metrics
        if chunk.token_ids:
            if self._last_text_at is None:
                metrics.ttft.observe(now - self._arrival)
            else:
                metrics.itl.observe(now - self._last_text_at)
            self._last_text_at = now
        self.generated = chunk.completion_tokens
        if chunk.finish_reason is not None:
            metrics.e2e.observe(now - self._arrival)
            metrics.prompt_tokens.inc(chunk.prompt_tokens)
            metrics.requests.labels(chunk.finish_reason).inc()

    def close(self) -> None:
        """Counts the tokens generated, however the request ended."""
        self._metrics.generation_tokens.inc(self.generated)


class Metrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(engine))
        self.ttft = LoopHistogram(
            "pyserve_time_to_first_token_seconds",
            "Time from a request's arrival to its first tokens",
            _LATENCY_BUCKETS,
        )
        self.itl = LoopHistogram(
            "pyserve_inter_token_latency_seconds",
            "Time between consecutive chunks of a request's tokens",
            _ITL_BUCKETS,
        )
        self.e2e = LoopHistogram(
            "pyserve_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token",
            _LATENCY_BUCKETS,
        )
        for histogram in (self.ttft, self.itl, self.e2e):
            self.registry.register(histogram)
        self.prompt_tokens = Counter(
            "pyserve_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "pyserve_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.requests = Counter(
            "pyserve_requests",
            "Finished requests by finish reason",
            ["finish_reason"],
            registry=self.registry,
        )
        self.loop_lag = LoopLagProbe(self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def request(self, arrival: float) -> RequestLatencies:
        return RequestLatencies(self, arrival)

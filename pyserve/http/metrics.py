"""Prometheus metrics: the engine's gauges read at scrape time, latencies measured per request.

Each app has its own registry, so several apps (tests, or two engines in one process) do not
collide in prometheus-client's global one. Latencies follow ``vllm bench serve``'s definitions,
measured where the client sees them: TTFT from the request's arrival to its first tokens, ITL
between chunks that carry tokens, end-to-end from arrival to the last chunk.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pyserve.http.loop_lag import LoopLagProbe
from pyserve.outputs import GenerationChunk

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0,
)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


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
            "pyserve_requests_running": ("Requests being computed", stats.get("num_running", 0)),
            "pyserve_requests_waiting": ("Requests waiting to start", stats.get("num_waiting", 0)),
            "pyserve_ready": ("1 when the engine serves", int(bool(stats.get("healthy")))),
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
            "pyserve_retractions": ("Running requests preempted for KV space", "retractions"),
            "pyserve_idle_checks": ("Idle accounting self-checks run", "idle_checks"),
            "pyserve_idle_check_failures": (
                "Idle accounting self-checks that found a leak",
                "idle_check_failures",
            ),
        }
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))


class Metrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(engine))
        self.ttft = Histogram(
            "pyserve_time_to_first_token_seconds",
            "Time from a request's arrival to its first tokens",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "pyserve_inter_token_latency_seconds",
            "Time between consecutive chunks of a request's tokens",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "pyserve_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
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

    async def observe(
        self, stream: AsyncIterator[GenerationChunk], arrival: float
    ) -> AsyncIterator[GenerationChunk]:
        """Passes ``stream`` through, recording its latencies and token counts."""
        last_text_at: float | None = None
        generated = 0
        try:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.token_ids:
                    if last_text_at is None:
                        self.ttft.observe(now - arrival)
                    else:
                        self.itl.observe(now - last_text_at)
                    last_text_at = now
                generated = chunk.completion_tokens
                if chunk.finish_reason is not None:
                    self.e2e.observe(now - arrival)
                    self.prompt_tokens.inc(chunk.prompt_tokens)
                    self.requests.labels(chunk.finish_reason).inc()
                yield chunk
        finally:
            self.generation_tokens.inc(generated)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

"""``/stats``: the server's own counters as per-second samples over the last minutes, in JSON.

The dashboard polls it about once a second; nothing else (no Prometheus) is needed. A task takes
one sample a second from ``engine.stats()`` and the latency histograms of ``Metrics``, so the
token path pays nothing for it. Rates come from differences of counters between samples;
percentiles and the prefix-cache hit rate from differences over a short trailing window, so
that one quiet second does not blank them. Percentiles are interpolated inside histogram
buckets, the way Prometheus' ``histogram_quantile`` does: estimates, as precise as the buckets.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pyserve.http.background import BackgroundTask
from pyserve.http.errors import bad_request, json_response
from pyserve.http.metrics import disk_hit_tokens
from pyserve.http.state import ServerState

INTERVAL_S = 1.0
HISTORY = 300  # samples kept: five minutes at one a second
TRAILING_S = 10  # the window of the percentiles and the hit rate, in samples
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Reading:
    """Cumulative counters at one instant; a sample is the difference of two readings."""

    t: float
    tokens: int
    steps: int
    hit_tokens: int
    query_tokens: int
    disk_hit_tokens: int  # of the hits, prompt tokens loaded from the disk tier
    spec_drafted: int  # speculative decoding: drafted tokens verified, and those accepted
    spec_accepted: int
    ttft: tuple[int, ...]
    itl: tuple[int, ...]


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The q-quantile of a histogram (``counts`` per bucket, the last one above every bound),
    interpolated linearly inside its bucket; None for an empty histogram."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(counts):
        if count and seen + count >= rank:
            if i == len(bounds):  # above the last bound: all we know is that it is above
                return bounds[-1]
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - seen) / count
        seen += count
    return bounds[-1]


def _percentiles(bounds: Sequence[float], new: tuple[int, ...], old: tuple[int, ...]) -> Any:
    counts = [a - b for a, b in zip(new, old, strict=True)]
    if not any(counts):
        return None
    return {f"p{round(q * 100)}": quantile(bounds, counts, q) for q in QUANTILES}


class LiveStats(BackgroundTask):
    """The sampler and its route; ``start``/``stop`` follow the app's lifetime."""

    def __init__(self, state: ServerState, interval_s: float = INTERVAL_S) -> None:
        self.state = state
        self.interval_s = interval_s
        self.samples: deque[dict] = deque(maxlen=HISTORY)
        self._readings: deque[Reading] = deque(maxlen=TRAILING_S + 1)

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/stats", self.handle)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            self.sample(time.time())
            # Keep to the grid: a late wake-up shortens the next sleep rather than drifting.
            next_at = max(next_at + self.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    def _read(self, t: float, stats: dict) -> Reading:
        metrics = self.state.metrics
        return Reading(
            t=t,
            tokens=stats.get("handed_tokens", 0),
            steps=stats.get("worker_steps", 0),
            hit_tokens=stats.get("hit_tokens", 0),
            query_tokens=stats.get("query_tokens", 0),
            disk_hit_tokens=disk_hit_tokens(stats),
            spec_drafted=stats.get("spec_draft_tokens", 0),
            spec_accepted=stats.get("spec_accepted_tokens", 0),
            ttft=tuple(metrics.ttft.counts),
            itl=tuple(metrics.itl.counts),
        )

    def sample(self, t: float) -> dict | None:
        """Takes one reading; returns (and keeps) the sample it completes, if any."""
        stats = self.state.engine.stats()
        reading = self._read(t, stats)
        readings = self._readings
        readings.append(reading)
        if len(readings) < 2:
            return None
        last, first = readings[-2], readings[0]
        elapsed = max(reading.t - last.t, 1e-9)
        steps = reading.steps - last.steps
        tokens = reading.tokens - last.tokens
        queried = reading.query_tokens - first.query_tokens
        drafted = reading.spec_drafted - first.spec_drafted
        total = stats.get("num_blocks", 0)
        free = stats.get("num_free_blocks", total)
        cached = stats.get("cached_blocks", 0)
        metrics = self.state.metrics
        sample = {
            "t": round(t, 3),
            "output_tokens_per_s": tokens / elapsed,
            "steps_per_s": steps / elapsed,
            # tokens handed per completed step: the mean number of requests in a step's batch
            "step_batch_size": tokens / steps if steps else None,
            "running": stats.get("num_running", 0),
            "waiting": stats.get("num_waiting", 0),
            "kv_blocks_used": max(0, total - free - cached),
            "kv_blocks_cached": cached,
            "kv_blocks_free": free,
            "prefix_cache_hit_rate": (
                (reading.hit_tokens - first.hit_tokens) / queried if queried else None
            ),
            "prefix_cache_disk_hit_rate": (
                (reading.disk_hit_tokens - first.disk_hit_tokens) / queried if queried else None
            ),
            "disk_blocks": stats.get("disk_blocks", 0),
            "spec_acceptance_rate": (
                (reading.spec_accepted - first.spec_accepted) / drafted if drafted else None
            ),
            "ttft_s": _percentiles(metrics.ttft.bounds, reading.ttft, first.ttft),
            "itl_s": _percentiles(metrics.itl.bounds, reading.itl, first.itl),
        }
        self.samples.append(sample)
        return sample

    def document(self, since: float | None = None) -> dict:
        stats = self.state.engine.stats()
        queried = stats.get("query_tokens", 0)
        drafted = stats.get("spec_draft_tokens", 0)
        return {
            "model": self.state.engine.model_name,
            "interval_s": self.interval_s,
            "history_s": HISTORY * self.interval_s,
            "trailing_s": TRAILING_S * self.interval_s,
            "kv_blocks_total": stats.get("num_blocks", 0),
            "block_size": stats.get("block_size", 0),
            "disk_budget_blocks": stats.get("disk_budget", 0),
            "totals": {
                "generated_tokens": stats.get("handed_tokens", 0),
                "steps": stats.get("worker_steps", 0),
                "prefix_cache_hit_rate": stats.get("hit_tokens", 0) / queried if queried else None,
                "prefix_cache_disk_hit_rate": (
                    disk_hit_tokens(stats) / queried if queried else None
                ),
                "spec_acceptance_rate": (
                    stats.get("spec_accepted_tokens", 0) / drafted if drafted else None
                ),
                "requests_in_flight": self.state.in_flight,
            },
            # --fairness tenant: the tenants of the largest token counts (None without it)
            "tenants": stats.get("tenants"),
            "samples": [s for s in self.samples if since is None or s["t"] > since],
        }

    async def handle(self, request: web.Request) -> web.Response:
        since = request.query.get("since")
        try:
            after = float(since) if since is not None else None
        except ValueError:
            raise bad_request("'since' must be a number of seconds", param="since") from None
        response = json_response(self.document(after))
        response.headers["Cache-Control"] = "no-store"
        return response

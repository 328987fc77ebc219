"""A probe of the event loop's responsiveness, exported as a histogram.

Every stream's next token waits for the loop; anything that blocks it (a long tokenization, a
big JSON body, a garbage-collection pause) shows up here as lag: how much later than asked a
short sleep wakes up.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

from pyserve.http.background import BackgroundTask

INTERVAL_S = 0.01
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class LoopLagProbe(BackgroundTask):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(
            "pyserve_event_loop_lag_seconds",
            f"How late a {INTERVAL_S * 1000:.0f} ms sleep on the event loop wakes up",
            buckets=_BUCKETS,
            registry=registry,
        )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(INTERVAL_S)
            self.histogram.observe(max(0.0, loop.time() - before - INTERVAL_S))

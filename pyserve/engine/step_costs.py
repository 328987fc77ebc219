"""StepCosts: what decode steps cost on this machine, measured as they run, for speculation.

The planner's own drafts pay only while a step's expected tokens per millisecond grow with them
(cpp/core/draft_costs.h), so it needs two measured numbers: the milliseconds the worker takes for
a decode-only step of ``t`` tokens (drafts included), and the extra wall time a step with verify
entries costs, because the request's next step waits for its verify result instead of running
behind it: the wall time between the step after it and it, less that step's own work.

Two traps of measuring only what the planner chooses to run:

- The first step of each size may pay one-off costs (a GPU backend compiles its kernels for a
  new shape, an allocator grows): it is not counted (``WARMUP_STEPS`` per token count).
- A size measured dear is not planned again, so it would never be measured again: a cost of
  more than one token not measured for ``STALE_S`` is forgotten (``expire``), the planner's prior
  takes its place, and the planner tries the size once more.
"""

from __future__ import annotations

import math

ALPHA = 0.2  # weight of a new measurement in the running means
WARMUP_STEPS = 1  # steps of each token count not counted
STALE_S = 10.0  # a verify size's cost is forgotten this long after its last measurement


class StepCosts:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._ms: list[float] = [0.0] * (max_tokens + 1)  # by token count; 0: unmeasured
        self._seen: list[int] = [0] * (max_tokens + 1)  # steps observed, warm-up included
        self._at: list[float] = [0.0] * (max_tokens + 1)  # when last measured
        self.verify_overhead_ms = 0.0
        self.changed = False  # since the planner was last given the costs

    def observe(self, decode_tokens: int, forward_ms: float, now: float = 0.0) -> None:
        """A decode-only step of ``decode_tokens`` tokens took ``forward_ms`` in the worker."""
        if not 1 <= decode_tokens <= self.max_tokens or not math.isfinite(forward_ms):
            return
        self._seen[decode_tokens] += 1
        if self._seen[decode_tokens] <= WARMUP_STEPS:
            return
        old = self._ms[decode_tokens]
        self._ms[decode_tokens] = forward_ms if old <= 0 else old + ALPHA * (forward_ms - old)
        self._at[decode_tokens] = now
        self.changed = True

    def observe_overhead(self, gap_ms: float, forward_ms: float) -> None:
        """The step after one with verify entries arrived ``gap_ms`` after it and took
        ``forward_ms`` of work: the rest is time the worker waited."""
        idle = max(0.0, gap_ms - forward_ms)
        if math.isfinite(idle):
            self.verify_overhead_ms += ALPHA * (idle - self.verify_overhead_ms)
            self.changed = True

    def expire(self, now: float) -> None:
        """Forgets the costs of verify sizes (2 tokens and more) not measured since
        ``now - STALE_S``; a plain decode's cost is measured at every step anyway."""
        for t in range(2, self.max_tokens + 1):
            if self._ms[t] > 0 and now - self._at[t] > STALE_S:
                self._ms[t] = 0.0
                self.changed = True

    def table(self) -> list[float]:
        return list(self._ms)

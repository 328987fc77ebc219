"""StepCosts: running means of decode step costs by token count and of a verify's wait, and
the planner taking them (its own drafts stop where the measured costs say they cannot pay)."""

from __future__ import annotations

import math

import pytest

from pyserve._core import Planner
from pyserve.engine.step_costs import ALPHA, STALE_S, WARMUP_STEPS, StepCosts


def test_costs_are_running_means_by_token_count():
    costs = StepCosts(max_tokens=8)
    assert costs.table() == [0.0] * 9 and not costs.changed
    for t in (1, 3):  # each size's first step may compile kernels: not counted
        costs.observe(t, 500.0)
    assert costs.table() == [0.0] * 9 and not costs.changed
    costs.observe(1, 4.0)
    costs.observe(1, 6.0)
    costs.observe(3, 9.0)
    table = costs.table()
    assert table[1] == pytest.approx(4.0 + ALPHA * 2.0) and table[3] == 9.0
    assert table[2] == 0.0 and costs.changed
    for bad in ((0, 1.0), (9, 1.0), (2, math.nan)):
        costs.observe(*bad)  # outside the table, or not a number: ignored
    assert costs.table() == table


def test_a_verify_size_not_measured_for_a_while_is_forgotten_and_tried_again():
    costs = StepCosts(max_tokens=4)
    for t, ms in ((1, 1.0), (1, 1.0), (3, 9.0), (3, 9.0)):
        costs.observe(t, ms, now=100.0)
    costs.changed = False
    costs.expire(100.0 + STALE_S)
    assert costs.table()[3] == 9.0 and not costs.changed
    costs.expire(100.0 + STALE_S + 0.1)  # the planner stopped planning 3-token steps
    assert costs.table() == [0.0, 1.0, 0.0, 0.0, 0.0] and costs.changed
    costs.observe(3, 2.0, now=120.0)  # tried again: counted at once (warmed up before)
    assert costs.table()[3] == 2.0 and WARMUP_STEPS == 1


def test_the_wait_after_a_verify_is_the_gap_less_the_work():
    costs = StepCosts(max_tokens=4)
    costs.observe_overhead(gap_ms=7.0, forward_ms=5.0)
    assert costs.verify_overhead_ms == pytest.approx(ALPHA * 2.0)
    costs.observe_overhead(gap_ms=3.0, forward_ms=5.0)  # overlapped: no wait, never negative
    assert costs.verify_overhead_ms == pytest.approx(ALPHA * 2.0 * (1 - ALPHA))


def _first_decode(planner: Planner) -> dict:
    planner.add_request(1, [10, 11, 12, 13, 14, 10, 11], 20)
    step = planner.plan()
    planner.report(step.step_id, [1], [12])
    return planner.plan().entries()[0]


def test_the_planner_drafts_only_where_the_measured_costs_pay():
    options = dict(max_draft_tokens=4, speculative_ngram=True, vocab_size=100)
    cheap = Planner(64, 4, **options)
    cheap.set_decode_costs([0.0, 10.0, 10.5, 11.0, 11.5, 12.0], 0.5)
    assert _first_decode(cheap)["input_ids"] == [13, 14, 10, 11]
    dear = Planner(64, 4, **options)
    dear.set_decode_costs([0.0, 10.0, 20.0, 30.0, 40.0, 50.0], 0.0)
    assert _first_decode(dear)["num_tokens"] == 1
    with pytest.raises(ValueError):
        dear.set_decode_costs([0.0, 10.0], -1.0)
    with pytest.raises(ValueError):
        dear.set_decode_costs([0.0, math.inf], 0.0)

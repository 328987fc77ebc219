"""Tenant fairness without a model: the name → id table (bounded, ids reused), the settings
(`--fairness tenant` needs the fcfs policy: one line at start, also with --dp) and the /metrics
rendering of the per-tenant counts. The end-to-end behaviour is tests/test_http_fairness.py's."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pyserve import cli, replicas
from pyserve.engine.config import EngineConfig
from pyserve.engine.tenants import ANONYMOUS, TenantIds
from pyserve.http.metrics import Metrics

# ------------------------------------------------------------------ the table


def test_a_name_keeps_its_id_and_no_name_is_the_anonymous_tenant():
    table = TenantIds(capacity=8)
    alice = table.acquire("alice")
    assert 1 <= alice <= 8
    assert table.acquire("alice") == alice
    bob = table.acquire("bob")
    assert bob not in (alice, ANONYMOUS)
    assert table.acquire(None) == table.acquire("") == ANONYMOUS
    assert (table.name(alice), table.name(bob), table.name(ANONYMOUS)) == ("alice", "bob", None)
    assert [table.live_requests(t) for t in (alice, bob, ANONYMOUS)] == [2, 1, 2]
    assert (len(table), table.active) == (2, 3)
    for tenant in (alice, alice, bob, ANONYMOUS, ANONYMOUS):
        table.release(tenant)
    assert table.active == 0 and len(table) == 2  # idle names are remembered...
    assert table.acquire("alice") == alice  # ...and keep their ids while not reused


def test_a_full_table_reuses_the_idle_id_with_the_smallest_count():
    counts = {1: 500, 2: 100, 3: 100}
    table = TenantIds(capacity=3, served=lambda: counts)
    ids = [table.acquire(name) for name in ("a", "b", "c")]
    assert ids == [1, 2, 3]
    assert table.acquire("d") == ANONYMOUS  # every id has a live request: d shares id 0
    table.release(ANONYMOUS)
    for tenant in (3, 1, 2):  # c, then a, then b go idle
        table.release(tenant)
    # b and c have the smallest count; c went idle first
    assert table.acquire("e") == 3
    assert table.name(3) == "e" and table.acquire("c") == 2  # c is forgotten: a new id
    assert table.name(2) == "c"
    assert table.acquire("f") == 1  # the last idle id, whatever its count
    assert table.acquire("g") == ANONYMOUS
    assert len(table) == 3


def test_a_live_tenant_is_never_forgotten():
    table = TenantIds(capacity=2)
    held = table.acquire("held")
    other = table.acquire("other")
    table.release(other)
    for i in range(10):
        tenant = table.acquire(f"new-{i}")
        assert tenant == other
        table.release(tenant)
    assert table.name(held) == "held" and table.live_requests(held) == 1


def test_a_flood_of_names_stays_within_the_capacity():
    table = TenantIds(capacity=16)
    for i in range(20_000):
        tenant = table.acquire(f"user-{i}")
        assert 1 <= tenant <= 16
        table.release(tenant)
    assert len(table) == 16 and table.active == 0
    assert len(table._names) == 16 and len(table._idle) == 16  # nothing else grows


# ------------------------------------------------------------------ settings


def test_fairness_needs_the_fcfs_policy():
    EngineConfig(fairness="tenant").validate()
    EngineConfig(fairness="none", schedule_policy="priority").validate()
    for policy in ("lpm", "priority"):
        with pytest.raises(ValueError, match=f"needs schedule policy fcfs, got {policy}"):
            EngineConfig(fairness="tenant", schedule_policy=policy).validate()
    with pytest.raises(ValueError, match="fairness must be none or tenant"):
        EngineConfig(fairness="weighted").validate()
    EngineConfig(fairness="tenant", fairness_quantum=0).validate()
    with pytest.raises(ValueError, match="fairness_quantum must be >= 0, got -1"):
        EngineConfig(fairness="tenant", fairness_quantum=-1).validate()


@pytest.mark.parametrize("dp", [[], ["--dp", "2"]], ids=["one", "replicas"])
def test_fairness_with_another_policy_fails_at_start_with_one_line(dp, caplog):
    argv = ["run", "--fairness", "tenant", "--schedule-policy", "priority", *dp]
    assert cli.main(argv) == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "invalid settings: fairness tenant orders admission by itself: it needs schedule "
        "policy fcfs, got priority"
    ]


def test_with_replicas_a_warning_says_what_the_router_forwards(monkeypatch, caplog):
    class Supervisor:  # stands in for the replicas and the router
        def __init__(self, args, parser) -> None:
            pass

        async def run(self) -> int:
            return 0

    monkeypatch.setattr(replicas, "router_installed", lambda: True)
    monkeypatch.setattr(replicas, "Supervisor", Supervisor)
    assert cli.main(["run", "--dp", "2", "--fairness", "tenant"]) == 0
    assert "passes the user field on for /v1/completions only" in caplog.text
    caplog.clear()
    assert cli.main(["run", "--dp", "2"]) == 0
    assert "user field" not in caplog.text


def test_the_flag_reaches_the_engine_config_and_the_replicas():
    parser = cli.build_parser()
    assert cli.engine_config(parser.parse_args(["run"])).fairness == "none"
    args = parser.parse_args(["run", "--dp", "2", "--fairness", "tenant"])
    assert cli.engine_config(args).fairness == "tenant"
    assert replicas.replica_args(parser, args) == ["--fairness", "tenant"]
    assert cli.engine_config(args).fairness_quantum == 4096
    args = parser.parse_args(
        ["run", "--dp", "2", "--fairness", "tenant", "--fairness-quantum", "9"]
    )
    assert cli.engine_config(args).fairness_quantum == 9
    assert replicas.replica_args(parser, args) == [
        "--fairness",
        "tenant",
        "--fairness-quantum",
        "9",
    ]
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--fairness", "user"])


# ------------------------------------------------------------------ /metrics


class CountingEngine:
    def __init__(self, tenants: dict | None) -> None:
        self.tenants = tenants

    def stats(self) -> dict:
        return {"num_blocks": 10, "tenants": self.tenants}


def tenant_samples(text: bytes) -> dict:
    found = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name.startswith("pyserve_tenant"):
                found[(sample.name, sample.labels.get("tenant"))] = sample.value
    return found


def test_metrics_label_the_top_tenants_by_name_and_say_nothing_without_fairness():
    top = [
        {"name": 'quote " and \\ and\nnewline', "tokens": 900, "requests": 1},
        {"name": None, "tokens": 40, "requests": 0},
    ]
    engine = CountingEngine({"active": 3, "tracked": 7, "capacity": 4096, "top": top})
    assert tenant_samples(Metrics(engine).render()) == {
        ("pyserve_tenants_active", None): 3.0,
        ("pyserve_tenant_tokens", 'quote " and \\ and\nnewline'): 900.0,
        ("pyserve_tenant_tokens", ""): 40.0,  # the anonymous tenant
    }
    assert tenant_samples(Metrics(CountingEngine(None)).render()) == {}

"""Tenant fairness through a real `pyserve run --fairness tenant --max-running-requests 1`, and
the same server without the flag as the control. Tenant alice sends one request, which starts,
then a backlog of five; then bob sends one. With fairness bob's request starts as soon as
alice's first ends, ahead of her whole backlog (bob has been served fewer tokens); without it,
bob waits behind the backlog. The worker's steps are held (a test hook) until all the requests
have reached the core, and one running slot makes the order of completion the order of
admission, so the order never depends on how the machine schedules the client. Every dialect
names a tenant (and refuses a bad name with a 400 naming the field); /metrics, /stats and
/server_info show the tenants and the setting."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
from http_testlib import (
    GENERATION_PATHS,
    HANG_GUARD_S,
    held_tiny_server,
    kv_idle,
    metrics,
    request,
    short_generation_body,
    wait_for_metrics,
)

NEW_TOKENS = 24
LONG_TOKENS = 160
BACKLOG = 5


@pytest.fixture(scope="module")
def fair(tmp_path_factory, hold):
    # alice's requests of NEW_TOKENS stay within the quantum; LONG_TOKENS pass it
    args = ["--fairness", "tenant", "--max-running-requests", "1", "--fairness-quantum", "64"]
    with held_tiny_server(tmp_path_factory.getbasetemp(), hold, *args) as server:
        yield server


@pytest.fixture(scope="module")
def unfair(tmp_path_factory, hold):
    args = ["--max-running-requests", "1"]
    with held_tiny_server(tmp_path_factory.getbasetemp(), hold, *args) as server:
        yield server


Wave = list[tuple[str, str, int]]  # (name, user, max_tokens) of requests sent together


def body_for(name: str, user: str, max_tokens: int) -> dict:
    return {
        "prompt": f"{name} says",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "user": user,
    }


def run_in_waves(url: str, hold, waves: list[Wave]) -> tuple[list[str], dict[str, str]]:
    """Each wave's requests sent once the earlier ones are all in the core, behind held steps;
    the names in the order their responses came, and their texts."""
    done: list[str] = []
    texts: dict[str, str] = {}

    async def complete(http: aiohttp.ClientSession, name: str, user: str, n: int) -> None:
        async with http.post(url + "/v1/completions", json=body_for(name, user, n)) as resp:
            assert resp.status == 200, await resp.text()
            result = await resp.json()
        assert result["usage"]["completion_tokens"] == n
        texts[name] = result["choices"][0]["text"]
        done.append(name)

    def in_core(n: int):
        return lambda m: m["pyserve_requests_running"] + m["pyserve_requests_waiting"] == n

    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            hold.touch()
            tasks = []
            try:
                for wave in waves:
                    for name, user, n in wave:
                        tasks.append(asyncio.create_task(complete(http, name, user, n)))
                    await asyncio.to_thread(wait_for_metrics, url, in_core(len(tasks)))
            finally:
                hold.unlink()
            await asyncio.gather(*tasks)

    asyncio.run(scenario())
    wait_for_metrics(url, kv_idle)
    return done, texts


def completion_order(url: str, hold) -> list[str]:
    """alice's first request, then her backlog, then bob's, all queued behind held steps;
    the names in the order their responses came."""
    backlog = [(f"alice-{i}", "alice", NEW_TOKENS) for i in range(1, BACKLOG + 1)]
    waves = [[("alice-0", "alice", NEW_TOKENS)], backlog, [("bob", "bob", NEW_TOKENS)]]
    return run_in_waves(url, hold, waves)[0]


def stats(url: str) -> dict:
    status, _, body = request(url + "/stats")
    assert status == 200, body
    return json.loads(body)


def wait_for_tenant(url: str, name: str | None) -> dict:
    """The tenant's row in /stats once it shows (the planner's numbers are a snapshot taken
    every 0.1 s, which a response may outrun)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        rows = [t for t in stats(url)["tenants"]["top"] if t["name"] == name]
        if rows and rows[0]["tokens"] > 0:
            return rows[0]
        assert time.monotonic() < deadline, f"no tenant {name!r} in {stats(url)['tenants']}"
        time.sleep(0.05)


def tenant_tokens(url: str) -> dict[str, float]:
    """/metrics' pyserve_tenant_tokens by tenant label."""
    _, _, text = request(url + "/metrics")
    found = re.findall(r'^pyserve_tenant_tokens\{tenant="([^"]*)"\} (\S+)$', text.decode(), re.M)
    return {name: float(value) for name, value in found}


def test_a_tenants_request_starts_ahead_of_another_tenants_backlog(fair, hold):
    order = completion_order(fair.url, hold)
    assert order[0] == "alice-0"  # admitted before bob came: nothing preempts it
    assert order[1] == "bob", order
    assert sorted(order[2:]) == [f"alice-{i}" for i in range(1, BACKLOG + 1)]
    # alice was planned her prompts and 6 x 24 tokens, bob one prompt and 24 tokens, from
    # alice's count when he came (she had a request in the server: no credit for idle time)
    served = {t["name"]: t for t in stats(fair.url)["tenants"]["top"]}
    assert served["alice"]["tokens"] > served["bob"]["tokens"] > NEW_TOKENS
    assert served["alice"]["requests"] == served["bob"]["requests"] == 0
    tokens = tenant_tokens(fair.url)
    assert tokens["alice"] == served["alice"]["tokens"]
    assert tokens["bob"] == served["bob"]["tokens"]


def test_a_long_running_request_gives_its_slot_to_another_tenant_and_still_completes(fair, hold):
    """erin's long request runs (with a backlog of hers behind it) when frank's arrives: once
    erin has been served the quantum (64) more than frank, her request is retracted and his
    runs to its end first (it stays within the quantum); hers is then recomputed and finishes
    with the same greedy text as when it runs alone."""
    before = metrics(fair.url)
    backlog = [(f"erin-{i}", "erin", 8) for i in (1, 2)]  # new tenants: no earlier counts
    waves = [[("erin-0", "erin", LONG_TOKENS)], backlog, [("frank", "frank", 16)]]
    order, texts = run_in_waves(fair.url, hold, waves)
    # the backlog's two requests are sent together: they reach the queue in either order
    assert order[:2] == ["frank", "erin-0"] and sorted(order[2:]) == ["erin-1", "erin-2"], order
    after = metrics(fair.url)
    preempted = (
        after["pyserve_fairness_retractions_total"] - before["pyserve_fairness_retractions_total"]
    )
    assert preempted >= 1
    assert after["pyserve_retractions_total"] - before["pyserve_retractions_total"] >= preempted
    assert stats(fair.url)["tenants"]["preempted"] == after["pyserve_fairness_retractions_total"]
    status, _, text = request(fair.url + "/v1/completions", body_for("erin-0", "erin", LONG_TOKENS))
    assert status == 200, text
    assert json.loads(text)["choices"][0]["text"] == texts["erin-0"]
    wait_for_metrics(fair.url, kv_idle)


def test_without_fairness_the_same_request_waits_behind_the_backlog(unfair, hold):
    order = completion_order(unfair.url, hold)
    assert order[0] == "alice-0" and order[-1] == "bob", order
    assert stats(unfair.url)["tenants"] is None
    assert tenant_tokens(unfair.url) == {}


def body_with_user(url: str, path: str, user: object) -> dict:
    body = short_generation_body(url, path)
    if path == "/v1/messages":
        return dict(body, metadata={"user_id": user})
    return dict(body, user=user)


USER_PARAM = {"/v1/messages": "metadata.user_id"}


@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_every_dialect_names_a_tenant_and_refuses_a_bad_name(fair, path):
    name = f"tenant of {path}"
    status, _, text = request(fair.url + path, body_with_user(fair.url, path, name))
    assert status == 200, text
    wait_for_tenant(fair.url, name)
    param = USER_PARAM.get(path, "user")
    for bad in (7, ["alice"], "x" * 257):
        status, _, text = request(fair.url + path, body_with_user(fair.url, path, bad))
        assert status == 400, text
        error = json.loads(text)["error"]
        assert param in error["message"] or error.get("param") == param, error
        if path == "/v1/messages":
            assert json.loads(text)["type"] == "error"  # Anthropic's shape
        else:
            assert error["param"] == param


def test_requests_without_a_user_share_the_anonymous_tenant(fair):
    status, _, text = request(fair.url + "/generate", short_generation_body(fair.url, "/generate"))
    assert status == 200, text
    wait_for_tenant(fair.url, None)
    assert "" in tenant_tokens(fair.url)


@pytest.mark.parametrize("path", GENERATION_PATHS)
def test_without_fairness_only_generate_refuses_user(unfair, path):
    status, _, text = request(unfair.url + path, body_with_user(unfair.url, path, "x" * 300))
    if path == "/generate":  # pyserve's own field: it would change nothing, so it is refused
        assert status == 400, text
        error = json.loads(text)["error"]
        assert (error["param"], error["code"]) == ("user", "unsupported_parameter")
        assert "--fairness tenant" in error["message"]
    else:  # OpenAI's and Anthropic's: accepted, changing nothing
        assert status == 200, text


def test_server_info_says_the_setting(fair, unfair):
    for server, setting in ((fair, "tenant"), (unfair, "none")):
        info = json.loads(request(server.url + "/server_info")[2])
        assert info["fairness"] == info["config"]["fairness"] == setting


def test_embeddings_name_their_tenant_too(fair):
    body = {"input": ["hi", "there"], "user": "embedder"}
    status, _, text = request(fair.url + "/v1/embeddings", body)
    assert status == 200, text
    wait_for_tenant(fair.url, "embedder")


def test_odd_names_are_tenants_and_every_view_still_renders(fair):
    from prometheus_client.parser import text_string_to_metric_families

    odd = ['line\nbreak "quoted" back\\slash', "😀" * 256, "\x00", "<script>x</script>"]
    for name in odd:
        body = {"prompt": "hi", "max_tokens": 2, "user": name}
        status, _, text = request(fair.url + "/v1/completions", body)
        assert status == 200, text
        wait_for_tenant(fair.url, name)
    status, _, text = request(fair.url + "/metrics")
    assert status == 200
    labels = {
        sample.labels.get("tenant")
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
        if sample.name == "pyserve_tenant_tokens"
    }
    assert set(odd) <= labels

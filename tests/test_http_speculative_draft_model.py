"""`pyserve run --speculative-algorithm standalone`: a draft model in the worker (here the tiny
model itself, which agrees with the target, so its drafts are accepted) whose drafts are verified
in the batched step: greedy output equal to HF transformers' (float32), drafts accepted and
counted, the settings in /server_info. The worker's side: tests/test_speculative_draft_model.py."""

from __future__ import annotations

import json

import pytest
from http_testlib import (
    check_against_reference,
    kv_idle,
    references,
    request,
    running_server,
    tiny_model,
    wait_for_metrics,
)

from pyserve.engine import EngineConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(model):
    args = ["--model", str(model), "--dtype", "float32", "--kv-cache-dtype", "float32"]
    args += ["--speculative-algorithm", "standalone"]
    args += ["--speculative-draft-model-path", str(model), "--kv-cache-tokens", "2048"]
    args += ["--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(args) as server:
        yield server


def test_greedy_output_equals_transformers_with_the_draft_models_drafts(server, model):
    accepted = 0
    for ref in references(model):
        params = {"max_new_tokens": len(ref["output"]), "temperature": 0, "ignore_eos": True}
        status, _, raw = request(
            server.url + "/generate", {"text": ref["text"], "sampling_params": params}
        )
        assert status == 200, raw
        out = json.loads(raw)
        check_against_reference(out["output_ids"], ref, ref["text"])
        accepted += out["meta_info"]["spec_accepted_tokens"]
    # The planner drafts only while its measured step costs say drafts pay, and a model drafting
    # for itself never does: its drafts run until a plain step has been measured (the first
    # requests) and in each later re-measurement, not in every request.
    assert accepted > 0
    idle = wait_for_metrics(server.url, kv_idle)
    assert idle["pyserve_spec_accepted_tokens_total"] >= accepted
    info = json.loads(request(server.url + "/server_info")[2])["speculative"]
    assert info["algorithm"] == "standalone" and info["draft_model_path"] == str(model)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"speculative_algorithm": "standalone"}, "needs speculative_draft_model_path"),
        ({"speculative_draft_model_path": "d.gguf"}, "is for speculative_algorithm standalone"),
        (
            {
                "speculative_algorithm": "standalone",
                "speculative_draft_model_path": "d",
                "tp_size": 2,
            },
            "does not run with tp_size > 1",
        ),
    ],
)
def test_draft_model_settings_that_cannot_work_are_refused_before_start(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings).validate()

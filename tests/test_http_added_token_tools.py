"""Tool calls on a tokenizer built as Qwen2.5's and Qwen3's are: the markers ``<tool_call>`` and
``</tool_call>`` are added tokens that are not flagged special.

One `pyserve run` server for the module, on a tiny random-weight model whose tokenizer is
SmolLM2's plus those two added tokens, with a Hermes-style template (the format Qwen uses). The
grammar that forces calls must take each marker as the one token the model writes; a token the
grammar then rejects must fail the request, never end it quietly as if it were complete.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
from http_testlib import running_server, wait_for_metrics
from test_structured_outputs import TOOL_TEMPLATE, TOOLS, Flags
from tiny_models import SMOLLM2_VOCAB, build_tiny_smollm

MODEL = "qwen-like-markers"
MARKERS = ("<tool_call>", "</tool_call>")
MAX_TOKENS = 1024  # more than the longest call the tools' bounded schemas allow
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("added-markers") / MODEL
    directory.mkdir()
    build_tiny_smollm(
        directory,
        seed=4321,
        max_position_embeddings=4096,
        vocab_size=SMOLLM2_VOCAB + 64,  # room for the added tokens, as real models pad theirs
        added_tokens=[(marker, False) for marker in MARKERS],
    )
    (directory / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    added = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    assert {t["content"]: t["special"] for t in added if t["content"] in MARKERS} == {
        marker: False for marker in MARKERS
    }
    return directory


@pytest.fixture(scope="module")
def server(model_dir):
    args = ["--model", str(model_dir), "--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(args) as server:
        yield server


def sampling(seed: int | None) -> dict:
    return {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def assert_valid_calls(choice) -> list[tuple[str, dict]]:
    assert choice.finish_reason == "tool_calls", choice
    calls = calls_of(choice.message)
    assert calls
    for call, (name, arguments) in zip(choice.message.tool_calls, calls, strict=True):
        assert call.id.startswith("call_") and call.type == "function"
        assert set(arguments) == {"get_weather": {"city", "unit"}, "get_time": {"zone"}}[name]
    assert not choice.message.content  # the markers and calls are all consumed
    return calls


@pytest.mark.parametrize("seed", [None, 5, 11])
def test_required_calls_a_tool_and_writes_each_marker_as_its_added_token(client, seed) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        logprobs=True,
        **sampling(seed),
    )
    choice = completion.choices[0]
    assert_valid_calls(choice)
    tokens = [entry.token for entry in choice.logprobs.content]
    assert tokens[0] == "<tool_call>"  # one token, the added one, not spelled piece by piece
    assert (
        tokens.count("<tool_call>")
        == tokens.count("</tool_call>")
        == len(choice.message.tool_calls)
    )


def test_a_named_tool_choice_calls_exactly_that_tool_once(client) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    calls = assert_valid_calls(completion.choices[0])
    assert [name for name, _ in calls] == ["get_time"]


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls(client, parallel: bool) -> None:
    counts = set()
    for seed in range(4):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=MAX_TOKENS,
            **sampling(seed),
        )
        counts.add(len(assert_valid_calls(completion.choices[0])))
    assert counts <= ({1, 2, 3, 4, 5, 6, 7, 8} if parallel else {1})


def test_streamed_calls_assemble_to_the_whole_response(client) -> None:
    body = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    whole = client.chat.completions.create(**body).choices[0]
    calls: dict[int, dict] = {}
    content = ""
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and not content
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert streamed == calls_of(whole.message)


def test_auto_answers_in_text_or_calls_and_loses_nothing(server, client) -> None:
    plain = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0
    ).choices[0]
    assert plain.finish_reason == "length" and plain.message.content  # a random model's text
    assert not plain.message.tool_calls
    # The model writes the added marker on its own (forced here with logit_bias): a call that
    # does not parse stays in the content, marker included.
    marker_id = requests.post(
        server.url + "/tokenize", json={"prompt": "<tool_call>"}, timeout=60
    ).json()["tokens"]
    assert len(marker_id) == 1
    forced = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=3,
        temperature=0,
        logit_bias={str(marker_id[0]): 100},
    ).choices[0]
    assert forced.message.content == "<tool_call>" * 3 and not forced.message.tool_calls


@pytest.mark.parametrize("seed", [None, 2])
def test_auto_with_a_response_format_answers_with_calls_or_the_json(client, seed) -> None:
    choice = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        response_format=Flags,  # bounded: every answer ends within max_tokens
        max_tokens=MAX_TOKENS,
        **sampling(seed),
    ).choices[0]
    if choice.message.tool_calls:
        assert_valid_calls(choice)
    else:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Flags)


def test_a_token_the_grammar_rejects_fails_the_request_instead_of_stopping_it(server) -> None:
    # Spelled as a literal, an added marker is where llguidance's mask lets the added token
    # through and its matcher then rejects it. Whatever llguidance does, the request must not
    # come back as a complete answer that does not follow its grammar.
    body = {
        "text": "Call:",
        "sampling_params": {
            "ebnf": 'root ::= "<tool_call>" "\\n" "done"',
            "max_new_tokens": 16,
            "temperature": 0,
        },
    }
    response = requests.post(server.url + "/generate", json=body, timeout=120)
    if response.status_code == 200:
        assert response.json()["text"] == "<tool_call>\ndone"
    else:
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "grammar_error" and "grammar" in error["message"]
        assert any(re.search("grammar rejected the token", line) for line in server.lines)
    again = requests.post(
        server.url + "/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
        timeout=120,
    )
    assert again.status_code == 200
    # the failed request's KV blocks came back: the idle self-check finds nothing missing
    after = wait_for_metrics(server.url, lambda m: m["pyserve_idle_checks_total"] >= 1)
    assert after["pyserve_idle_check_failures_total"] == 0

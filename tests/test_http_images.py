"""Images in chat, end to end: `pyserve run` on a tiny random Idefics3 (SmolVLM's architecture,
``vision_models.py``) answers image questions sent through the openai SDK exactly as
transformers' generate does with its own processor (float32 K/V: token ids and top logprobs
within 1e-4), from data:, http:// and file:// URLs; the same picture again is a prefix hit, a
picture one pixel apart shares no image KV; bad images are 400s naming the part, and nothing
leaks. The same answers come through the anthropic SDK (base64 and url image sources) and
SGLang's /generate (the rendered prompt's text with ``image_data``). The images' http server is
a local one in this process (no internet).
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import tempfile
import threading
from pathlib import Path

import anthropic
import jinja2.sandbox
import numpy as np
import pytest
from http_testlib import kv_idle, openai_client, request, running_server, wait_for_metrics
from tokenizers import Tokenizer
from vision_models import (
    IMAGE_CASES,
    PICTURE,
    QUESTION,
    TOP_LOGPROBS,
    build_tiny_vlm,
    data_url,
    png_base64,
    random_picture,
)

MAX_NEW = 8
# the shared cases, and the first picture with one pixel changed
CASES = [
    *IMAGE_CASES,
    {  # the first picture with one pixel changed
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
        ],
        "images": [[*PICTURE, True]],
    },
]
MAX_IMAGES = 4


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="pyserve-test-images-") as directory:
        yield Path(directory)


@pytest.fixture(scope="module")
def model(workdir) -> Path:
    return build_tiny_vlm(
        workdir / "tiny-idefics3", family="idefics3", seed=0, cases=CASES, max_new_tokens=MAX_NEW
    )


@pytest.fixture(scope="module")
def references(model) -> list[dict]:
    return json.loads((model / "references.json").read_text())


@pytest.fixture(scope="module")
def media(workdir) -> Path:
    """Pictures as files: served over http and readable as file:// URLs."""
    directory = workdir / "media"
    directory.mkdir()
    for h, w, seed in ([40, 50, 2], [64, 64, 3]):
        random_picture(h, w, seed).save(directory / f"{seed}.png")
    (directory / "note.txt").write_text("not a picture")
    return directory


@pytest.fixture(scope="module")
def image_host(media):
    """A local http server for the pictures (the server fetches from it)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(model, media):
    args = ["--model", str(model), "--kv-cache-dtype", "float32", "--kv-cache-tokens", "8192"]
    args += ["--torch-threads", "1", "--tokenizer-workers", "1"]
    args += ["--allowed-media-dir", str(media), "--max-images-per-request", str(MAX_IMAGES)]
    with running_server(args) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return Tokenizer.from_file(str(model / "tokenizer.json"))


def image_part(url: str, detail: str | None = None) -> dict:
    image_url = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": image_url}


def ask(client, content: list[dict] | str, **options):
    return client.chat.completions.create(
        model="tiny-idefics3",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
        extra_body={"ignore_eos": True},
        **options,
    )


def assert_matches(out, reference: dict, tokenizer: Tokenizer) -> None:
    """The answer is transformers' greedy output, each position's top logprobs within 1e-4."""
    assert out.usage.prompt_tokens == len(reference["prompt"])
    assert out.choices[0].message.content == tokenizer.decode(reference["output"])
    ours = [[t.logprob for t in p.top_logprobs] for p in out.choices[0].logprobs.content]
    np.testing.assert_allclose(ours, reference["top_logprobs"], atol=1e-4)


def test_one_image_is_answered_as_transformers_answers_it(client, references, tokenizer):
    content = [image_part(data_url(*PICTURE)), {"type": "text", "text": QUESTION}]
    assert_matches(ask(client, content), references[0], tokenizer)


def test_two_images_from_a_file_and_an_http_url(client, references, tokenizer, media, image_host):
    content = [
        {"type": "text", "text": "Compare"},
        image_part((media / "2.png").as_uri()),
        {"type": "text", "text": "and"},
        image_part(f"{image_host}/3.png"),
    ]
    assert_matches(ask(client, content), references[1], tokenizer)


def test_the_image_reaches_the_model_one_pixel_apart_gives_other_logprobs(
    client, references, tokenizer
):
    # random weights may give the same greedy ids for both pictures: their logprobs differ
    assert not np.allclose(references[0]["top_logprobs"], references[2]["top_logprobs"])
    content = [image_part(data_url(*PICTURE, alter_pixel=True)), {"type": "text", "text": QUESTION}]
    assert_matches(ask(client, content), references[2], tokenizer)


def test_the_same_image_again_is_a_prefix_hit_and_one_pixel_apart_shares_no_image_kv(
    client, references, tokenizer
):
    picture = [100, 150, 7]  # no other test sends it: nothing of it is cached yet

    def content(alter_pixel: bool) -> list[dict]:
        url = data_url(*picture, alter_pixel=alter_pixel)
        return [image_part(url), {"type": "text", "text": QUESTION}]

    first = ask(client, content(False))
    again = ask(client, content(False))
    assert again.choices[0].message.content == first.choices[0].message.content
    top = [[t.logprob for t in p.top_logprobs] for p in first.choices[0].logprobs.content]
    top_again = [[t.logprob for t in p.top_logprobs] for p in again.choices[0].logprobs.content]
    np.testing.assert_allclose(top_again, top, atol=1e-4)
    # the same prompt layout as the first case's picture (same size)
    image_token = tokenizer.token_to_id("<image>")
    positions = [i for i, t in enumerate(references[0]["prompt"]) if t == image_token]
    assert first.usage.prompt_tokens_details.cached_tokens <= positions[0]
    # the whole image is cached: every block up to the last one the prompt fills
    assert again.usage.prompt_tokens_details.cached_tokens > positions[-1]
    apart = ask(client, content(True))
    assert apart.usage.prompt_tokens_details.cached_tokens <= positions[0]


def test_detail_low_sends_the_picture_whole_without_its_tiles(client):
    content = [{"type": "text", "text": QUESTION}]
    auto = ask(client, [image_part(data_url(*PICTURE)), *content])
    low = ask(client, [image_part(data_url(*PICTURE), detail="low"), *content])
    tiles = 4  # a 100 x 150 picture at 128 px: 2 x 2 tiles beside the whole
    assert auto.usage.prompt_tokens - low.usage.prompt_tokens > tiles * 16


def test_a_streamed_answer_about_an_image_is_the_same(client, references, tokenizer):
    content = [image_part(data_url(*PICTURE)), {"type": "text", "text": QUESTION}]
    stream = client.chat.completions.create(
        model="tiny-idefics3",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == tokenizer.decode(references[0]["output"])


def test_text_only_turns_still_work_on_a_vision_model(client):
    out = ask(client, "Hello there")
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == MAX_NEW


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("data:image/png;base64,!!!not-base64!!!", "base64"),
        ("data:text/plain;base64,aGVsbG8=", "image"),
        (
            "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"x" * 40).decode(),
            "",
        ),
        ("ftp://example.com/a.png", "unsupported"),
        ("file:///etc/passwd", "allowed"),
        ("{host}/missing.png", "404"),
        ("{host}/note.txt", "not an image"),
    ],
)
def test_a_bad_image_is_a_400_naming_its_part(server, image_host, url, reason):
    url = url.format(host=image_host)
    content = [{"type": "text", "text": "look"}, image_part(url)]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    status, _, raw = request(server.url + "/v1/chat/completions", body)
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == "messages[0].content[1].image_url"
    assert reason.lower() in error["message"].lower()


def test_too_many_images_are_refused(server):
    part = image_part(data_url(8, 8, 5))
    message = {"role": "user", "content": [part] * (MAX_IMAGES + 1)}
    body = {"messages": [message], "max_tokens": 2}
    status, _, raw = request(server.url + "/v1/chat/completions", body)
    assert status == 400, raw
    assert str(MAX_IMAGES) in json.loads(raw)["error"]["message"]


def test_server_info_says_the_model_takes_images(server):
    status, _, raw = request(server.url + "/server_info")
    assert status == 200
    info = json.loads(raw)
    assert info["modalities"] == ["text", "image"]
    assert info["images"]["file_urls"] is True


# ----------------------------------------------------------------------------- Anthropic


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        yield client


def base64_block(height: int, width: int, seed: int) -> dict:
    source = {"type": "base64", "media_type": "image/png", "data": png_base64(height, width, seed)}
    return {"type": "image", "source": source}


def ask_claude(claude, content: list[dict]):
    return claude.messages.create(
        model="tiny-idefics3",
        max_tokens=MAX_NEW,
        messages=[{"role": "user", "content": content}],
        extra_body={"temperature": 0},  # the SDK no longer takes it as an argument
    )


def assert_claude_matches(message, reference: dict, tokenizer: Tokenizer) -> None:
    """The text is transformers' greedy output (up to the end of turn, if it came first)."""
    usage = message.usage  # Anthropic's input_tokens leave out what the cache read
    assert usage.input_tokens + usage.cache_read_input_tokens == len(reference["prompt"])
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == MAX_NEW
    output = reference["output"][: message.usage.output_tokens]
    assert "".join(b.text for b in message.content) == tokenizer.decode(output)


def test_anthropic_base64_image_is_answered_as_transformers_answers_it(
    claude, references, tokenizer
):
    content = [base64_block(*PICTURE), {"type": "text", "text": QUESTION}]
    assert_claude_matches(ask_claude(claude, content), references[0], tokenizer)


def test_a_streamed_anthropic_answer_about_an_image_is_the_same(claude, references, tokenizer):
    content = [base64_block(*PICTURE), {"type": "text", "text": QUESTION}]
    with claude.messages.stream(
        model="tiny-idefics3",
        max_tokens=MAX_NEW,
        messages=[{"role": "user", "content": content}],
        extra_body={"temperature": 0},
    ) as stream:
        message = stream.get_final_message()
    assert_claude_matches(message, references[0], tokenizer)


def test_anthropic_url_images(claude, references, tokenizer, image_host):
    def url_block(name: str) -> dict:
        return {"type": "image", "source": {"type": "url", "url": f"{image_host}/{name}"}}

    content = [
        {"type": "text", "text": "Compare"},
        url_block("2.png"),
        {"type": "text", "text": "and"},
        url_block("3.png"),
    ]
    assert_claude_matches(ask_claude(claude, content), references[1], tokenizer)


def test_anthropic_counts_the_image_tokens(claude, references):
    content = [base64_block(*PICTURE), {"type": "text", "text": QUESTION}]
    count = claude.messages.count_tokens(
        model="tiny-idefics3", messages=[{"role": "user", "content": content}]
    )
    assert count.input_tokens == len(references[0]["prompt"])


@pytest.mark.parametrize(
    ("block", "param", "words"),
    [
        (
            {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": ""}},
            "messages[0].content[1].source",
            "media_type",
        ),
        (
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!"}},
            "messages[0].content[1].source",
            "base64",
        ),
        (
            {"type": "image", "source": {"type": "url"}},
            "messages[0].content[1].source",
            "url",
        ),
        (
            {"type": "image", "source": {"type": "file", "file_id": "file_1"}},
            "messages[0].content[1].source",
            "file",
        ),
        (
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": [base64_block(8, 8, 5)],
            },
            "messages[0].content[1].content[0]",
            "tool_result",
        ),
    ],
)
def test_a_bad_anthropic_image_is_a_400_naming_its_block(server, block, param, words):
    content = [{"type": "text", "text": "look"}, block]
    body = {
        "model": "tiny-idefics3",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": content}],
    }
    status, _, raw = request(server.url + "/v1/messages", body)
    assert status == 400, raw
    answer = json.loads(raw)
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert param in answer["error"]["message"] and words in answer["error"]["message"]


# ----------------------------------------------------------------------------- /generate


@pytest.fixture(scope="module")
def chat_text(model) -> str:
    """Case 0's prompt as the model's chat template renders it (the template writes the
    marker), rendered here as transformers renders it."""
    saved = model / "chat_template.jinja"
    if saved.is_file():
        template = saved.read_text()
    else:
        template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=CASES[0]["messages"], add_generation_prompt=True
    )


def generate(server, body: dict) -> tuple[int, dict]:
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    status, _, raw = request(server.url + "/generate", {"sampling_params": sampling, **body})
    return status, json.loads(raw)


@pytest.mark.parametrize("form", ["data_url", "bare_base64_list"])
def test_generate_with_image_data_gives_transformers_ids(server, references, chat_text, form):
    assert chat_text.count("<image>") == 1
    image = data_url(*PICTURE) if form == "data_url" else [png_base64(*PICTURE)]
    body = {"text": chat_text, "image_data": image}
    status, out = generate(server, {**body, "return_logprob": True, "top_logprobs_num": 5})
    assert status == 200, out
    assert out["output_ids"] == references[0]["output"]
    assert out["meta_info"]["prompt_tokens"] == len(references[0]["prompt"])
    top = [[v for v, _, _ in position] for position in out["meta_info"]["output_top_logprobs"]]
    np.testing.assert_allclose(top, references[0]["top_logprobs"], atol=1e-4)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"text": "<image> and <image>", "image_data": "{url}"}, "text", "2 image markers"),
        ({"text": "no marker", "image_data": "{url}"}, "text", "0 image markers"),
        ({"input_ids": [1, 2, 3], "image_data": "{url}"}, "image_data", "input_ids"),
        ({"text": ["<image>", "<image>"], "image_data": "{url}"}, "image_data", "batch"),
        ({"text": "<image>", "image_data": "data:image/png;base64,!!"}, "image_data", "base64"),
        ({"text": "<image>", "image_data": ["!!"]}, "image_data[0]", "base64"),
        ({"text": "<image>", "image_data": []}, "image_data", ""),
        ({"image_data": "{url}"}, "text", "needs a text prompt"),
    ],
)
def test_bad_image_data_is_a_400(server, body, param, words):
    if body["image_data"] == "{url}":
        body = {**body, "image_data": data_url(8, 8, 5)}
    status, out = generate(server, body)
    assert status == 400, out
    if param is not None:
        assert out["error"]["param"] == param, out
    assert words in out["error"]["message"], out


def test_nothing_is_left_behind(server):
    wait_for_metrics(server.url, kv_idle)

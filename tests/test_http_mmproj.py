"""Images from a GGUF text model and llama.cpp's ``--mmproj`` projector file, both written by
llama.cpp's own converter (``mmproj_files.py``): `pyserve run --model model.gguf --mmproj
mmproj.gguf` answers an image question as transformers does on the original HF weights, for
Gemma 3, SmolVLM/Idefics3 and Qwen2.5-VL; files that do not fit fail at start with one line
naming both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
from http_testlib import openai_client, running_server
from llama_cpp_source import required_converter
from mmproj_files import CONVERTIBLE, converted_vlm, rewritten_gguf
from tokenizers import Tokenizer
from vision_models import IMAGE_CASES, QUESTION, TOP_LOGPROBS, data_url

MAX_NEW = 8
# the tolerances of test_http_image_families.py and test_http_images.py (idefics3)
ATOL = {"gemma3": 1e-5, "idefics3": 1e-4, "qwen2_5_vl": 1e-4}
CASES = IMAGE_CASES[:1]
START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every family's HF model, text GGUF and mmproj, built side by side (subprocesses) once per
    pytest run."""
    required_converter()
    base = tmp_path_factory.getbasetemp() / "mmproj-models"
    with ThreadPoolExecutor(len(CONVERTIBLE)) as pool:
        built = list(pool.map(lambda f: converted_vlm(base, f, CASES, MAX_NEW), CONVERTIBLE))
    return dict(zip(CONVERTIBLE, built, strict=True))


@pytest.fixture(scope="module", params=list(CONVERTIBLE))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(files, family):
    directory = files[family]
    args = ["--model", str(directory / "model.gguf"), "--mmproj", str(directory / "mmproj.gguf")]
    args += ["--kv-cache-dtype", "float32", "--kv-cache-tokens", "2048"]
    args += ["--torch-threads", "1", "--tokenizer-workers", "1"]
    with running_server(args) as server:
        yield server


def test_an_image_is_answered_as_transformers_answers_it_on_the_hf_weights(server, files, family):
    hf = files[family] / "hf"
    reference = json.loads((hf / "references.json").read_text())[0]
    content = [
        {"type": "image_url", "image_url": {"url": data_url(*CASES[0]["images"][0])}},
        {"type": "text", "text": QUESTION},
    ]
    client = openai_client(server)
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.prompt_tokens == len(reference["prompt"])
    tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))
    assert out.choices[0].message.content == tokenizer.decode(
        reference["output"], skip_special_tokens=True
    )
    ours = [[t.logprob for t in p.top_logprobs] for p in out.choices[0].logprobs.content]
    np.testing.assert_allclose(ours, reference["top_logprobs"], atol=ATOL[family])
    # the picture reaches the text model: another one moves the logprobs
    content[0]["image_url"]["url"] = data_url(100, 150, 99)
    other = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
    )
    moved = [t.logprob for t in other.choices[0].logprobs.content[0].top_logprobs]
    assert np.abs(np.subtract(moved, ours[0])).max() > 1e-3
    info = requests.get(server.url + "/server_info", timeout=10).json()
    assert info["mmproj"]["family"] == family
    assert info["mmproj"]["path"] == str(files[family] / "mmproj.gguf")


# ---------------------------------------------------------------------- files that do not fit


def start_failure(model: Path, mmproj: Path) -> str:
    """The output of a `pyserve run` that must fail at start (its exit code checked)."""
    done = subprocess.run(
        [sys.executable, "-m", "pyserve", "run", "--port", "0", "--model", str(model),
         "--mmproj", str(mmproj)],
        capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def failure_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "did not start" in line]
    assert len(lines) == 1, output
    return lines[0]


def test_a_projector_for_another_vocabulary_fails_naming_both_files(files):
    model, mmproj = files["idefics3"] / "model.gguf", files["gemma3"] / "mmproj.gguf"
    line = failure_line(start_failure(model, mmproj))
    assert f"--mmproj {mmproj} does not fit --model {model}" in line
    assert "no <image_soft_token> token" in line


def test_a_qwen_projector_needs_the_qwen2vl_text_model(files):
    model, mmproj = files["idefics3"] / "model.gguf", files["qwen2_5_vl"] / "mmproj.gguf"
    line = failure_line(start_failure(model, mmproj))
    assert f"--mmproj {mmproj} does not fit --model {model}" in line
    assert "goes with a qwen2vl text model" in line and "not llama" in line


def test_a_projector_of_another_width_fails_naming_both_files(files, tmp_path):
    model = files["gemma3"] / "model.gguf"
    mmproj = rewritten_gguf(
        files["gemma3"] / "mmproj.gguf",
        tmp_path / "narrow.gguf",
        fields={"clip.vision.projection_dim": 32},
    )
    line = failure_line(start_failure(model, mmproj))
    assert f"--mmproj {mmproj} does not fit --model {model}" in line
    assert "32-wide rows" in line and "hidden size is 64" in line


def test_a_missing_tensor_fails_naming_it_and_both_files(files, tmp_path):
    model = files["qwen2_5_vl"] / "model.gguf"
    mmproj = rewritten_gguf(
        files["qwen2_5_vl"] / "mmproj.gguf", tmp_path / "holed.gguf", drop="mm.2.weight"
    )
    # the worker finds it, and its log line says so (the engine's own line may only say that
    # the worker exited: its message can be lost when no detokenizer is up yet to forward it)
    output = start_failure(model, mmproj)
    failure_line(output)
    lines = [line for line in output.splitlines() if "missing vision tensor" in line]
    assert lines, output
    assert str(mmproj) in lines[0] and str(model) in lines[0]
    assert "missing vision tensor(s) visual.merger.mlp.2.weight" in lines[0]


def test_an_unsupported_projector_type_or_a_text_gguf_fails(files, tmp_path):
    model = files["idefics3"] / "model.gguf"
    llava = rewritten_gguf(
        files["idefics3"] / "mmproj.gguf",
        tmp_path / "llava.gguf",
        fields={"clip.projector_type": "mlp"},
    )
    line = failure_line(start_failure(model, llava))
    assert f"{llava}: projector type 'mlp' is not supported" in line
    line = failure_line(start_failure(model, model))
    assert "not an mmproj file (general.architecture 'llama'" in line


def test_mmproj_with_a_hugging_face_directory_fails(files):
    hf, mmproj = files["idefics3"] / "hf", files["idefics3"] / "mmproj.gguf"
    line = failure_line(start_failure(hf, mmproj))
    assert f"--mmproj {mmproj} goes with a GGUF text model; --model {hf}" in line

"""Tensor parallelism (``--tp N``, pyserve/worker/tensor_parallel.py) on this CPU with gloo:
each rank's slices of the checkpoint put back together are the checkpoint (quantized blocks
included); ``--tp 2`` serves HF's greedy tokens through HTTP, as ``--tp 1`` does, with the same
logprobs to float32 rounding; a constrained request agrees across the ranks; a model the ranks
cannot split is refused at start in one line; a SIGKILLed rank, either one, fails the streams in
flight and ends the server with no process left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from gguf_files import write_gguf
from http_testlib import (
    Server,
    alive,
    check_against_reference,
    child_pids,
    references,
    request,
    tiny_model,
)
from tiny_models import random_llama

from pyserve.worker.loading import open_checkpoint
from pyserve.worker.loading.shards import shard_tensors
from pyserve.worker.tensor_parallel import shard_config

BASE_ARGS = ["--dtype", "float32", "--quantization", "none", "--torch-threads", "1"]
# float32 K/V: float16 ones differ an ulp where the ranks sum in another order (3e-4 logprobs)
BASE_ARGS += ["--kv-cache-tokens", "8192", "--block-size", "4", "--kv-cache-dtype", "float32"]
HANG_GUARD_S = 90.0  # only against a hang


# ---------------------------------------------------------------------- the ranks' slices


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory) -> Path:
    """A tiny Llama (4 heads, 4 kv heads) whose matrices are Q8_0: 32-wide blocks, so that the
    column halves of o_proj (64 wide) start on a block and its quarters do not."""
    import gguf

    model = random_llama(vocab_size=300, max_position_embeddings=256, seed=7, num_key_value_heads=4)
    path = tmp_path_factory.mktemp("tp-gguf") / "tiny-q8.gguf"
    write_gguf(model, path, matrix_type=gguf.GGMLQuantizationType.Q8_0)
    return path


def _dequantized(tensor) -> torch.Tensor:
    """A sharded tensor's values from its own blocks (as the packer reads them)."""
    from gguf import GGMLQuantizationType, dequantize

    blocks = tensor.blocks()
    values = dequantize(blocks, GGMLQuantizationType[tensor.type_name])
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(tensor.shape)


@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_slices_put_back_together_are_the_checkpoint(quantized_gguf, size):
    checkpoint = open_checkpoint(str(quantized_gguf))
    config = checkpoint.config
    whole = dict(checkpoint.tensors)
    ranks = [
        dict(shard_tensors(checkpoint.tensors, config, checkpoint.family, r, size))
        for r in range(size)
    ]
    share = shard_config(config, size)
    q, kv, inter = share.q_size, share.kv_size, share.intermediate_size
    for name, tensor in whole.items():
        want = tensor.values().float()
        parts = [rank[name] for rank in ranks]
        got = [part.values().float() for part in parts]
        for part, values in zip(parts, got, strict=True):
            if part.quantized and part.blocks() is not None:
                # a quantized slice keeps the file's blocks, which decode to the same values
                assert torch.equal(_dequantized(part), values), name
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            assert torch.equal(torch.cat(got, dim=1), want), name
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = torch.cat(got)
            assert rows.shape[0] == size * share.vocab_size
            assert torch.equal(rows[: config.vocab_size], want), name
            assert not rows[config.vocab_size :].any()  # the last rank's padding
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            width = q if "q_proj" in name else kv
            assert all(g.shape[0] == width for g in got)
            assert torch.equal(torch.cat(got), want), name
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            assert all(g.shape[0] == inter for g in got)
            assert torch.equal(torch.cat(got), want), name
        else:  # norms: every rank holds all of it
            assert all(torch.equal(g, want) for g in got), name
    # 32-wide blocks: halves of o_proj's 64 columns keep the file's blocks, quarters cannot
    o_proj = ranks[1]["model.layers.0.self_attn.o_proj.weight"]
    assert o_proj.type_name == "Q8_0"
    assert o_proj.quantized == (size == 2) and (o_proj.blocks() is not None) == (size == 2)


def test_heads_the_ranks_cannot_split_are_refused(quantized_gguf):
    config = open_checkpoint(str(quantized_gguf)).config
    problem = "attention heads 4, kv heads 4, MLP width 128 are not divisible by 3"
    with pytest.raises(ValueError, match=problem):
        shard_config(config, 3)


def test_a_row_parallel_bias_is_added_once():
    from pyserve.worker.loading.base import StoredTensor

    class Bias(StoredTensor):
        file, name, shape, type_name, nbytes = "f", "b", (4,), "F32", 16

        def values(self) -> torch.Tensor:
            return torch.arange(4.0)

    from pyserve.worker.models.config import ModelConfig, RopeConfig, uniform_layers

    model = ModelConfig(
        architecture="llama",
        vocab_size=10,
        hidden_size=4,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=2,
        rms_norm_eps=1e-5,
        context_length=16,
        tie_word_embeddings=True,
        layers=uniform_layers(1, RopeConfig(10000.0, 2)),
        o_bias=True,
    )
    from pyserve.worker.models.registry import family_for_hf

    name, llama = "model.layers.0.self_attn.o_proj.bias", family_for_hf("llama")
    biases = [
        dict(shard_tensors([(name, Bias())], model, llama, r, 2))[name].values() for r in (0, 1)
    ]
    assert torch.equal(biases[0], torch.arange(4.0)) and not biases[1].any()


# ---------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def tp2(model_dir):
    server = Server(["--model", str(model_dir), *BASE_ARGS, "--tp", "2"])
    try:
        yield server
    finally:
        server.stop()


def generate(url: str, ids: list[int], n: int, logprobs: bool = False) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "return_logprob": logprobs,
    }
    status, _, raw = request(url + "/generate", body)
    assert status == 200, raw
    return json.loads(raw)


def output_logprobs(result: dict) -> list[float]:
    return [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


def test_tp2_serves_hf_tokens_and_tp1_logprobs(tp2, model_dir):
    info = json.loads(request(tp2.url + "/server_info")[2])
    assert info["tp_size"] == 2
    assert "tensor parallel" in info["backend"]["kernels"].get("decoder_stack", "tensor parallel")
    refs = references(model_dir)
    tp2_results = [generate(tp2.url, ref["prompt"], len(ref["output"]), True) for ref in refs]
    for ref, result in zip(refs, tp2_results, strict=True):
        check_against_reference(result["output_ids"], ref, f"--tp 2: {ref['text']!r}")
    one = Server(["--model", str(model_dir), *BASE_ARGS])
    try:
        for ref, split in zip(refs, tp2_results, strict=True):
            whole = generate(one.url, ref["prompt"], len(ref["output"]), True)
            assert split["output_ids"] == whole["output_ids"], ref["text"]
            # the same float32 sums in another order
            drift = np.abs(np.subtract(output_logprobs(split), output_logprobs(whole))).max()
            assert drift < 1e-4, drift
    finally:
        one.stop()


def test_tp2_cached_prefixes_and_concurrent_requests(tp2, model_dir):
    refs = references(model_dir)
    url = tp2.url
    assert request(url + "/flush_cache", {})[0] == 200
    longest = max(refs, key=lambda ref: len(ref["prompt"]))
    n = len(longest["output"])
    first = generate(url, longest["prompt"], n)
    again = generate(url, longest["prompt"], n)  # from the ranks' cached K/V
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == first["output_ids"]

    async def together() -> list[dict]:
        async with aiohttp.ClientSession() as session:

            async def one(ref: dict) -> dict:
                body = {
                    "input_ids": ref["prompt"],
                    "sampling_params": {
                        "max_new_tokens": len(ref["output"]),
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                }
                async with session.post(url + "/generate", json=body) as resp:
                    assert resp.status == 200
                    return await resp.json()

            return await asyncio.gather(*(one(ref) for ref in refs))

    results = asyncio.run(asyncio.wait_for(together(), HANG_GUARD_S))
    for ref, result in zip(refs, results, strict=True):
        check_against_reference(result["output_ids"], ref, f"--tp 2 batched: {ref['text']!r}")


def test_tp2_sampling_and_grammars_agree_across_ranks(tp2):
    """Rank 0's tokens drive every rank: sampled and schema-constrained output stays valid and
    the ranks stay in step for the requests after them."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    body = {
        "model": "http-tiny-model",
        "messages": [{"role": "user", "content": "give me JSON"}],
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    status, _, raw = request(tp2.url + "/v1/chat/completions", body)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    if choice["finish_reason"] == "stop":
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"n", "ok"}
    sampled = {"prompt": "Once upon", "max_tokens": 12, "temperature": 1.0, "seed": 11}
    texts = {
        json.loads(request(tp2.url + "/v1/completions", sampled)[2])["choices"][0]["text"]
        for _ in range(2)
    }
    assert len(texts) == 1  # seeded: the same draws each time, whichever rank sampled


def test_a_model_the_ranks_cannot_split_fails_at_start_in_one_line(model_dir):
    # the tiny model has 4 attention heads and 2 kv heads
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyserve",
            "run",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--tp",
            "3",
            *BASE_ARGS,
        ],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "--tp 3" in line]
    assert lines and "not divisible by 3" in lines[-1], proc.stderr


def _ranks(server: Server) -> dict[int, int]:
    """rank → pid of the server's worker processes (waits until both run)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        found = {}
        for pid in child_pids(server.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"pyserve.worker" in argv:
                config = argv[argv.index(b"--config") + 1]
                # "-": started with the command, before its config (rank 0's) was known
                found[0 if config == b"-" else json.loads(config)["tp_rank"]] = pid
        if len(found) == 2:
            return found
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)


@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_fails_the_streams_and_ends_the_server(model_dir, rank):
    server = Server(["--model", str(model_dir), *BASE_ARGS, "--tp", "2"])
    ranks = _ranks(server)
    children = child_pids(server.proc.pid)
    body = {"prompt": "Tell me everything:", "max_tokens": 5000, "ignore_eos": True}

    async def scenario() -> bytes:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(server.url + "/v1/completions", json={**body, "stream": True})
            await resp.content.readuntil(b"\n\n")  # a token came: the ranks are decoding
            os.kill(ranks[rank], signal.SIGKILL)
            return await resp.read()  # ends on the kill, long before its 5000 tokens

    try:
        raw = asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
        events = [
            json.loads(line[len(b"data: ") :])
            for line in raw.split(b"\n")
            if line.startswith(b"data: {")
        ]
        assert events, (raw[-2000:], server.log()[-3000:])
        error = events[-1]["error"]
        # the engine's "worker died", or rank 0's word that a collective broke
        assert error["type"] in ("server_error", "service_unavailable"), error
        assert "worker" in error["message"] or "rank" in error["message"], error
        server.proc.wait(HANG_GUARD_S)
    finally:
        code = server.stop()
    assert code == 1, server.log()
    assert f"worker rank {rank}" in server.log() or "worker" in server.log()
    deadline = time.monotonic() + HANG_GUARD_S
    while any(alive(pid) for pid in children):
        assert time.monotonic() < deadline, [p for p in children if alive(p)]
        time.sleep(0.05)


# ---------------------------------------------------------------------- quantized ranks

# One rank of a group over a GGUF: every rank runs the same OfflineEngine generation (greedy, so
# the gathered logits alone keep them in step); rank 0 writes its tokens and logprobs.
RANK_SCRIPT = """
import json, sys
import torch
from pyserve.wire.main_to_worker import SamplingParams
from pyserve.worker.model_runner import ModelRunner
from pyserve.worker.offline import OfflineEngine
from pyserve.worker.settings import WorkerSettings
from pyserve.worker.tensor_parallel import TensorParallel

rank, size, init, model, out = sys.argv[1:6]
torch.set_num_threads(1)
tp = TensorParallel.join(int(rank), int(size), init, "cpu")
runner = ModelRunner(WorkerSettings(model=model, num_blocks=64, quantization="auto"), tp=tp)
params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
outputs = OfflineEngine(runner=runner, num_blocks=64).generate(json.loads(sys.argv[6]), params)
if tp.rank == 0:
    with open(out, "w") as f:
        json.dump([[o.token_ids, o.logprobs] for o in outputs], f)
tp.close()
"""
RANK_PROMPTS = [[5, 9, 200, 17, 3], list(range(30, 70))]


def test_quantized_ranks_pack_their_slices_and_generate_as_one_model(quantized_gguf, tmp_path):
    """Q8_0 projections split over 2 ranks (their blocks repacked as they are) give the whole
    model's greedy tokens; logprobs move only by the activations' rounding, which each rank
    does over its own columns."""
    from http_testlib import free_port, run_ranks

    from pyserve.wire.main_to_worker import SamplingParams
    from pyserve.worker.model_runner import ModelRunner
    from pyserve.worker.offline import OfflineEngine
    from pyserve.worker.settings import WorkerSettings

    out = tmp_path / "rank0.json"
    init = f"tcp://127.0.0.1:{free_port()}"
    rest = [str(quantized_gguf), str(out), json.dumps(RANK_PROMPTS)]
    run_ranks(RANK_SCRIPT, [[str(rank), "2", init, *rest] for rank in range(2)], HANG_GUARD_S)
    split = json.loads(out.read_text())
    runner = ModelRunner(
        WorkerSettings(model=str(quantized_gguf), num_blocks=64, quantization="auto")
    )
    assert set(runner.packed_precisions) == {"int8"}  # the layers' Q8_0 and the 8-bit head
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    whole = OfflineEngine(runner=runner, num_blocks=64).generate(RANK_PROMPTS, params)
    for (tokens, logprobs), one in zip(split, whole, strict=True):
        assert tokens == one.token_ids
        # 5e-4 measured: o_proj's and down_proj's int16 activation scales are per rank's columns
        assert np.allclose(logprobs, one.logprobs, atol=5e-3)

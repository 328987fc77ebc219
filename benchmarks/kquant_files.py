"""Real K-quant GGUF files, and the same weights as safetensors, of random-weight Llama models
(and one Qwen3-MoE) for loading benchmarks.

A test's GGUF files come from tests/gguf_files.py's quantizer in Python; a benchmark of how fast
a Q4_K_M file loads needs the file llama.cpp itself makes, with its mix of types (Q4_K, Q6_K
for the output projection and some attn_v/ffn_down, F32 norms). So per size:

- a random-weight ``LlamaForCausalLM`` (``Qwen3MoeForCausalLM`` for ``moe``) from transformers'
  own config (seed 0, init std 0.02), built in bfloat16 and saved as a bf16 safetensors
  directory (``hf/``) with a tokenizer: SmolLM2's byte-level BPE (from the bundled GGUF) cut to
  the model's 32000 ids, with only the merges whose parts and result stay below 32000, so that
  the tokenizer is complete and every id it gives is in the vocabulary; its chat template comes
  along;
- an F16 GGUF of those weights, written tensor by tensor from the safetensors files (the metadata
  and tensor names of tests/gguf_files.py's ``write_gguf``, which is llama.cpp's converter, plus
  the same tokenizer; each layer's experts stacked into one 3-D tensor per projection, the
  router in F32 as the converter keeps it), so that the 3b model never has to be in memory in
  float32;
- ``llama-quantize`` (built from the llama-cpp-python sdist, in compare.py's llama.cpp build
  directory) turns it into ``model-Q4_K_M.gguf``; the F16 file is deleted unless ``--keep-f16``.

Shapes (vocabulary 32000 but for gpt-oss):

- 0.5b = 24 layers × hidden 1024, MLP 2816, 16 heads, 4 KV heads, tied embeddings;
- 1.5b = Qwen2.5-1.5B's: 28 layers × hidden 1536, MLP 8960, 12 heads, 2 KV heads (head_dim
  128), tied embeddings (no q/k/v bias: a Llama block);
- 3b = 28 layers × hidden 3072, MLP 8192, 24 heads, 8 KV heads;
- 8b = Llama-3-8B's: 32 layers × hidden 4096, MLP 14336, 32 heads, 8 KV heads, untied;
- moe = Qwen3-30B-A3B's blocks scaled down (arch ``qwen3moe``: q/k norms, no q/k permutation):
  16 layers × hidden 1536, 64 experts of width 512 with the top 8 a token (``norm_topk_prob``),
  16 heads, 4 KV heads of head_dim 128, untied; 2.6B parameters, 0.5B active a token (0.4B
  besides the embedding and output matrices).
- gpt-oss = gpt-oss-20b's blocks scaled down (arch ``gpt-oss``): 12 layers × hidden 1536, 32
  experts of width 1536 with the top 4 a token, 32 heads and 4 KV heads of head_dim 64 (q wider
  than the hidden size, as gpt-oss's), windows of 128 on the even layers, sinks, biases, yarn;
  SmolLM2's whole 49152-id vocabulary; 2.9B parameters, 0.4B active a token. Its F16 file is
  written by llama.cpp's own convert_hf_to_gguf.py and quantized to ``MXFP4_MOE``: the experts
  MXFP4 (as gpt-oss ships them), attention, embedding and output Q8_0, the rest F32.

The first four are Llama blocks. Every dimension is a multiple of 256, so llama-quantize uses
K-quants everywhere (no fallback types). A model whose bf16 weights pass ``IN_MEMORY_BYTES`` (the
8b: 14.5 GB on a 23 GB machine) is not built as a transformers model: its safetensors shards are
written tensor by tensor with transformers' initialization (normal(0, 0.02) matrices, norms of
ones), one 2 GB shard in memory at a time. Files are cached under
``benchmarks/out/kquant-models/<size>/`` and each step is skipped when its output exists.

    .venv/bin/python benchmarks/kquant_files.py --sizes 0.5b,1.5b,3b,8b
    .venv/bin/python benchmarks/kquant_files.py --sizes 0.5b --keep-f16
    .venv/bin/python benchmarks/kquant_files.py --sizes moe
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))  # compare.py
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # gguf_files.py

from compare import VENV_BIN, build_llama_server, peers_dir  # noqa: E402
from gguf_files import (  # noqa: E402
    _MOE_PARTS,
    _PARTS,
    _TOP,
    ARCH,
    _merged_experts,
    llama_cpp_row_order,
)

OUT_DIR = BENCH_DIR / "out" / "kquant-models"
QUANT = "Q4_K_M"
THREADS = 2
VOCAB = 32000
SIZES = {
    "0.5b": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "3b": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "moe": {
        "model_type": "qwen3_moe",  # the others are "llama"
        "hidden_size": 1536,
        "num_hidden_layers": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "gpt-oss": {
        "model_type": "gpt_oss",
        "quant": "MXFP4_MOE",  # the others are Q4_K_M
        "hidden_size": 1536,
        "intermediate_size": 1536,
        "num_hidden_layers": 12,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "sliding_window": 128,
        "tie_word_embeddings": False,
        # SmolLM2's whole vocabulary: llama.cpp's converter knows its pre-tokenizer by the
        # tokenization of a probe text, which a cut vocabulary changes
        "vocab_size": 49152,
    },
}
# bf16 bytes above which a model's safetensors are written tensor by tensor (see above)
IN_MEMORY_BYTES = 8e9
SHARD_BYTES = 2 * 10**9
COMMON = {
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "bos_token_id": 1,  # SmolLM2's <|im_start|> and <|im_end|>, as write_gguf writes them
    "eos_token_id": 2,
}


# ----------------------------------------------------------------------------- llama-quantize


def find_llama_quantize() -> Path:
    """``llama-quantize`` in compare.py's llama.cpp build directory, built there (the cmake
    target alone) if missing; the directory itself is made with compare.build_llama_server."""
    build = peers_dir() / "llama.cpp-build"
    binary = build / "bin" / "llama-quantize"
    if binary.is_file():
        return binary
    if not (build / "CMakeCache.txt").is_file():
        print(f"[llama.cpp] no build directory {build}: building llama-server there first")
        build_llama_server(peers_dir())
    cmake = shutil.which("cmake", path=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
    if cmake is None:
        raise RuntimeError("cmake not found")
    jobs = str(min(os.cpu_count() or 2, 2))
    print(f"[llama.cpp] building llama-quantize in {build} (-j {jobs})")
    subprocess.run(
        [cmake, "--build", str(build), "--target", "llama-quantize", "-j", jobs], check=True
    )
    if not binary.is_file():
        raise RuntimeError(f"the build made no {binary}")
    return binary


# ----------------------------------------------------------------------------- tokenizer


def _kept_merges(merges, token_id: dict[str, int], vocab: int) -> list:
    """The BPE merges whose two parts and result all have ids below ``vocab``."""
    kept = []
    for merge in merges:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        if max(token_id.get(a, vocab), token_id.get(b, vocab), token_id.get(a + b, vocab)) < vocab:
            kept.append(merge)
    return kept


def _smollm2_tokenizer_dir() -> Path:
    from pyserve.model_files import resolve_model, tokenizer_dir

    return tokenizer_dir(resolve_model(None))


def write_tokenizer(out: Path, vocab: int = VOCAB) -> None:
    """SmolLM2's tokenizer files in ``out``, the vocabulary cut to its first ``vocab`` ids
    (its specials are ids 0-16, its byte alphabet comes next: the cut keeps both)."""
    from transformers import PreTrainedTokenizerFast

    source = _smollm2_tokenizer_dir()
    tok = json.loads((source / "tokenizer.json").read_text())
    model = tok["model"]
    assert model["type"] == "BPE", model["type"]
    model["vocab"] = {t: i for t, i in model["vocab"].items() if i < vocab}
    model["merges"] = _kept_merges(model["merges"], model["vocab"], vocab)
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < vocab]
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    for f in source.iterdir():
        if f.name != "tokenizer.json":
            shutil.copy(f, out / f.name)
    loaded = PreTrainedTokenizerFast.from_pretrained(str(out))
    ids = loaded.encode("Hello world, this is a tokenizer check: 12345 ünïcødé 日本語!")
    if len(loaded) != vocab or max(ids) >= vocab:
        raise RuntimeError(f"cut tokenizer: {len(loaded)} entries, ids {ids}")


def add_gguf_tokenizer(writer, vocab: int = VOCAB) -> None:
    """The bundled SmolLM2 GGUF's tokenizer keys, cut to ``vocab`` ids as ``write_tokenizer``
    cuts tokenizer.json."""
    import gguf

    from pyserve.model_files import default_model_path

    fields = gguf.GGUFReader(default_model_path()).fields

    def value(key: str):
        return fields[key].contents()

    tokens = value("tokenizer.ggml.tokens")[:vocab]
    token_id = {t: i for i, t in enumerate(tokens)}
    writer.add_tokenizer_model(value("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(value("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(value("tokenizer.ggml.token_type")[:vocab])
    writer.add_token_merges(_kept_merges(value("tokenizer.ggml.merges"), token_id, vocab))
    writer.add_unk_token_id(value("tokenizer.ggml.unknown_token_id"))
    writer.add_pad_token_id(value("tokenizer.ggml.padding_token_id"))
    writer.add_add_bos_token(value("tokenizer.ggml.add_bos_token"))
    writer.add_add_space_prefix(value("tokenizer.ggml.add_space_prefix"))
    writer.add_chat_template(value("tokenizer.chat_template"))


# ----------------------------------------------------------------------------- model files


def _model_config(size: str):
    """transformers' own config of ``size`` (LlamaConfig unless the size names another
    model_type), in bf16."""
    from transformers import AutoConfig

    params = dict(SIZES[size])
    model_type = params.pop("model_type", "llama")
    params.pop("quant", None)
    return AutoConfig.for_model(model_type, **{**COMMON, **params}, dtype="bfloat16")


def _meta_model(config):
    """A model of ``config`` on the meta device: its tensors' names and shapes, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def build_hf_dir(size: str, out: Path) -> None:
    """The random-weight bf16 model of ``size`` saved in ``out`` with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    config = _model_config(size)
    if _bf16_bytes(config) > IN_MEMORY_BYTES:
        _write_hf_shards(config, out)
        write_tokenizer(out, config.vocab_size)
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built (and initialized) in bf16: 2 bytes a weight
    try:
        model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(previous)
    wrong = {str(p.dtype) for p in model.parameters()} - {"torch.bfloat16"}
    if wrong:
        raise RuntimeError(f"parameters in {wrong}")
    # shards of 2 GB: safetensors holds a shard's bytes while it writes it
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    del model
    write_tokenizer(out, config.vocab_size)


def _bf16_bytes(config) -> int:
    """The bf16 bytes of a model of ``config``."""
    return sum(shape.numel() for shape in _checkpoint_shapes(config).values()) * 2


def _checkpoint_shapes(config) -> dict:
    """The tensors save_pretrained writes for a model of ``config``, in its order, with their
    shapes: the state dict in transformers' checkpoint format (an MoE's fused experts as one
    tensor per expert and projection, the names llama.cpp's converter and pyserve read), a tied
    lm_head left out."""
    from transformers.core_model_loading import revert_weight_conversion

    model = _meta_model(config)
    state = revert_weight_conversion(model, model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {name: t.shape for name, t in state.items()}


def _write_hf_shards(config, out: Path) -> None:
    """``config``'s random-weight model as bf16 safetensors shards written tensor by tensor:
    transformers' initialization (matrices, experts, routers and the embedding normal(0,
    initializer_range), norms ones), one shard in memory at a time, then config.json and the
    shard index save_pretrained writes."""
    import torch
    from safetensors.torch import save_file

    state = _checkpoint_shapes(config)
    generator = torch.Generator().manual_seed(0)
    std = config.initializer_range
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in state.items():
        nbytes = shape.numel() * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = state[name]
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(
                    0.0, std, generator=generator
                )
            weight_map[name] = file
            total += tensors[name].numel() * 2
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
        print(f"  {file} ({len(names)} tensors)")
    config.save_pretrained(out)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _gguf_name(name: str) -> str:
    """write_gguf's tensor name for a Llama or Qwen-MoE tensor (not an expert's)."""
    if name.startswith("model.layers."):
        layer, rest = name[len("model.layers.") :].split(".", 1)
        part, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{({**_PARTS, **_MOE_PARTS})[part]}.{kind}"
    return _TOP[name]


def _add_metadata(writer, cfg: dict, arch: str, head_dim: int, name: str) -> None:
    """write_gguf's keys for ``cfg`` (default rope), and what the converter adds besides."""
    import gguf

    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    assert rope.get("rope_type", "default") == "default", rope
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])  # unused by an all-MoE model
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if arch == "llama":  # the Llama converter's; the Qwen ones leave llama.cpp to use head_dim
        writer.add_rope_dimension_count(head_dim)
    add_gguf_tokenizer(writer, cfg["vocab_size"])


def write_f16_gguf(hf_dir: Path, path: Path) -> dict[str, int]:
    """The model in ``hf_dir`` as llama.cpp's converter writes an F16 file: write_gguf's
    metadata and names (Llama's q/k rows in llama.cpp's order; an MoE layer's experts stacked
    into one [experts, rows, columns] tensor per projection), matrices in F16, norms and MoE
    routers in F32 (the converter keeps ffn_gate_inp in F32), and the tokenizer. One tensor
    (or one stack of experts) in memory at a time, read from the safetensors files. Returns
    the count of tensors per GGML type."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    assert model_type in ("llama", "qwen3_moe"), model_type
    arch = ARCH[model_type]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    where: dict[str, Path] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            where.update(dict.fromkeys(st.keys(), f))
    shapes = _checkpoint_shapes(AutoConfig.from_pretrained(hf_dir))
    names = [n for n in shapes if n in where]  # write_gguf's order
    missing = set(where) - set(names)
    if missing:
        raise RuntimeError(f"tensors a {model_type} model does not have: {sorted(missing)}")
    # (GGUF name, the HF tensors it holds: one, or a layer's experts to stack in expert order)
    tensors: list[tuple[str, list[str]]] = []
    for key, value in _merged_experts({n: n for n in names}):
        if isinstance(value, list):
            layer, proj = key
            tensors.append((f"blk.{layer}.ffn_{proj}_exps.weight", value))
        else:
            tensors.append((_gguf_name(key), [key]))

    def dtype(gguf_name: str, hf_names: list[str]) -> np.dtype:
        f32 = len(shapes[hf_names[0]]) == 1 or gguf_name.endswith(".ffn_gate_inp.weight")
        return np.dtype(np.float32 if f32 else np.float16)

    def stacked(gguf_name: str) -> bool:
        return gguf_name.endswith("_exps.weight")

    def load(gguf_name: str, hf_names: list[str]) -> np.ndarray:
        read: dict[str, torch.Tensor] = {}
        for f in dict.fromkeys(where[n] for n in hf_names):  # a stack may span two shards
            with safe_open(f, framework="pt") as st:
                read.update((n, st.get_tensor(n)) for n in hf_names if where[n] == f)
        parts = [read.pop(n) for n in hf_names]
        t = torch.stack(parts) if stacked(gguf_name) else parts[0]
        del parts, read
        f32 = dtype(gguf_name, hf_names) == np.float32
        array = t.to(torch.float32 if f32 else torch.float16).numpy()
        if arch == "llama" and ".q_proj." in hf_names[0]:
            array = llama_cpp_row_order(array, heads)
        elif arch == "llama" and ".k_proj." in hf_names[0]:
            array = llama_cpp_row_order(array, kv_heads)
        return np.ascontiguousarray(array)

    writer = gguf.GGUFWriter(str(path), arch=arch)
    _add_metadata(writer, cfg, arch, head_dim, f"random-{arch}-{hf_dir.parent.name}")
    for gguf_name, hf_names in tensors:
        shape = tuple(shapes[hf_names[0]])
        if stacked(gguf_name):
            shape = (len(hf_names), *shape)
        dt = dtype(gguf_name, hf_names)
        writer.add_tensor_info(gguf_name, shape, dt, int(np.prod(shape)) * dt.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    types: collections.Counter = collections.Counter()
    for gguf_name, hf_names in tensors:
        array = load(gguf_name, hf_names)
        types["F16" if array.dtype == np.float16 else "F32"] += 1
        writer.write_tensor_data(array)
    writer.close()
    return dict(types)


def tensor_types(path: Path) -> dict[str, int]:
    """Count of a GGUF file's tensors per GGML type."""
    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return dict(counts.most_common())


def _vm_hwm_mib(pid: int) -> float:
    """A live process's peak RSS so far (VmHWM), 0 once it is gone."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def quantize(binary: Path, f16: Path, out: Path, quant: str = QUANT) -> tuple[list[str], float]:
    """llama-quantize f16 → out; returns its summary lines (sizes, fallbacks, per-type
    conversions as it reported them) and its peak RSS in MiB (VmHWM, polled: getrusage's
    children figure counts the parent's pages at the fork)."""
    with tempfile.TemporaryFile("w+") as log_file:
        proc = subprocess.Popen(
            [str(binary), str(f16), str(out), quant, str(THREADS)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
        )
        peak = 0.0
        while proc.poll() is None:
            peak = max(peak, _vm_hwm_mib(proc.pid))
            time.sleep(0.1)
        log_file.seek(0)
        log = log_file.read()
    if proc.returncode != 0:
        tail = "\n".join(log.splitlines()[-15:])
        raise RuntimeError(f"llama-quantize exited with {proc.returncode}:\n{tail}")
    conversions = collections.Counter(m.group(1) for m in re.finditer(r"converting to (\w+)", log))
    kept = collections.Counter(
        m.group(1) for m in re.finditer(r"type =\s+(\w+), size =", log)
    )  # tensors llama-quantize copies as they are (the norms)
    lines = [
        line.strip()
        for line in log.splitlines()
        if re.search(r"model size|quant size|fallback|incompatible|WARNING", line)
    ]
    lines.append(f"converted: {dict(conversions.most_common())}; kept as they were: {dict(kept)}")
    return lines, peak


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def quant_of(size: str) -> str:
    """The llama-quantize type of ``size``'s file: Q4_K_M, or MXFP4_MOE for gpt-oss."""
    return SIZES[size].get("quant", QUANT)


def gguf_path(size: str, out: Path = OUT_DIR) -> Path:
    """Where ``size``'s quantized file is (kquant_files.py makes it)."""
    return out / size / f"model-{quant_of(size)}.gguf"


def convert_with_llama_cpp(hf_dir: Path, path: Path) -> None:
    """llama.cpp's own convert_hf_to_gguf.py (from the sdist compare.py builds llama-server
    from) writes ``hf_dir`` as an F16 file: for gpt-oss, whose fused, transposed experts and
    biases only the converter itself lays out."""
    sources = sorted((peers_dir() / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not sources:
        build_llama_server()  # unpacks the sdist
        sources = sorted((peers_dir() / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    source = sources[-1]
    subprocess.run(
        [sys.executable, str(source / "convert_hf_to_gguf.py"), str(hf_dir),
         "--outfile", str(path), "--outtype", "f16"],
        env={**os.environ, "PYTHONPATH": str(source / "gguf-py")},
        check=True,
    )  # fmt: skip


def model_files(size: str, out: Path, *, keep_f16: bool = False) -> dict:
    """The cached files of ``size`` under ``out`` (``hf/``, ``model-Q4_K_M.gguf`` (or its
    quant_of) and, with ``keep_f16``, ``model-F16.gguf``), each made only if missing. Returns
    their paths, sizes, the GGUF's tensor types, the seconds each step took and the peak memory
    so far."""
    if size not in SIZES:
        raise ValueError(f"size {size!r}: one of {', '.join(SIZES)}")
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    f16 = out / "model-F16.gguf"
    quant = quant_of(size)
    q = out / f"model-{quant}.gguf"
    took: dict[str, float] = {}
    notes: list[str] = []
    quantize_peak = None

    if not (hf / "config.json").is_file() or not (hf / "tokenizer.json").is_file():
        tmp = out / "hf.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        start = time.monotonic()
        print(f"[{size}] building the random-weight model, saving {hf}")
        build_hf_dir(size, tmp)
        shutil.rmtree(hf, ignore_errors=True)
        tmp.rename(hf)
        took["hf"] = time.monotonic() - start
        print(f"[{size}] hf/ in {took['hf']:.0f} s (peak RSS {_peak_rss_mb():.0f} MiB)")

    if not q.is_file() or (keep_f16 and not f16.is_file()):
        if not f16.is_file():
            tmp = f16.with_suffix(".gguf.tmp")
            start = time.monotonic()
            print(f"[{size}] writing {f16.name}")
            if SIZES[size].get("model_type") == "gpt_oss":
                convert_with_llama_cpp(hf, tmp)
            else:
                write_f16_gguf(hf, tmp)
            tmp.rename(f16)
            took["f16_gguf"] = time.monotonic() - start
            print(f"[{size}] {f16.name} in {took['f16_gguf']:.0f} s")
        if not q.is_file():
            binary = find_llama_quantize()
            tmp = q.with_suffix(".gguf.tmp")
            start = time.monotonic()
            print(f"[{size}] {binary.name} {f16.name} {q.name} {quant} {THREADS}")
            notes, quantize_peak = quantize(binary, f16, tmp, quant)
            tmp.rename(q)
            took["quantize"] = time.monotonic() - start
            for line in notes:
                print(f"[{size}]   llama-quantize: {line}")
            print(f"[{size}] {q.name} in {took['quantize']:.0f} s")
    if f16.is_file() and not keep_f16:
        f16.unlink()

    result = {
        "size": size,
        "hf_dir": str(hf),
        "hf_bytes": _dir_bytes(hf),
        "gguf": str(q),
        "gguf_bytes": q.stat().st_size,
        "tensor_types": tensor_types(q),
        "seconds": {k: round(v, 1) for k, v in took.items()},
        "peak_rss_mib": round(_peak_rss_mb()),
        "llama_quantize_peak_rss_mib": quantize_peak and round(quantize_peak),
        "llama_quantize": notes,
    }
    if f16.is_file():
        result["f16_gguf"], result["f16_bytes"] = str(f16), f16.stat().st_size
    return result


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5b,3b", help=f"comma-separated: {', '.join(SIZES)}")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--keep-f16", action="store_true", help="keep model-F16.gguf")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            parser.error(f"unknown size {s!r}: one of {', '.join(SIZES)}")
    results = [model_files(s, args.out / s, keep_f16=args.keep_f16) for s in sizes]
    print()
    for r in results:
        print(f"{r['size']}: {r['hf_dir']} ({_gb(r['hf_bytes'])} bf16 safetensors + tokenizer)")
        print(f"  {r['gguf']} ({_gb(r['gguf_bytes'])})")
        if "f16_gguf" in r:
            print(f"  {r['f16_gguf']} ({_gb(r['f16_bytes'])})")
        types = ", ".join(f"{k} {v}" for k, v in r["tensor_types"].items())
        print(f"  tensor types: {types}")
        if r["seconds"]:
            steps = ", ".join(f"{k} {v:.0f} s" for k, v in r["seconds"].items())
            print(f"  this run: {steps}")
    if results:
        quantizes = [r["llama_quantize_peak_rss_mib"] for r in results]
        print(
            f"peak RSS: this process {results[-1]['peak_rss_mib']} MiB, "
            f"llama-quantize {max((q for q in quantizes if q), default='-')} MiB"
        )
    if args.json:
        with contextlib.suppress(OSError):
            args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

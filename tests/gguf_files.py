"""Tiny Hugging Face models written as GGUF files the way llama.cpp's converter
(convert_hf_to_gguf.py) writes them, with the ``gguf`` package's writer: its metadata keys per
architecture, its tensor names, Llama's q/k row permutation, Gemma's norms stored as 1 + w, and
Phi-3's fused projections. Tensors are F32, so that a loader's result can be held to HF's logits.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

ARCH = {  # HF model_type → GGUF general.architecture
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",  # llama.cpp's converter writes Mixtral as a Llama with experts
    "olmoe": "olmoe",
    "gpt_oss": "gpt-oss",
}

_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: one tensor, gate then up
    "mlp.down_proj": "ffn_down",
}
# a mixture of experts (transformers' module names, Mixtral's as well)
_MOE_PARTS = {
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.router": "ffn_gate_inp",  # gpt-oss
}
_GPT_OSS_PARTS = {"post_attention_layernorm": "post_attention_norm"}
_MIXTRAL_NAMES = {
    "block_sparse_moe.": "mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(_bias)?")
_GEMMA_PARTS = {
    **_PARTS,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def llama_cpp_row_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes: each head's rotary halves interleaved."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_factors(base: float, dim: int, rope: dict) -> np.ndarray:
    """Llama 3.1's rope scaling as the converter stores it: a divisor per frequency."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


# K-quant blocks that gguf-py cannot write: a random weight of these is random blocks instead
# (the value of each field random), with the fp16 scales chosen so weights are ~±0.05 around 0.
RANDOM_BLOCK_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes of a row]: ``type_name`` blocks with random fields."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)

    def half(at: int, value: float) -> None:
        values = np.full((rows, k // block), value, np.float16) * rng.uniform(0.5, 1.5, (rows, 1))
        raw[..., at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)

    if type_name == "MXFP4":  # w = e2m1(code)·2^(e − 128): weights up to ±12·2^−8 .. 2^−6
        raw[..., 0] = rng.integers(120, 123, (rows, k // block), dtype=np.uint8)
    elif type_name == "Q6_K":  # w = d·sc·(q − 32), sc signed: centred already
        half(size - 2, 1e-5)
    else:  # w = d·sc·q − dmin·mn: dmin balances the mean of sc·q
        top = 15.5 if type_name == "Q5_K" else 7.5
        half(0, 2e-4)
        half(2, 2e-4 * top)
    return raw.reshape(rows, -1)


def write_gguf(
    model,
    path: Path,
    matrix_type=None,
    tensor_types: dict | None = None,
    fuse_gate_up_exps: bool = False,
    expert_type=None,
    random_types: tuple[str, ...] = RANDOM_BLOCK_TYPES,
) -> dict:
    """Writes the HF causal LM ``model`` at ``path``: F32 tensors, or its matrices in
    ``matrix_type`` (a gguf.GGMLQuantizationType), or each in ``tensor_types[hf name]`` (a GGML
    type name; one of RANDOM_BLOCK_TYPES replaces the weight with random blocks); a mixture's
    gate and up experts in one ``ffn_gate_up_exps`` tensor with ``fuse_gate_up_exps`` (the
    converter's --fuse-gate-up-exps); the stacked experts in ``expert_type`` (a
    gguf.GGMLQuantizationType; default ``matrix_type``), as llama-quantize's MXFP4_MOE writes
    them; tensors of ``random_types`` (RANDOM_BLOCK_TYPES, and MXFP4 where asked: a large file
    that gguf-py's quantizer would take long to write) as random blocks. Returns the
    state dict as the file holds it (in HF's layout, after any quantization), for an exact
    reference."""
    import gguf

    rng = np.random.default_rng(0)

    cfg = model.config
    model_type = cfg.model_type
    arch = ARCH[model_type]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    rope = cfg.rope_parameters
    if model_type == "gemma3_text":
        rope = rope["full_attention"]
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    extra: dict[str, np.ndarray] = {}
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
    if getattr(cfg, "sliding_window", None) and model_type != "qwen3":
        writer.add_sliding_window(int(cfg.sliding_window))
    if model_type in ("gemma2", "gemma3_text") and cfg.query_pre_attn_scalar != head_dim:
        # the converter leaves the scale out for the shapes llama.cpp knows; a tiny model's
        # query_pre_attn_scalar is none of those
        writer.add_attention_scale(float(cfg.query_pre_attn_scalar) ** -0.5)
    if kind == "llama3":
        extra["rope_freqs.weight"] = llama3_rope_factors(float(rope["rope_theta"]), head_dim, rope)
    if model_type == "gemma3_text":
        local = cfg.rope_parameters["sliding_attention"]["rope_theta"]
        writer.add_rope_freq_base_swa(float(local))
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    if model_type == "phi3":
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rotary)
        if kind == "longrope":
            original = int(rope["original_max_position_embeddings"])
            scale = cfg.max_position_embeddings / original
            factor = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
            writer.add_rope_scaling_attn_factors(factor)
            writer.add_rope_scaling_orig_ctx_len(original)
            extra["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
            extra["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(cfg.num_experts_per_tok))
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))
        if model_type == "gpt_oss":
            writer.add_expert_feed_forward_length(int(cfg.intermediate_size))
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(int(cfg.shared_expert_intermediate_size))
    gemma = model_type in ("gemma2", "gemma3_text")
    parts = {**(_GEMMA_PARTS if gemma else _PARTS), **_MOE_PARTS}
    if model_type == "gpt_oss":
        parts |= _GPT_OSS_PARTS
    stored = {}
    gates: dict[str, np.ndarray] = {}  # fusing: each layer's gate stack, until its up stack
    for name, tensor in _merged_experts(model.state_dict(), gpt_oss=model_type == "gpt_oss"):
        if isinstance(tensor, list):  # one stacked tensor: every expert's, in expert order
            layer, proj, kind_ = name
            gguf_name = f"blk.{layer}.ffn_{proj}_exps.{kind_}"
            array = np.stack([t.detach().float().numpy() for t in tensor])
            if kind_ == "bias":  # [experts, n], in F32 as the converter leaves 1-D tensors
                writer.add_tensor(gguf_name, array)
                for e, values in enumerate(array):
                    stored[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.bias"] = values
                continue
            if fuse_gate_up_exps and proj in ("gate", "up"):
                assert matrix_type is None, "fused experts are written in F32"
                for e, values in enumerate(array):
                    stored[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = values
                if proj == "gate":
                    gates[layer] = array
                else:
                    fused = np.concatenate([gates.pop(layer), array], axis=1)
                    writer.add_tensor(f"blk.{layer}.ffn_gate_up_exps.weight", fused)
                continue
            stacked_type = expert_type if expert_type is not None else matrix_type
            if stacked_type is not None and stacked_type.name in random_types:
                experts_, rows, k = array.shape
                blocks = random_blocks(stacked_type.name, experts_ * rows, k, rng)
                array = gguf.quants.dequantize(blocks, stacked_type).reshape(array.shape)
                writer.add_tensor(
                    gguf_name, blocks.reshape(experts_, rows, -1), raw_dtype=stacked_type
                )
            elif stacked_type is not None:
                array = gguf.quants.dequantize(
                    gguf.quants.quantize(array, stacked_type), stacked_type
                )
                writer.add_tensor(
                    gguf_name, gguf.quants.quantize(array, stacked_type), raw_dtype=stacked_type
                )
            else:
                writer.add_tensor(gguf_name, array)
            for e, values in enumerate(array):
                stored[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = values.copy()
            continue
        if name.endswith(".self_attn.sinks"):  # gpt-oss: the converter adds ".weight"
            gguf_name = f"blk.{name.split('.')[2]}.attn_sinks.weight"
        elif name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            part, kind_ = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{parts[part]}.{kind_}"
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            gguf_name = _TOP[name]
        array = tensor.detach().float().numpy().copy()
        qtype = matrix_type if array.ndim == 2 else None
        if tensor_types and name in tensor_types:
            qtype = gguf.GGMLQuantizationType[tensor_types[name]]
        blocks = None
        if qtype is not None and qtype.name in random_types:
            blocks = random_blocks(qtype.name, array.shape[0], array.shape[1], rng)
            array = gguf.quants.dequantize(blocks, qtype)
        elif qtype is not None:  # what a reader will get back
            array = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
        stored[name] = array.copy()
        if gemma and name.endswith("norm.weight"):
            array = array + 1.0  # the converter stores Gemma's (1 + w)
        for proj, heads in (
            (".q_proj.", cfg.num_attention_heads),
            (".k_proj.", cfg.num_key_value_heads),
        ):
            if arch == "llama" and proj in name:  # the file's row order (blocks are rows too)
                array = llama_cpp_row_order(array, heads)
                blocks = None if blocks is None else llama_cpp_row_order(blocks, heads)
        if blocks is not None:
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        elif qtype is not None:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    for gguf_name, array in extra.items():
        writer.add_tensor(gguf_name, array)
    if model_type == "mixtral":  # the references in Mixtral's own names
        stored = {_mixtral_name(name): array for name, array in stored.items()}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _merged_experts(state: dict, gpt_oss: bool = False):
    """The state dict's (name, tensor) pairs in order, with each layer's experts stacked as the
    converter stacks them: ((layer, "gate" | "up" | "down", "weight" | "bias"), [each expert's
    tensor]) in place of a checkpoint's per-expert tensors (Mixtral's w1/w3/w2 too), or of
    transformers' fused [experts, 2·width, hidden] gate/up and [experts, hidden, width] down
    parameters (gpt-oss's: transposed, gate and up alternating, with biases)."""
    stacks: dict[tuple[str, str], list] = {}
    out: list = []
    for name, tensor in state.items():
        fused = _FUSED_EXPERTS.fullmatch(name)
        if fused is not None:
            layer, proj, bias = fused.groups()
            kind = "bias" if bias else "weight"
            if gpt_oss and not bias:  # [experts, in, out]: as [experts, out, in]
                tensor = tensor.transpose(1, 2)
            if proj == "down":
                out.append(((layer, "down", kind), list(tensor)))
            elif gpt_oss:  # the converter's split: even outputs the gate, odd ones the up
                out.append(((layer, "gate", kind), list(tensor[:, ::2])))
                out.append(((layer, "up", kind), list(tensor[:, 1::2])))
            else:
                width = tensor.shape[1] // 2
                out.append(((layer, "gate", kind), list(tensor[:, :width])))
                out.append(((layer, "up", kind), list(tensor[:, width:])))
            continue
        qwen_name = name
        for old, new in _MIXTRAL_NAMES.items():
            qwen_name = qwen_name.replace(old, new)
        one = _EXPERT.fullmatch(qwen_name)
        if one is None:
            out.append((name, tensor))
            continue
        layer, expert, proj = one.groups()
        if (layer, proj) not in stacks:
            stacks[layer, proj] = []
            out.append(((layer, proj, "weight"), stacks[layer, proj]))
        assert int(expert) == len(stacks[layer, proj]), "experts out of order"
        stacks[layer, proj].append(tensor)
    return out


def _mixtral_name(name: str) -> str:
    """A Qwen-MoE expert or router name in Mixtral's checkpoint names."""
    for old, new in _MIXTRAL_NAMES.items():
        name = name.replace(new, old)
    return name

"""What most families read alike: the shape, the rope tables and the windows, from a transformers
config or from GGUF metadata."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pyserve.worker.models.config import LayerConfig, MoEConfig, RopeConfig

# What a GGUF reader gives a family: metadata by key ("general.architecture", "llama.block_count"),
# plus "_vocab_size" and the rope tensors' values ("_tensor:<name>")
GGUFFields = dict[str, Any]

# transformers' own defaulting (layer types, rope parameters, head sizes) has run on ``hf``:
# families read attributes, never config.json's raw keys.


def hf_head_dim(hf: Any) -> int:
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def hf_rope(hf: Any, layer_type: str | None = None) -> RopeConfig:
    """The rope table of ``layer_type`` (per-type parameters: Gemma 3), or the model's."""
    params = dict(hf.rope_parameters or {})
    if layer_type is not None and layer_type in params:
        params = dict(params[layer_type] or {})
    theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    partial = float(params.pop("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    head_dim = hf_head_dim(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params.pop("type", None)
    params["rope_type"] = rope_type
    mrope = params.pop("mrope_section", None)
    original = getattr(hf, "original_max_position_embeddings", None)
    if (
        rope_type in ("yarn", "longrope")
        and original
        and not params.get("original_max_position_embeddings")
    ):
        params["original_max_position_embeddings"] = int(original)
    return RopeConfig(
        theta=theta,
        rotary_dim=int(head_dim * partial),
        scaling=None if rope_type == "default" else params,
        max_position_embeddings=int(hf.max_position_embeddings),
        mrope_section=tuple(int(n) for n in mrope) if mrope else None,
    )


def hf_layers(hf: Any, window_layer_type: str = "sliding_attention") -> tuple[LayerConfig, ...]:
    """Per layer: its rope table and its window, from ``layer_types`` where the config has
    them (windows only on "sliding_attention" layers), else the same window on every layer."""
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    per_type = isinstance(hf.rope_parameters, dict) and any(
        isinstance(v, dict) for v in hf.rope_parameters.values()
    )
    layers = []
    for i in range(hf.num_hidden_layers):
        layer_type = layer_types[i] if layer_types else None
        rope = hf_rope(hf, layer_type if per_type else None)
        if layer_types:
            layer_window = window if layer_type == window_layer_type else None
        else:
            layer_window = window
        layers.append(LayerConfig(rope, int(layer_window) if layer_window else None))
    return tuple(layers)


def hf_shape(hf: Any) -> dict[str, Any]:
    """ModelConfig's shape fields from a transformers config."""
    heads = int(hf.num_attention_heads)
    return {
        "vocab_size": int(hf.vocab_size),
        "hidden_size": int(hf.hidden_size),
        "intermediate_size": int(hf.intermediate_size),
        "num_layers": int(hf.num_hidden_layers),
        "num_heads": heads,
        "num_kv_heads": int(getattr(hf, "num_key_value_heads", None) or heads),
        "head_dim": hf_head_dim(hf),
        "rms_norm_eps": float(getattr(hf, "rms_norm_eps", 1e-6)),
        "context_length": int(hf.max_position_embeddings),
        "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
    }


def hf_moe(hf: Any, normalize_default: bool) -> tuple[MoEConfig | None, list[bool]]:
    """The mixture of experts of a transformers config (None for a dense model), and which
    layers have it: all but ``mlp_only_layers``, every ``decoder_sparse_step``-th (Qwen-MoE)."""
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    if not experts:
        return None, []
    width = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    step = int(getattr(hf, "decoder_sparse_step", None) or 1)
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(hf.num_hidden_layers)]
    moe = MoEConfig(
        num_experts=int(experts),
        top_k=int(hf.num_experts_per_tok),
        expert_size=int(width),
        normalize_top_k=bool(getattr(hf, "norm_topk_prob", normalize_default)),
        shared_expert_size=int(getattr(hf, "shared_expert_intermediate_size", None) or 0),
    )
    return moe, sparse


def with_moe(
    layers: tuple[LayerConfig, ...], moe: MoEConfig | None, sparse: list[bool]
) -> dict[str, Any]:
    """ModelConfig fields: ``layers`` marked sparse where ``sparse`` says, and ``moe``."""
    if moe is None:
        return {"layers": layers}
    marked = tuple(replace(layer, moe=s) for layer, s in zip(layers, sparse, strict=True))
    return {"layers": marked, "moe": moe}


def hf_activation(hf: Any) -> str:
    """The MLP's gate, from hidden_act / hidden_activation."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act in ("silu", "swish"):
        return "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ValueError(f"hidden activation {act!r} is not supported (silu, gelu_pytorch_tanh)")


# ----------------------------------------------------------------------------- GGUF


def gguf_field(fields: GGUFFields, arch: str, key: str, default: object = None) -> Any:
    value = fields.get(f"{arch}.{key}")
    return default if value is None else value


def gguf_shape(fields: GGUFFields, arch: str, tensors: set[str]) -> dict[str, Any]:
    def get(key: str, default: object = None) -> Any:
        return gguf_field(fields, arch, key, default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or fields.get("_vocab_size")
    return {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_layers": int(get("block_count")),
        "num_heads": heads,
        "num_kv_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "context_length": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }


# llama.cpp's expert gating functions (LLAMA_EXPERT_GATING_FUNC_TYPE_*): 1 is the softmax
GGUF_SOFTMAX_GATING = 1


def gguf_moe(
    fields: GGUFFields,
    arch: str,
    shape: dict[str, Any],
    tensors: set[str],
    normalize_default: bool,
) -> tuple[MoEConfig | None, list[bool]]:
    """The file's mixture of experts (``expert_count`` and the rest), and which layers have
    one: those with a router (``blk.N.ffn_gate_inp``). Top-k renormalization is llama.cpp's
    rule for the architecture (``normalize_default``) unless the file says."""
    experts = gguf_field(fields, arch, "expert_count")
    if not experts:
        return None, []
    gating = gguf_field(fields, arch, "expert_gating_func", GGUF_SOFTMAX_GATING)
    if int(gating) != GGUF_SOFTMAX_GATING:
        raise ValueError(f"expert gating function {gating} is not supported (softmax)")
    layers = shape["num_layers"]
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers)]
    width = gguf_field(fields, arch, "expert_feed_forward_length") or shape["intermediate_size"]
    shared = any(f"blk.{i}.ffn_up_shexp.weight" in tensors for i in range(layers))
    shared_width = gguf_field(fields, arch, "expert_shared_feed_forward_length", 0) if shared else 0
    moe = MoEConfig(
        num_experts=int(experts),
        top_k=int(gguf_field(fields, arch, "expert_used_count")),
        expert_size=int(width),
        normalize_top_k=bool(gguf_field(fields, arch, "expert_weights_norm", normalize_default)),
        shared_expert_size=int(shared_width),
    )
    return moe, sparse


def gguf_rope(
    fields: GGUFFields, arch: str, head_dim: int, freq_factors: tuple[float, ...] | None = None
) -> RopeConfig:
    """The file's rope table: base, rotated dims, linear/yarn scaling."""

    def get(key: str, default: object = None) -> Any:
        return gguf_field(fields, arch, key, default)

    kind = get("rope.scaling.type", "none")
    scaling: dict | None = None
    context = int(get("context_length", 2048))
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        }
        # what llama.cpp's converter writes when the checkpoint sets them
        for key, name in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.yarn_attn_factor", "attention_factor"),
        ):
            if (value := get(key)) is not None:
                scaling[name] = float(value)
    elif kind not in ("none", None):
        raise ValueError(f"rope scaling {kind!r} is not supported (linear, yarn)")
    return RopeConfig(
        theta=float(get("rope.freq_base", 10000.0)),
        rotary_dim=int(get("rope.dimension_count") or head_dim),
        scaling=scaling,
        freq_factors=freq_factors,
        max_position_embeddings=context,
    )

"""Checkpoint tensors (Hugging Face names, [out, in]) into the shared decoder's parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pyserve.worker.loading.base import ModelLoadError
from pyserve.worker.models.decoder import CausalLM
from pyserve.worker.models.registry import Family

# Checkpoint tensors that hold no weights (old checkpoints saved rope tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Multimodal checkpoints (Gemma 3 4B+): the text model's tensors under another prefix, and the
# vision tower's, which a text server does not load.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_VISION_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)


def text_model_name(name: str) -> str | None:
    """``name`` in a text model's naming; None for a vision tensor."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    return name


def weight_slots(model: CausalLM, family: Family) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(checkpoint name → the (slice of a) parameter it fills, the names that are norms)."""
    cfg = model.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    slots: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens,
        "model.norm.weight": model.norm.weight,
    }
    norms = {"model.norm.weight"}
    if not cfg.tie_word_embeddings:
        slots["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        layer_norms = {p + "input_layernorm.weight": layer.attn_norm}
        if cfg.sandwich_norms:
            layer_norms[p + "post_attention_layernorm.weight"] = layer.attn_out_norm
            layer_norms[p + "pre_feedforward_layernorm.weight"] = layer.mlp_norm
            layer_norms[p + "post_feedforward_layernorm.weight"] = layer.mlp_out_norm
        else:
            layer_norms[p + "post_attention_layernorm.weight"] = layer.mlp_norm
        if cfg.qk_norm:
            layer_norms[p + "self_attn.q_norm.weight"] = layer.q_norm
            layer_norms[p + "self_attn.k_norm.weight"] = layer.k_norm
        for name, norm in layer_norms.items():
            slots[name] = norm.weight
            norms.add(name)
        qkv = layer.qkv_proj
        if family.fused_qkv:
            slots[p + "self_attn.qkv_proj.weight"] = qkv.weight
            if qkv.bias is not None:
                slots[p + "self_attn.qkv_proj.bias"] = qkv.bias
        else:
            rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            for proj, (lo, hi) in rows.items():
                slots[p + f"self_attn.{proj}.weight"] = qkv.weight[lo:hi]
                if qkv.bias is not None:
                    slots[p + f"self_attn.{proj}.bias"] = qkv.bias[lo:hi]
        slots[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
        if layer.o_proj.bias is not None:
            slots[p + "self_attn.o_proj.bias"] = layer.o_proj.bias
        if family.fused_gate_up:
            slots[p + "mlp.gate_up_proj.weight"] = layer.gate_up_proj.weight
        else:
            slots[p + "mlp.gate_proj.weight"] = layer.gate_up_proj.weight[:inter]
            slots[p + "mlp.up_proj.weight"] = layer.gate_up_proj.weight[inter:]
        slots[p + "mlp.down_proj.weight"] = layer.down_proj.weight
    return slots, norms


@torch.no_grad()
def load_weights(
    model: CausalLM,
    family: Family,
    tensors: Iterable[tuple[str, torch.Tensor]],
    source: str,
    *,
    norms_include_offset: bool = False,
) -> None:
    """Copies checkpoint tensors into place; every weight must appear. Norm weights get the
    family's offset added (Gemma's 1 + w) unless the file stores them with it already."""
    slots, norms = weight_slots(model, family)
    offset = 0.0 if norms_include_offset else model.config.norm_offset
    missing = set(slots)
    for raw_name, tensor in tensors:
        name = text_model_name(raw_name)
        if name is None or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        target = slots.get(name)
        if target is None:
            raise ModelLoadError(f"{source}: unexpected tensor {raw_name!r}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"{source}: tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(target.shape)}"
            )
        if offset and name in norms:
            # in float32, as transformers computes (offset + w) before scaling
            target.copy_(tensor.float() + offset)
        else:
            target.copy_(tensor)
        missing.discard(name)
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelLoadError(f"{source}: {len(missing)} weights missing, e.g. {shown}")

"""Checkpoint tensors (Hugging Face names, [out, in]) into the shared decoder's parameters."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from pyserve.worker.linear import Linear
from pyserve.worker.loading.base import ModelLoadError, StoredTensor
from pyserve.worker.loading.progress import LoadProgress
from pyserve.worker.models.decoder import CausalLM
from pyserve.worker.models.layout import checkpoint_tensors
from pyserve.worker.models.registry import Family
from pyserve.worker.quant import (
    PackedWeight,
    SegmentedWeight,
    quantize_weight,
    segments_of,
)
from pyserve.worker.weight_packing import Packing, PackingPool, pack_parts, pack_segments

EMBEDDING = "embed_tokens"  # the packing pool's key for a packed embedding table
# Checkpoint tensors that hold no weights (old checkpoints saved rope tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Multimodal checkpoints (Gemma 3, Idefics3 / SmolVLM, Qwen2.5-VL): the text model's tensors under
# another prefix, and the vision tower's, which pyserve/worker/vision loads.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.")
_VISION_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
    "model.vision_model.",  # Idefics3 / SmolVLM
    "model.connector.",
    "model.visual.",  # Qwen2.5-VL
    "visual.",
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


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor goes: a parameter (or some of its rows) of the model."""

    tensor: torch.Tensor
    linear: str | None = None  # the projection whose weight rows these are (its module name)
    rows: tuple[int, int] = (0, 0)
    norm: bool = False  # gets the family's norm offset
    embedding: bool = False


def weight_slots(model: CausalLM, family: Family) -> dict[str, Slot]:
    """Checkpoint name → its slot in the model (models/layout.py declares them)."""
    slots: dict[str, Slot] = {}
    for t in checkpoint_tensors(model.config, family):
        param = model.get_parameter(t.target)
        lo, hi = t.rows if t.rows is not None else (0, param.shape[0])
        tensor = param if t.rows is None else param[lo:hi]
        slots[t.hf] = Slot(tensor, t.linear, (lo, hi), norm=t.norm, embedding=t.embedding)
    return slots


def _placed(
    model: CausalLM, slots: dict[str, Slot], tensors: list[tuple[str, StoredTensor]], source: str
) -> list[tuple[StoredTensor, Slot]]:
    """Every tensor with its slot, checked against the model before anything is read: names,
    shapes, and that every weight appears."""
    placed = []
    missing = set(slots)
    for raw_name, tensor in tensors:
        name = text_model_name(raw_name)
        if name is None or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        slot = slots.get(name)
        if slot is None:
            raise ModelLoadError(f"{source}: unexpected tensor {raw_name!r}")
        if tuple(tensor.shape) != tuple(slot.tensor.shape) and not _same_but_ones(
            tensor.shape, slot.tensor.shape
        ):
            raise ModelLoadError(
                f"{source}: tensor {tensor.name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(slot.tensor.shape)}"
            )
        if name not in missing:
            raise ModelLoadError(f"{source}: tensor {tensor.name!r} appears twice")
        missing.discard(name)
        placed.append((tensor, slot))
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelLoadError(f"{source}: {len(missing)} weights missing, e.g. {shown}")
    return placed


@torch.no_grad()
def load_weights(
    model: CausalLM,
    family: Family,
    tensors: list[tuple[str, StoredTensor]],
    source: str,
    *,
    norms_include_offset: bool = False,
    packing: Packing | None = None,
    progress: LoadProgress | None = None,
) -> dict[str, int]:
    """Reads every tensor into place, one at a time; every weight must appear. Norm weights get
    the family's offset added (Gemma's 1 + w) unless the file stores them with it already.

    With ``packing``, every projection becomes the backend's quantized layer
    (``packing.layers``), packed as its tensors are read (no float copy of it exists;
    pyserve.worker.weight_packing says at what precision), and a quantized file's embedding
    becomes the backend's module for a packed table (a tied output projection shares it).
    Returns how many projections were packed at each precision ({"int4": n, "mxfp4": m}).
    """
    if packing is not None:
        _unallocate_linears(model)
    slots = weight_slots(model, family)
    placed = _placed(model, slots, tensors, source)
    offset = 0.0 if norms_include_offset else model.config.norm_offset
    linears = {slot.linear for slot in slots.values() if slot.linear is not None}
    rows_left = {name: model.get_submodule(name).weight.shape[0] for name in linears}
    pending: dict[str, list[tuple[int, StoredTensor]]] = {}
    pool = PackingPool(max(1, torch.get_num_threads()), progress) if packing else None
    tied = model.config.tie_word_embeddings
    try:
        for tensor, slot in placed:
            if pool is not None and slot.linear is not None:
                pending.setdefault(slot.linear, []).append((slot.rows[0], tensor))
                rows_left[slot.linear] -= slot.rows[1] - slot.rows[0]
                if rows_left[slot.linear] == 0:
                    parts = [part for _, part in sorted(pending.pop(slot.linear), key=_first)]
                    head = slot.linear == "lm_head"
                    bits = packing.part_bits(parts, head=head) or packing.bits(parts, head=head)
                    nbytes = sum(part.nbytes for part in parts)
                    pack = partial(_pack, parts, bits, source, packing.super_scales)
                    pool.submit(slot.linear, len(parts), nbytes, pack)
                continue
            if pool is not None and slot.embedding and tensor.quantized:
                # a quantized file's table stays packed (its rows are dequantized on lookup);
                # tied: the output projection's bits (8: Q4 and Q5 groups fit them exactly)
                bits = packing.bits([tensor], head=tied)
                pack = partial(_pack, [tensor], bits, source, packing.super_scales)
                pool.submit(EMBEDDING, 1, tensor.nbytes, pack)
                continue
            values = tensor.values()
            if offset and slot.norm:
                # in float32, as transformers computes (offset + w) before scaling
                values = values.float() + offset
            slot.tensor.copy_(values.reshape(slot.tensor.shape))
            if progress is not None:
                progress.advance(tensor.nbytes)
        packed = pool.finish() if pool is not None else {}
    except BaseException:
        if pool is not None:
            pool.cancel()
        raise
    if packing is None:
        return {}
    embedding = packed.pop(EMBEDDING, None)
    if tied:
        head = embedding if embedding is not None else quantize_weight(model.embed_tokens, 8)
        packed["lm_head"] = head
    if embedding is not None:
        del model.embed_tokens  # a registered parameter: a module cannot take its name directly
        model.embed_tokens = packing.layers.embedding(embedding, dtype=packing.dtype)
    counts: dict[str, int] = {}
    for module_name, weight in packed.items():
        module = model.get_submodule(module_name)
        head = module_name == "lm_head"
        layer = _packed_layer(packing, weight, module.bias, head)
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        for precision in sorted({segment.precision for segment in segments_of(weight)}):
            counts[precision] = counts.get(precision, 0) + 1  # a segmented one counts at each
    return counts


def _packed_layer(
    packing: Packing, weight: PackedWeight | SegmentedWeight, bias: torch.Tensor | None, head: bool
) -> nn.Module:
    activation_bits = packing.head_activation_bits if head else packing.activation_bits
    return packing.layers.linear(weight, bias, dtype=packing.dtype, activation_bits=activation_bits)


def _same_but_ones(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Shapes equal but for dimensions of 1 ([1, n] stored as [n]: a shared expert's gate)."""
    return [n for n in a if n != 1] == [n for n in b if n != 1]


def _first(part: tuple[int, StoredTensor]) -> int:
    return part[0]


def _pack(
    parts: list[StoredTensor], bits: int | list[int], source: str, super_scales: bool
) -> PackedWeight | SegmentedWeight:
    """At ``bits``, or each part at its own (a list: Packing.part_bits)."""
    try:
        if isinstance(bits, list):
            return pack_segments(parts, bits, super_scales=super_scales)
        return pack_parts(parts, bits, super_scales=super_scales)
    except ValueError as e:  # a scale that is inf or nan, values that overflow fp16
        names = ", ".join(repr(part.name) for part in parts)
        raise ModelLoadError(f"{source}: cannot pack {names} at {bits} bits: {e}") from None


def _unallocate_linears(model: CausalLM) -> None:
    """Puts every projection's float weight on the meta device: packed projections never have
    one (a weight tied to the embedding keeps the embedding's own tensor)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not model.embed_tokens:
            shape = tuple(module.weight.shape)
            module.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

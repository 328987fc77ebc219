"""A vision tower from llama.cpp's ``--mmproj`` file: its metadata as the transformers config
the towers take, its tensors (``v.*`` the tower, ``mm.*`` the projector) under the names of the
family's Hugging Face checkpoints, with what llama.cpp's converter changed undone.

Per projector type (llama.cpp's ``convert_hf_to_gguf.py`` and ``gguf-py/.../tensor_mapping.py``):

- SigLIP (gemma3, idefics3): ``v.patch_embd``, ``v.position_embd``, ``v.blk.N.{attn_q, attn_k,
  attn_v, attn_out, ln1, ln2, ffn_up, ffn_down}``, ``v.post_ln``, as they were;
- gemma3: ``mm.input_projection`` (the converter forces it to F16) and ``mm.soft_emb_norm``,
  stored as 1 + w (Gemma's RMSNorm offset folded in): the 1 is taken back off;
- idefics3: ``mm.model.fc``, the connector's projection;
- qwen2.5vl_merger: ``v.blk.N.attn_{q,k,v}`` split from the fused qkv (concatenated back), the
  Conv3d patch embedding split into two Conv2d frames ``v.patch_embd.weight`` and ``.weight.1``
  (stacked back on the time axis), ``v.post_ln`` the merger's ``ln_q``, ``mm.0``/``mm.2`` its MLP.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import torch

from pyserve.mmproj import Mmproj
from pyserve.worker.loading.base import ModelLoadError, StoredTensor, read_exactly

_SIGLIP_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_SIGLIP = {
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
}
_QWEN_BLOCK = {
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN = {
    "v.post_ln": "visual.merger.ln_q",
    "mm.0": "visual.merger.mlp.0",
    "mm.2": "visual.merger.mlp.2",
}
# the Hugging Face prefix each SigLIP family's tower takes (VisionTower.weight_prefixes)
_SIGLIP_PREFIX = {"gemma3": "vision_tower.vision_model.", "idefics3": "model.vision_model."}
_PROJECTOR = {
    "gemma3": {
        "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
        "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
    },
    "idefics3": {"mm.model.fc.weight": "model.connector.modality_projection.proj.weight"},
}
_BLOCK = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
_FLOATS = {"F32": np.float32, "F16": np.float16}


def tower_config(mmproj: Mmproj, text_hidden: int) -> SimpleNamespace:
    """What ``vision_tower_for`` reads of a transformers config, from the mmproj's metadata."""
    config = SimpleNamespace(
        model_type=mmproj.family,
        vision_config=SimpleNamespace(**mmproj.vision_config()),
        text_config=SimpleNamespace(hidden_size=text_hidden),
    )
    if mmproj.family == "gemma3":
        config.mm_tokens_per_image = mmproj.tokens_per_image
    elif mmproj.family == "idefics3":
        config.scale_factor = mmproj.scale_factor
    return config


class MmprojTensor(StoredTensor):
    """A float tensor of the mmproj file (F32 or F16), in Hugging Face's layout."""

    def __init__(self, path: str, tensor, source: str) -> None:
        self.file, self.name = path, tensor.name
        self.type_name = tensor.tensor_type.name
        if self.type_name not in _FLOATS:
            raise ModelLoadError(
                f"{source}: mmproj tensor {tensor.name} is {self.type_name}; F32 and F16 are served"
            )
        self.shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF: innermost first
        self.offset, self.nbytes = int(tensor.data_offset), int(tensor.n_bytes)

    def values(self) -> torch.Tensor:
        raw = read_exactly(self.file, self.offset, self.nbytes)
        return torch.from_numpy(raw.view(_FLOATS[self.type_name]).reshape(self.shape))


class Joined(StoredTensor):
    """Tensors the converter split, put back: concatenated (``dim``) or stacked (``stack``)."""

    def __init__(self, parts: list[StoredTensor], *, dim: int = 0, stack: bool = False) -> None:
        self.parts, self.dim, self.stack = parts, dim, stack
        first = parts[0]
        self.file, self.name, self.type_name = first.file, first.name, first.type_name
        shape = list(first.shape)
        if stack:
            shape.insert(dim, len(parts))
        else:
            shape[dim] = sum(p.shape[dim] for p in parts)
        self.shape = tuple(shape)
        self.nbytes = sum(p.nbytes for p in parts)

    def values(self) -> torch.Tensor:
        values = [p.values().float() for p in self.parts]
        return torch.stack(values, self.dim) if self.stack else torch.cat(values, self.dim)


class Shifted(StoredTensor):
    """A norm weight stored as 1 + w: w."""

    def __init__(self, tensor: StoredTensor, by: float) -> None:
        self.tensor, self.by = tensor, by
        self.file, self.name, self.type_name = tensor.file, tensor.name, tensor.type_name
        self.shape, self.nbytes = tensor.shape, tensor.nbytes

    def values(self) -> torch.Tensor:
        return self.tensor.values().float() + self.by


def mmproj_tensors(mmproj: Mmproj, source: str) -> list[tuple[str, StoredTensor]]:
    """Every tensor of the file under its Hugging Face name; ModelLoadError, naming ``source``,
    on a name the projector type does not have (a missing one is load_vision_weights' to name)."""
    from pyserve.model_files import open_gguf_reader

    reader = open_gguf_reader(mmproj.path)
    stored = {t.name: MmprojTensor(mmproj.path, t, source) for t in reader.tensors}
    if mmproj.family == "qwen2_5_vl":
        return _qwen_tensors(source, stored)
    prefix = _SIGLIP_PREFIX[mmproj.family]
    projector = _PROJECTOR[mmproj.family]
    out = []
    for name, tensor in stored.items():
        hf = projector.get(name)
        if hf is None:
            hf = _siglip_name(name)
            if hf is None:
                raise ModelLoadError(f"{source}: unexpected mmproj tensor {name}")
            hf = prefix + hf
        if name == "mm.soft_emb_norm.weight":
            tensor = Shifted(tensor, -1.0)
        out.append((hf, tensor))
    return out


def _siglip_name(name: str) -> str | None:
    match = _BLOCK.fullmatch(name)
    if match is not None:
        part = _SIGLIP_BLOCK.get(match.group(2))
        if part is None:
            return None
        return f"encoder.layers.{match.group(1)}.{part}.{match.group(3)}"
    stem, _, kind = name.rpartition(".")
    local = _SIGLIP.get(stem)
    return None if local is None else f"{local}.{kind}"


def _qwen_tensors(path: str, stored: dict[str, StoredTensor]) -> list[tuple[str, StoredTensor]]:
    out: list[tuple[str, StoredTensor]] = []
    frames = [stored.pop(n, None) for n in ("v.patch_embd.weight", "v.patch_embd.weight.1")]
    if all(f is not None for f in frames):
        out.append(("visual.patch_embed.proj.weight", Joined(frames, dim=2, stack=True)))
    fused: dict[tuple[str, str], dict[str, StoredTensor]] = {}
    for name, tensor in stored.items():
        match = _BLOCK.fullmatch(name)
        if match is not None:
            block, part, kind = match.groups()
            if part in ("attn_q", "attn_k", "attn_v"):
                fused.setdefault((block, kind), {})[part] = tensor
                continue
            local = _QWEN_BLOCK.get(part)
            hf = None if local is None else f"visual.blocks.{block}.{local}.{kind}"
        else:
            stem, _, kind = name.rpartition(".")
            hf = f"{_QWEN[stem]}.{kind}" if stem in _QWEN else None
        if hf is None:
            raise ModelLoadError(f"{path}: unexpected mmproj tensor {name}")
        out.append((hf, tensor))
    for (block, kind), parts in fused.items():
        if len(parts) == 3:  # otherwise the qkv is missing, and load_vision_weights says so
            joined = Joined([parts["attn_q"], parts["attn_k"], parts["attn_v"]])
            out.append((f"visual.blocks.{block}.attn.qkv.{kind}", joined))
    return out

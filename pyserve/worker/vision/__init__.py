"""Vision towers of multimodal models: preprocessed pixels -> the embedding rows that replace a
prompt's image placeholder tokens.

    tower = vision_tower_for(hf_config, dtype=torch.bfloat16, device="cuda")  # None: text-only
    load_vision_weights(tower, checkpoint.tensors, checkpoint.path)
    rows = tower.encode(pixel_values, **extra)  # [placeholder tokens, text hidden]

Plain torch, no pyserve._core: the package imports on any machine torch runs on.
"""

from __future__ import annotations

from typing import Any

import torch

from pyserve.worker.vision.base import VisionTower
from pyserve.worker.vision.weights import load_vision_weights

__all__ = ["VisionTower", "load_vision_weights", "vision_tower_for"]


def _tower_class(model_type: str | None) -> type[VisionTower] | None:
    if model_type in ("idefics3", "smolvlm"):
        from pyserve.worker.vision.idefics3 import Idefics3VisionTower

        return Idefics3VisionTower
    if model_type == "gemma3":
        from pyserve.worker.vision.gemma3 import Gemma3VisionTower

        return Gemma3VisionTower
    if model_type == "qwen2_5_vl":
        from pyserve.worker.vision.qwen2_5_vl import Qwen2_5_VLVisionTower

        return Qwen2_5_VLVisionTower
    return None


def vision_tower_for(
    hf_config: Any, *, dtype: torch.dtype, device: torch.device | str
) -> VisionTower | None:
    """The tower for a full transformers config (``AutoConfig.from_pretrained(dir)``), in
    ``dtype`` on ``device``, its parameters allocated but unset until load_vision_weights; None
    when the model has no vision tower we run (text-only models, and vision models of other
    families)."""
    cls = _tower_class(getattr(hf_config, "model_type", None))
    if cls is None or getattr(hf_config, "vision_config", None) is None:
        return None
    # built on the meta device: the weights come from the checkpoint, so initializing them
    # (hundreds of MB for a real SigLIP) would be wasted work
    with torch.device("meta"):
        tower = cls(hf_config)
    tower = tower.to(dtype=dtype).to_empty(device=device)
    return tower.eval()

"""Gemma 3: SigLIP over the fixed square image, then Gemma3MultiModalProjector (average pooling
down to ``mm_tokens_per_image`` rows, Gemma's RMSNorm, a projection into the text width)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.worker.vision.base import VisionTower
from pyserve.worker.vision.siglip import SiglipSettings, SiglipVisionTransformer


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and the product is taken in
    float32 before the cast back (Gemma's order, not Llama's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Projector(nn.Module):
    def __init__(
        self,
        vision_hidden: int,
        text_hidden: int,
        *,
        patches_per_side: int,
        tokens_per_image: int,
        eps: float,
    ) -> None:
        super().__init__()
        self.patches_per_side = patches_per_side
        tokens_per_side = int(tokens_per_image**0.5)
        self.kernel = patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision_hidden] -> [images, tokens_per_image, text_hidden]."""
        images, _, dim = x.shape
        grid = x.transpose(1, 2).reshape(images, dim, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid.contiguous(), kernel_size=self.kernel, stride=self.kernel)
        pooled = pooled.flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class Gemma3VisionTower(VisionTower):
    # transformers 4.5x writes model.vision_tower.vision_model.*, Google's checkpoints
    # vision_tower.vision_model.*, transformers 5 vision_tower.* (SiglipVisionModel lost its
    # inner vision_model)
    weight_prefixes = (
        ("model.vision_tower.vision_model.", "vision_model."),
        ("vision_tower.vision_model.", "vision_model."),
        ("model.vision_tower.", "vision_model."),
        ("vision_tower.", "vision_model."),
        ("model.multi_modal_projector.", "projector."),
        ("multi_modal_projector.", "projector."),
    )
    # SigLIP's attention-pooling head, present when vision_use_head; Gemma 3 takes every patch
    unused_weights = ("vision_model.head.",)

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vision = SiglipSettings.from_hf(hf_config.vision_config)
        self.tokens_per_image = int(getattr(hf_config, "mm_tokens_per_image", 256))
        self.vision_model = SiglipVisionTransformer(vision)
        self.projector = Gemma3Projector(
            vision.hidden_size,
            hf_config.text_config.hidden_size,
            patches_per_side=vision.patches_per_side,
            tokens_per_image=self.tokens_per_image,
            eps=vision.layer_norm_eps,
        )

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        """``pixel_values``: float [images, 3, image_size, image_size] (Gemma3ImageProcessor's
        output, pan-and-scan crops included as images of their own). Returns
        [images * mm_tokens_per_image, text_hidden], image by image."""
        if extra:
            raise TypeError(f"unexpected inputs for Gemma 3: {sorted(extra)}")
        pixel_values = pixel_values.to(device=self.device, dtype=self.dtype)
        features = self.projector(self.vision_model(pixel_values))
        return features.reshape(-1, features.shape[-1])

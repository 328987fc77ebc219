"""Idefics3 and SmolVLM: SigLIP over each tile, then the connector (pixel shuffle, which trades
``scale_factor**2`` neighbouring patches for one wider row, and a linear projection into the
text model's width). Same computation as transformers' ``Idefics3Model.get_image_features``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pyserve.worker.vision.base import VisionTower
from pyserve.worker.vision.siglip import SiglipSettings, SiglipVisionTransformer


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """[tiles, side * side, dim] -> [tiles, side * side / s**2, dim * s**2], s = scale_factor:
    each output row holds an s x s block of patches, in transformers' order."""
    tiles, seq, dim = x.shape
    side = int(seq**0.5)
    if side * side != seq or side % scale_factor:
        raise ValueError(
            f"pixel shuffle needs a square patch grid divisible by {scale_factor}; got {seq}"
        )
    s = scale_factor
    x = x.view(tiles, side, side // s, dim * s)
    x = x.permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // s, side // s, dim * s * s)
    x = x.permute(0, 2, 1, 3)
    return x.reshape(tiles, seq // (s * s), dim * s * s)


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden: int, scale_factor: int, text_hidden: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = ModalityProjection(vision_hidden * scale_factor**2, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(pixel_shuffle(x, self.scale_factor))


def patch_mask_from_pixels(pixel_mask: torch.Tensor, patch_size: int) -> torch.Tensor:
    """A patch is image when any of its pixels is: bool [tiles, H, W] -> [tiles, H/p, W/p]."""
    cells = pixel_mask.unfold(1, patch_size, patch_size).unfold(2, patch_size, patch_size)
    return cells.sum(dim=(-1, -2)) > 0


class Idefics3VisionTower(VisionTower):
    weight_prefixes = (
        ("model.vision_model.", "vision_model."),
        ("model.connector.", "connector."),
        ("vision_model.", "vision_model."),
        ("connector.", "connector."),
    )

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vision = SiglipSettings.from_hf(hf_config.vision_config)
        self.patch_size = vision.patch_size
        self.scale_factor = int(hf_config.scale_factor)
        self.vision_model = SiglipVisionTransformer(vision, bucketed_positions=True)
        self.connector = Idefics3Connector(
            vision.hidden_size, self.scale_factor, hf_config.text_config.hidden_size
        )
        self.tokens_per_tile = vision.patches_per_side**2 // self.scale_factor**2

    @torch.no_grad()
    def encode(
        self,
        pixel_values: torch.Tensor,
        pixel_attention_mask: torch.Tensor | None = None,
        **extra: torch.Tensor,
    ) -> torch.Tensor:
        """``pixel_values``: float [tiles, 3, H, W] (or the processor's [batch, tiles, 3, H, W]);
        ``pixel_attention_mask``: bool/int [tiles, H, W] (or [batch, tiles, H, W]), True on
        image pixels; None means all image. Tiles that are all zero are the processor's
        padding and are dropped, as transformers does. Returns [real tiles * tokens_per_tile,
        text_hidden], tile by tile."""
        if extra:
            raise TypeError(f"unexpected inputs for Idefics3: {sorted(extra)}")
        if pixel_values.dim() == 5:
            pixel_values = pixel_values.flatten(0, 1)
            if pixel_attention_mask is not None:
                pixel_attention_mask = pixel_attention_mask.flatten(0, 1)
        pixel_values = pixel_values.to(device=self.device, dtype=self.dtype)
        real = (pixel_values != 0).flatten(1).any(dim=1)
        pixel_values = pixel_values[real]
        if pixel_attention_mask is None:
            pixel_mask = torch.ones(
                pixel_values.shape[0],
                *pixel_values.shape[2:],
                dtype=torch.bool,
                device=pixel_values.device,
            )
        else:
            pixel_mask = pixel_attention_mask.to(device=pixel_values.device)[real]
        patch_mask = patch_mask_from_pixels(pixel_mask, self.patch_size)
        hidden = self.vision_model(pixel_values, patch_mask)
        return self.connector(hidden).reshape(
            -1, self.connector.modality_projection.proj.out_features
        )

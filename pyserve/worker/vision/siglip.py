"""SigLIP's vision transformer, as Idefics3/SmolVLM and Gemma 3 use it.

Parameter names mirror Hugging Face's (``embeddings.patch_embedding``, ``encoder.layers.N.
self_attn.q_proj``, ``post_layernorm``...), so a checkpoint's names map onto them by a prefix.
Gemma 3 runs plain SigLIP (fixed square input, one position per patch); Idefics3 adds variable
resolution: a tile whose pixels are partly padding gets its positions stretched over the whole
position table (the NaViT "fractional" buckets) and its padding patches are masked out as keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.worker.vision.activations import activation


@dataclass(frozen=True)
class SiglipSettings:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, vision_config: Any) -> SiglipSettings:
        """From a transformers vision config (SiglipVisionConfig, Idefics3VisionConfig, ...)."""
        return cls(
            hidden_size=vision_config.hidden_size,
            intermediate_size=vision_config.intermediate_size,
            num_hidden_layers=vision_config.num_hidden_layers,
            num_attention_heads=vision_config.num_attention_heads,
            num_channels=getattr(vision_config, "num_channels", 3),
            image_size=vision_config.image_size,
            patch_size=vision_config.patch_size,
            layer_norm_eps=getattr(vision_config, "layer_norm_eps", 1e-6),
            hidden_act=getattr(vision_config, "hidden_act", "gelu_pytorch_tanh"),
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def bucketed_position_ids(patch_mask: torch.Tensor, patches_per_side: int) -> torch.Tensor:
    """Idefics3's position ids for tiles of which only the top-left ``rows x cols`` patches are
    image: those patches' fractional coordinates (i / rows, j / cols) pick buckets of the
    ``patches_per_side`` square table, so a small image still spans the whole table; padding
    patches get position 0. ``patch_mask``: bool [tiles, h, w]; returns long [tiles, h * w].

    The float steps are those of Idefics3VisionEmbeddings, op for op: a coordinate that lands
    on a bucket boundary must round the same way, or the position differs.
    """
    tiles, h, w = patch_mask.shape
    device = patch_mask.device
    # float32, made as transformers makes them
    boundaries = torch.arange(1 / patches_per_side, 1.0, 1 / patches_per_side, device=device)
    rows = patch_mask[:, :, 0].sum(dim=1)
    cols = patch_mask[:, 0, :].sum(dim=1)
    step_h = 1.0 / rows  # long -> float32 division
    step_w = 1.0 / cols
    coords_h = torch.arange(h, device=device, dtype=torch.float32)[None, :] * step_h[:, None]
    coords_w = torch.arange(w, device=device, dtype=torch.float32)[None, :] * step_w[:, None]
    coords_h = torch.clamp(coords_h, max=(1.0 - 1e-6))
    coords_w = torch.clamp(coords_w, max=(1.0 - 1e-6))
    bucket_h = torch.bucketize(coords_h, boundaries, right=True)
    bucket_w = torch.bucketize(coords_w, boundaries, right=True)
    ids = (bucket_h[:, :, None] * patches_per_side + bucket_w[:, None, :]).reshape(tiles, -1)
    return torch.where(patch_mask.reshape(tiles, -1), ids, torch.zeros_like(ids))


class SiglipEmbeddings(nn.Module):
    def __init__(self, settings: SiglipSettings, *, bucketed_positions: bool) -> None:
        super().__init__()
        self.patch_size = settings.patch_size
        self.patches_per_side = settings.patches_per_side
        self.bucketed_positions = bucketed_positions
        self.patch_embedding = nn.Conv2d(
            settings.num_channels,
            settings.hidden_size,
            kernel_size=settings.patch_size,
            stride=settings.patch_size,
        )
        self.position_embedding = nn.Embedding(settings.patches_per_side**2, settings.hidden_size)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        if self.bucketed_positions:
            if patch_mask is None:
                tiles, _, height, width = pixel_values.shape
                patch_mask = torch.ones(
                    tiles,
                    height // self.patch_size,
                    width // self.patch_size,
                    dtype=torch.bool,
                    device=pixel_values.device,
                )
            position_ids = bucketed_position_ids(patch_mask, self.patches_per_side)
            return patches + self.position_embedding(position_ids)
        # plain SigLIP: the input is the trained square, one table row per patch
        if patches.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(
                f"the vision tower takes {self.patches_per_side * self.patch_size}-pixel square "
                f"images; got {tuple(pixel_values.shape[-2:])}"
            )
        return patches + self.position_embedding.weight[None]


class SiglipAttention(nn.Module):
    def __init__(self, settings: SiglipSettings) -> None:
        super().__init__()
        hidden = settings.hidden_size
        self.num_heads = settings.num_attention_heads
        if hidden % self.num_heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of {self.num_heads} heads")
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """``key_mask``: bool [batch, 1, 1, seq], True where a patch may be attended to."""
        batch, seq, _ = x.shape
        shape = (batch, seq, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SiglipMLP(nn.Module):
    def __init__(self, settings: SiglipSettings) -> None:
        super().__init__()
        self.act = activation(settings.hidden_act)
        self.fc1 = nn.Linear(settings.hidden_size, settings.intermediate_size)
        self.fc2 = nn.Linear(settings.intermediate_size, settings.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, settings: SiglipSettings) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)
        self.self_attn = SiglipAttention(settings)
        self.layer_norm2 = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)
        self.mlp = SiglipMLP(settings)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, settings: SiglipSettings) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            SiglipEncoderLayer(settings) for _ in range(settings.num_hidden_layers)
        )

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


class SiglipVisionTransformer(nn.Module):
    """Pixels [batch, C, H, W] -> the last hidden state [batch, patches, hidden] (after
    post_layernorm; no pooling head: both VLMs take every patch)."""

    def __init__(self, settings: SiglipSettings, *, bucketed_positions: bool = False) -> None:
        super().__init__()
        self.settings = settings
        self.embeddings = SiglipEmbeddings(settings, bucketed_positions=bucketed_positions)
        self.encoder = SiglipEncoder(settings)
        self.post_layernorm = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)

    def forward(
        self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``patch_mask``: bool [batch, H / patch, W / patch], True for image patches (Idefics3);
        None when every patch is image."""
        x = self.embeddings(pixel_values, patch_mask)
        key_mask = None
        # a full mask is left out: SDPA then takes its fused unmasked path
        if patch_mask is not None and not bool(patch_mask.all()):
            key_mask = patch_mask.reshape(patch_mask.shape[0], 1, 1, -1)
        x = self.encoder(x, key_mask)
        return self.post_layernorm(x)

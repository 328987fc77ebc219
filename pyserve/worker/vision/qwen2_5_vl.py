"""Qwen2.5-VL's vision transformer: patches of any image size (no tiles, no resizing to a square),
2D rotary positions, windowed attention in most blocks and full attention per image in the
``fullatt_block_indexes`` ones, and a merger that turns each ``merge x merge`` block of patches
into one text-width row.

The input is Qwen2VLImageProcessor's: ``pixel_values`` [patches, C * T * P * P], the patches of
every image one after another, already ordered so that each merge block's patches are
consecutive; ``image_grid_thw`` [images, 3] the (frames, rows, cols) of patches of each.
The blocks run on the patches in window order (every window's patches consecutive), so that
windowed attention is attention within consecutive segments; the merger's rows are put back in
image order at the end.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.worker.vision.activations import activation
from pyserve.worker.vision.base import VisionTower


class RMSNorm(nn.Module):
    """Qwen's RMSNorm: normalized in float32, cast back, then scaled."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d, whose kernel equals its stride and its input: one matmul."""

    def __init__(self, in_features: int, kernel: tuple[int, ...], hidden: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(hidden, *kernel))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches, weight.reshape(weight.shape[0], self.in_features))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Attention within consecutive segments of ``lengths`` tokens; q, k, v [tokens, heads,
    head_dim]. Segments of one length become a batch; unequal ones are padded to the longest,
    the padding masked out as keys, so that either way it is one SDPA call."""
    tokens, heads, dim = q.shape
    count, longest = len(lengths), max(lengths)
    if all(n == longest for n in lengths):
        qb, kb, vb = (t.reshape(count, longest, heads, dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qb, kb, vb)
        return out.transpose(1, 2).reshape(tokens, heads, dim)
    device = q.device
    sizes = torch.tensor(lengths, device=device)
    segment = torch.repeat_interleave(torch.arange(count, device=device), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    offset = torch.arange(tokens, device=device) - starts[segment]

    def padded(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(count, longest, heads, dim)
        out[segment, offset] = t
        return out.transpose(1, 2)

    key_mask = (torch.arange(longest, device=device)[None, :] < sizes[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=key_mask)
    return out.transpose(1, 2)[segment, offset]


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).reshape(tokens, 3, self.heads, self.head_dim).unbind(1)
        # rotary in float32, as the reference does, whatever the weights' dtype
        cos, sin = cos[:, None, :], sin[:, None, :]
        qf, kf = q.float(), k.float()
        q = (qf * cos + rotate_half(qf) * sin).to(v.dtype)
        k = (kf * cos + rotate_half(kf) * sin).to(v.dtype)
        out = segment_attention(q, k, v, lengths)
        return self.proj(out.reshape(tokens, -1))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.act = activation(act)
        self.gate_proj = nn.Linear(hidden, intermediate)
        self.up_proj = nn.Linear(hidden, intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden)
        self.attn = VisionAttention(hidden, heads)
        self.norm2 = RMSNorm(hidden)
        self.mlp = GatedMLP(hidden, intermediate, act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, out_hidden: int, merge: int) -> None:
        super().__init__()
        self.merged = hidden * merge * merge
        self.ln_q = RMSNorm(hidden)
        # a Sequential for the checkpoint's names: mlp.0, mlp.2 (mlp.1 is the exact GELU)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, out_hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


def rotary_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, col) of every patch, long [patches, 2], in the processor's order: merge blocks
    row-major, and within a block its patches row-major; repeated for every frame."""
    rows = []
    for t, h, w in grid_thw:
        r = torch.arange(h)[:, None].expand(h, w)
        c = torch.arange(w)[None, :].expand(h, w)
        pos = torch.stack((r, c), dim=-1)  # [h, w, 2]
        pos = pos.reshape(h // merge, merge, w // merge, merge, 2).transpose(1, 2)
        rows.append(pos.reshape(-1, 2).repeat(t, 1))
    return torch.cat(rows)


def window_order(
    grid_thw: list[tuple[int, int, int]], merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks in window order (long [blocks]: window order -> image order) and the
    length in patches of every window. Windows are ``window x window`` merge blocks of one
    frame, tiled from the top-left; those on the right and bottom edges may be smaller."""
    order, lengths = [], []
    first = 0
    for t, h, w in grid_thw:
        bh, bw = h // merge, w // merge
        ph, pw = -bh % window, -bw % window  # pad to whole windows
        index = torch.arange(t * bh * bw).reshape(t, bh, bw)
        index = F.pad(index, (0, pw, 0, ph), value=-1)
        nh, nw = (bh + ph) // window, (bw + pw) // window
        index = index.reshape(t, nh, window, nw, window).permute(0, 1, 3, 2, 4)
        index = index.reshape(t * nh * nw, window * window)
        real = index >= 0
        order.append(index[real] + first)
        lengths += [int(n) * merge * merge for n in real.sum(dim=1).tolist() if n]
        first += t * bh * bw
    return torch.cat(order), lengths


class Qwen2_5_VLVisionTower(VisionTower):
    # Qwen's own checkpoints and transformers 5 say visual.*, transformers 4.5x model.visual.*
    weight_prefixes = (("model.visual.", "visual."), ("visual.", "visual."))

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vc = hf_config.vision_config
        hidden, heads = vc.hidden_size, vc.num_heads
        self.merge = vc.spatial_merge_size
        self.patch_size = vc.patch_size
        self.window = vc.window_size // self.merge // self.patch_size  # in merge blocks
        self.full_attention_blocks = frozenset(vc.fullatt_block_indexes)
        self.out_hidden = vc.out_hidden_size
        rope = getattr(vc, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        self.head_dim = hidden // heads
        channels = getattr(vc, "in_channels", 3)
        kernel = (channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.patch_features = channels * vc.temporal_patch_size * vc.patch_size**2

        self.visual = nn.Module()
        self.visual.patch_embed = PatchEmbed(self.patch_features, kernel, hidden)
        self.visual.blocks = nn.ModuleList(
            VisionBlock(hidden, heads, vc.intermediate_size, vc.hidden_act) for _ in range(vc.depth)
        )
        self.visual.merger = PatchMerger(hidden, self.out_hidden, self.merge)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 [patches, head_dim]: a quarter of the head's frequencies turn with
        the row, a quarter with the column, and the halves repeat for rotate_half."""
        quarter = self.head_dim // 2
        inv_freq = 1.0 / (
            self.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)
        )
        freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [n, 2, hd / 4]
        freqs = freqs.flatten(1)  # rows' frequencies, then columns'
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def encode(
        self,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        **extra: torch.Tensor,
    ) -> torch.Tensor:
        """``pixel_values``: float [patches, C * T * P * P]; ``image_grid_thw``: int [images, 3].
        Returns [patches / merge**2, out_hidden_size], image by image."""
        if extra:
            raise TypeError(f"unexpected inputs for Qwen2.5-VL: {sorted(extra)}")
        if image_grid_thw is None:
            raise TypeError("Qwen2.5-VL needs image_grid_thw")
        grid = [tuple(int(n) for n in row) for row in image_grid_thw.tolist()]
        patches = sum(t * h * w for t, h, w in grid)
        if pixel_values.shape != (patches, self.patch_features):
            raise ValueError(
                f"pixel_values {tuple(pixel_values.shape)} do not match image_grid_thw "
                f"({patches} patches of {self.patch_features})"
            )
        device, unit = self.device, self.merge * self.merge
        x = self.visual.patch_embed(pixel_values.to(device=device, dtype=self.dtype))

        order, window_lengths = window_order(grid, self.merge, self.window)
        order = order.to(device)
        image_lengths = [h * w for t, h, w in grid for _ in range(t)]  # frames apart

        def windowed(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, unit, t.shape[-1])[order].reshape(-1, t.shape[-1])

        x = windowed(x)
        cos, sin = self.rotary(rotary_positions(grid, self.merge).to(device))
        cos, sin = windowed(cos), windowed(sin)
        for i, block in enumerate(self.visual.blocks):
            lengths = image_lengths if i in self.full_attention_blocks else window_lengths
            x = block(x, cos, sin, lengths)
        merged = self.visual.merger(x)
        return merged[torch.argsort(order)]

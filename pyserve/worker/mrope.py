"""Multimodal rope positions (Qwen2.5-VL): where a prompt's tokens are for rotary purposes.

Text tokens count up one by one. An image's merged patches are laid out on its grid: the
temporal, height and width positions of patch (t, i, j) are start + t, start + i, start + j;
the text after the image continues from start + max(grid height, grid width). So a prompt's last
rope position falls short of its length by a constant, and every later token (generated, or
recomputed after retraction) turns by its cache position plus that ``delta`` on all three axes:
the layout of transformers' ``get_rope_index`` for still images.
"""

from __future__ import annotations

import numpy as np


def mrope_positions(
    prompt_len: int, images: list[tuple[np.ndarray, tuple[int, int, int]]], merge: int
) -> tuple[np.ndarray, int]:
    """(int64 [3, prompt_len] rope positions, delta) for a prompt whose images fill the given
    positions (one contiguous run each, in prompt order) with patch grids (t, h, w) before the
    ``merge`` × ``merge`` merge."""
    out = np.empty((3, prompt_len), dtype=np.int64)
    current = at = 0
    for positions, (t, h, w) in sorted(images, key=lambda image: int(image[0][0])):
        start, count = int(positions[0]), len(positions)
        grid_h, grid_w = h // merge, w // merge
        if t * grid_h * grid_w != count or positions[-1] - start + 1 != count:
            raise ValueError(
                f"an image of grid {(t, h, w)} fills {count} positions, not one run of "
                f"{t * grid_h * grid_w}"
            )
        out[:, at:start] = current + np.arange(start - at)
        current += start - at
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(grid_h), np.arange(grid_w), indexing="ij")
        out[:, start : start + count] = np.stack([tt, hh, ww]).reshape(3, -1) + current
        current += max(h, w) // merge
        at = start + count
    out[:, at:] = current + np.arange(prompt_len - at)
    return out, int(out.max()) + 1 - prompt_len

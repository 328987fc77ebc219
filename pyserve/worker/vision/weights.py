"""Filling a vision tower from a checkpoint's named tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pyserve.worker.loading.base import ModelLoadError
from pyserve.worker.vision.base import VisionTower

if TYPE_CHECKING:
    from pyserve.worker.loading.base import StoredTensor

# buffers computed at construction that some exporters saved anyway (position indices, rotary
# frequencies): the towers derive them, so a stored copy is not a stray tensor
_DERIVED_BUFFERS = (".position_ids", ".inv_freq")


def load_vision_weights(
    tower: VisionTower, tensors: list[tuple[str, StoredTensor]], source: str
) -> None:
    """Copies every tensor under the tower's prefixes into its parameter (cast to the tower's
    dtype, on its device), reading them one at a time. Other names (the text model's) are
    skipped. A tensor missing, misshapen or unknown under those prefixes raises ModelLoadError
    naming it and ``source`` (the checkpoint path)."""
    params = dict(tower.named_parameters())
    filled: set[str] = set()
    used: dict[str, str] = {}  # module prefix -> the checkpoint prefix this file names it by
    for name, stored in tensors:
        matched = tower.match(name)
        if matched is None:
            continue
        prefix, local = matched
        used.setdefault(local[: local.index(".") + 1], prefix)
        if local.startswith(tower.unused_weights) or local.endswith(_DERIVED_BUFFERS):
            continue
        param = params.get(local)
        if param is None:
            raise ModelLoadError(f"{source}: unexpected vision tensor {name}")
        if tuple(stored.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{source}: vision tensor {name} has shape {list(stored.shape)}, "
                f"expected {list(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(stored.values())
        filled.add(local)
    missing = [tower.checkpoint_name(local, used) for local in params if local not in filled]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"{source}: missing vision tensor(s) {shown}")

"""Image embeddings for a step: which rows of the batch each image fills, and the vision tower's
outputs, cached by the image's key.

A request's images (``ImageInput``) name the prompt positions their embedding rows fill. A
prefill chunk covering some of them takes those rows (a chunk may cover part of an image: the
rest comes with the next chunk, from the cache). The tower runs once per image while its output
is cached (a later turn with the same picture, a prefix recomputed after retraction, the next
chunk); the cache holds up to ``cache_bytes`` of outputs, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pyserve.wire.main_to_worker import ImageInput, WireTensor

DEFAULT_CACHE_BYTES = 256 << 20


class Tower(Protocol):
    """The part of a vision tower (``pyserve.worker.vision.VisionTower``) used here."""

    def encode(self, pixel_values: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class RequestImage:
    """One image of a live request: its wire form and its positions as an array."""

    image: ImageInput
    positions: np.ndarray  # int64, ascending

    @classmethod
    def of(cls, image: ImageInput, prompt_len: int) -> RequestImage:
        positions = np.frombuffer(image.positions, dtype="<i4").astype(np.int64)
        if positions.size == 0:
            raise ValueError("an image fills no prompt position")
        if positions[0] < 0 or positions[-1] >= prompt_len or np.any(np.diff(positions) <= 0):
            raise ValueError("an image's positions must ascend inside the prompt")
        if "pixel_values" not in image.tensors:
            raise ValueError("an image without pixel_values")
        return cls(image, positions)


@dataclass(frozen=True)
class ImageSlice:
    """Rows ``[lo, hi)`` of an image's embeddings, going to rows ``batch_rows`` of a step."""

    image: RequestImage
    lo: int
    hi: int
    batch_rows: np.ndarray


def image_slices(
    images: list[RequestImage], start: int, count: int, first_row: int
) -> list[ImageSlice]:
    """The slices of ``images`` a chunk of positions ``[start, start + count)`` covers, whose
    first token is row ``first_row`` of the batch."""
    slices = []
    for item in images:
        lo, hi = np.searchsorted(item.positions, [start, start + count])
        if hi > lo:
            rows = item.positions[lo:hi] - start + first_row
            slices.append(ImageSlice(item, int(lo), int(hi), rows))
    return slices


def row_runs(slices: list[ImageSlice]) -> list[tuple[int, int]]:
    """The maximal runs ``[first, end)`` of consecutive batch rows of each slice."""
    runs = []
    for s in slices:
        breaks = np.flatnonzero(np.diff(s.batch_rows) != 1) + 1
        for part in np.split(s.batch_rows, breaks):
            runs.append((int(part[0]), int(part[-1]) + 1))
    return runs


class ImageEncoder:
    """A vision tower and the cache of its outputs, by image key."""

    def __init__(
        self,
        tower: Tower,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.tower = tower
        self.device = torch.device(device)
        self.dtype = dtype
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._cached_bytes = 0
        self.encoded = 0  # images through the tower (the rest came from the cache)

    def embeddings(self, slices: list[ImageSlice]) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch rows int64 [R], embeddings [R, hidden]) of a step's image slices."""
        rows = torch.from_numpy(np.concatenate([s.batch_rows for s in slices])).to(self.device)
        parts = [self._outputs(s.image)[s.lo : s.hi] for s in slices]
        return rows, torch.cat(parts) if len(parts) > 1 else parts[0]

    def _outputs(self, item: RequestImage) -> torch.Tensor:
        key = item.image.key
        out = self._cache.get(key)
        if out is not None:
            self._cache.move_to_end(key)
            return out
        tensors = {name: self._tensor(t) for name, t in item.image.tensors.items()}
        with torch.inference_mode():
            out = self.tower.encode(**tensors)
        if out.shape[0] != len(item.positions):
            raise ValueError(
                f"the vision tower made {out.shape[0]} rows for an image with "
                f"{len(item.positions)} placeholders"
            )
        self.encoded += 1
        self._cache[key] = out
        self._cached_bytes += out.nbytes
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
        return out

    def _tensor(self, t: WireTensor) -> torch.Tensor:
        array = np.frombuffer(t.data, dtype=np.dtype(t.dtype)).reshape(t.shape)
        tensor = torch.from_numpy(array.copy()).to(self.device)
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def clear(self) -> None:
        self._cache.clear()
        self._cached_bytes = 0


@dataclass(frozen=True)
class VisionModel:
    """What the worker knows of a model that takes images: its tower (with the cache of its
    outputs), the token its requests' image positions count as (for penalties), whether each
    run of an image's positions attends to itself both ways in prefill (Gemma 3), and the
    merge of the patch grid its multimodal rope lays images on (Qwen2.5-VL; None: plain rope)."""

    encoder: ImageEncoder
    token_id: int
    bidirectional: bool = False
    mrope_merge: int | None = None

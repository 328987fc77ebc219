"""What every checkpoint format yields: a ModelConfig and its tensors in HF naming, read lazily.

A checkpoint lists its tensors (name, shape, stored type) without reading them, so the loader
checks the whole file against the config before it reads any weight, and then reads them one at
a time: each goes into its final form (packed for the kernels, or a float parameter) and its
bytes are dropped before the next is read, so no second copy of the model ever exists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pyserve.worker.models.config import ModelConfig
from pyserve.worker.models.registry import Family


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file and the problem."""


class StoredTensor(ABC):
    """One tensor of a checkpoint file, read only when asked."""

    file: str  # for error messages
    name: str  # the file's own name for it
    shape: tuple[int, ...]  # Hugging Face layout ([out, in] for a projection)
    type_name: str  # what the file stores: "Q4_K", "F16", "bfloat16", ...
    nbytes: int  # bytes in the file

    @abstractmethod
    def values(self) -> torch.Tensor:
        """The tensor in float: its own dtype if the file stores floats, float32 otherwise."""

    @property
    def quantized(self) -> bool:
        return False

    @property
    def native_bits(self) -> int | None:
        """The kernel precision (4 or 8) that holds this tensor as the file does, or closest to
        it; None for floats."""
        return None

    def blocks(self) -> np.ndarray | None:
        """A quantized tensor's bytes as the file stores them, uint8 [rows, bytes of a row], in
        Hugging Face's row order; None for a float tensor."""
        return None

    def pieces(self, rows: int) -> Iterator[StoredTensor]:
        """The tensor as consecutive pieces of ``rows`` rows (the last may be shorter), each
        decoded on its own: a large table is converted without its whole float copy."""
        yield self


@dataclass
class Checkpoint:
    path: str  # the directory or .gguf file, for error messages
    config: ModelConfig
    family: Family
    # every tensor, in file order, named as in Hugging Face Llama checkpoints
    # ("model.layers.0.mlp.up_proj.weight"); nothing is read until a tensor's values are asked
    tensors: list[tuple[str, StoredTensor]]
    # The kernel precision that holds most of the file's linear weights ("int4", "int8"), what
    # quantization="auto" reports; None for float checkpoints (HF safetensors, F32/F16/BF16 GGUF).
    quantization_hint: str | None = None
    # Norm weights stored as offset + w already (llama.cpp's Gemma GGUFs), not as w
    norms_include_offset: bool = False

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for _, tensor in self.tensors)


def read_exactly(path: str, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes of ``path`` from ``offset`` into a fresh uint8 array (a plain read, not a
    memory map: pages of a map count in the process's memory until it is dropped)."""
    buffer = np.empty(nbytes, np.uint8)
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(buffer))
    if got != nbytes:
        raise ModelLoadError(f"{path}: truncated (a tensor's data ends past the end of the file)")
    return buffer

"""What every checkpoint format yields: a ModelConfig and (name, tensor) pairs in HF naming."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pyserve.worker.models.config import ModelConfig
from pyserve.worker.models.registry import Family


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file and the problem."""


@dataclass
class Checkpoint:
    path: str  # the directory or .gguf file, for error messages
    config: ModelConfig
    family: Family
    # Yields tensors named and laid out ([out, in]) as in Hugging Face Llama checkpoints
    # ("model.layers.0.mlp.up_proj.weight"), one at a time so peak memory stays near one copy.
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    # The kernel precision that holds the file's linear weights ("int4", "int8"), what
    # quantization="auto" serves; None for float checkpoints (HF safetensors, F32/F16/BF16 GGUF).
    quantization_hint: str | None = None
    # Norm weights stored as offset + w already (llama.cpp's Gemma GGUFs), not as w
    norms_include_offset: bool = False

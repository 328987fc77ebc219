"""What every vision tower is: an nn.Module that turns one request's preprocessed pixels into
the embedding rows of its image placeholder tokens, and knows where its weights live in a
checkpoint."""

from __future__ import annotations

import torch
from torch import nn


class VisionTower(nn.Module):
    # (checkpoint prefix, this module's prefix), most specific first: checkpoints written by
    # different transformers versions name the same tensor differently, and the first prefix a
    # name starts with decides where it goes
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    # module-relative name prefixes some checkpoints carry but no encode uses (a pooling head)
    unused_weights: tuple[str, ...] = ()

    def encode(self, pixel_values: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        """[tokens, text_hidden] in the tower's dtype (the text model's), one row per image
        placeholder token, in order."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def match(self, checkpoint_name: str) -> tuple[str, str] | None:
        """(the checkpoint prefix it starts with, the parameter it fills), or None when the name
        is not the tower's."""
        for stored, local in self.weight_prefixes:
            if checkpoint_name.startswith(stored):
                return stored, local + checkpoint_name[len(stored) :]
        return None

    def checkpoint_name(self, local_name: str, used: dict[str, str] | None = None) -> str:
        """The name a parameter would have in a checkpoint, for error messages: under the
        prefix ``used`` says that checkpoint took for its module (module prefix -> checkpoint
        prefix), else under the first one listed."""
        for stored, local in self.weight_prefixes:
            if local_name.startswith(local):
                stored = (used or {}).get(local, stored)
                return stored + local_name[len(local) :]
        return local_name

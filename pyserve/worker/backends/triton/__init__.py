"""The Triton kernels of the GPU backend (backend.py); on a CPU they run under
Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check them."""

from __future__ import annotations


def dot_precision(dtype) -> str:
    """``tl.dot``'s input precision for inputs of this torch dtype: float32 in float32 (a GPU
    would otherwise round it to tf32), the GPU's fastest for the others."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"

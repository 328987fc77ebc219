"""The Triton backend (backend.py) and its kernels: attention.py, fused.py, quant_matmul.py (its
quantized layers), experts.py (a mixture's experts as grouped matmuls) and its fast path, CUDA
graphs of decode steps (decode_graphs.py); kv_int8.py has an int8 cache's scale layout. On a
CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests
check them. Nothing here imports triton until a kernel module is imported."""

from __future__ import annotations


def dot_precision(dtype) -> str:
    """``tl.dot``'s input precision for inputs of this torch dtype: float32 in float32 (a GPU
    would otherwise round it to tf32), the GPU's fastest for the others."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"

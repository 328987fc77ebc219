"""The CPU kernels backend (backend.py) on `pyserve._kernels`: its attention (attention_kernel.py),
fused layer ops (layer_ops.py), quantized layers (quant_linear.py) and whole-stack fast path
(stack.py)."""

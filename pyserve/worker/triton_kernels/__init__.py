"""The Triton kernels of the GPU backend (backends/triton_gpu.py); on a CPU they run under
Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check them."""

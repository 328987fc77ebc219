"""Fused RMSNorm and SiLU·up (pyserve._kernels via worker/layer_ops.py).

Against Hugging Face's arithmetic written out in torch (LlamaRMSNorm: float32 mean of squares,
rsqrt, the bf16 roundings; SwiGLU: F.silu(gate) * up), on every instruction set this CPU runs
(the AVX-512 loops and the scalar ones; the avx2 ISA takes the scalar loops), 1 and 2 threads,
row counts on both sides of the threading threshold, widths with masked tails, strided rows.
Then: the wrappers fall back to torch where the kernels do not apply, and bad arguments raise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyserve.worker import layer_ops, quant

KERNELS = quant.kernels()
DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 32, 129]  # 129 × 1536 is past the threading threshold
# bf16: the kernel rounds where HF rounds, so results are equal but for float32 sums taken in
# another order (a different rsqrt by one ulp) moving an element across a bf16 rounding edge,
# which the product with the weight can round by one more ulp; exp is clamped at e^-87, so silu
# of a very negative gate is ~1e-36 rather than a denormal
TOLERANCE = {
    torch.float32: dict(atol=2e-6, rtol=2e-6),
    torch.bfloat16: dict(atol=1e-30, rtol=2**-6),
}


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def run_kernel(fn, *args):
    """Calls the C++ kernel whatever layer_ops chose for this CPU."""
    saved = layer_ops.fused_kernels
    layer_ops.fused_kernels = lambda: KERNELS
    try:
        return fn(*args)
    finally:
        layer_ops.fused_kernels = saved


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [576, 61])
def test_rms_norm_matches_hf(isa, threads, dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 4).to(dtype)
    weight = (torch.randn(hidden, generator=g)).to(dtype)
    got = run_kernel(layer_ops.rms_norm, x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, hf_rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 45])
def test_silu_mul_matches_torch(isa, threads, dtype, rows, width):
    g = torch.Generator().manual_seed(rows + width)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 5).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends, signed zeros
    got = run_kernel(layer_ops.silu_mul, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, **TOLERANCE[dtype])


def test_strided_and_batched_inputs():
    """Rows of a wider buffer (a slice of the qkv projection, say) and 3-D inputs."""
    wide = torch.randn(5, 7, 900)
    x = wide[..., 100:676]  # rows 900 elements apart
    weight = torch.randn(576)
    torch.testing.assert_close(
        run_kernel(layer_ops.rms_norm, x, weight, 1e-6), hf_rms_norm(x, weight, 1e-6)
    )
    gate_up = torch.randn(2, 3, 2 * 64)
    gate, up = gate_up.chunk(2, dim=-1)
    got = run_kernel(layer_ops.silu_mul, gate_up)
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got, F.silu(gate) * up)


def test_other_dtypes_fall_back_to_torch():
    x = torch.randn(4, 32, dtype=torch.float16)
    weight = torch.randn(32, dtype=torch.float16)
    got = run_kernel(layer_ops.rms_norm, x, weight, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (32,), weight, 1e-5))
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(run_kernel(layer_ops.silu_mul, x), F.silu(gate) * up)


def test_no_rows_is_a_no_op():
    x = torch.empty(0, 576)
    assert run_kernel(layer_ops.rms_norm, x, torch.ones(576), 1e-5).shape == (0, 576)
    assert run_kernel(layer_ops.silu_mul, torch.empty(0, 64)).shape == (0, 32)


def test_bad_arguments_raise_value_error():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight shape"):
        run_kernel(layer_ops.rms_norm, x, torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        KERNELS.rms_norm(2, x.data_ptr(), 8, 2, 8, x.data_ptr(), 1e-5, x.data_ptr(), 8)
    with pytest.raises(ValueError, match="stride"):
        KERNELS.silu_mul(0, x.data_ptr(), 4, 2, 4, x.data_ptr(), 4)
    with pytest.raises(ValueError, match="eps"):
        KERNELS.rms_norm(0, x.data_ptr(), 8, 2, 8, x.data_ptr(), -1.0, x.data_ptr(), 8)

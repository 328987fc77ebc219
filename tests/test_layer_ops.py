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


def run_kernel(fn, *args, **kwargs):
    """Calls the C++ kernel whatever layer_ops chose for this CPU."""
    saved = layer_ops.fused_kernels
    layer_ops.fused_kernels = lambda: KERNELS
    try:
        return fn(*args, **kwargs)
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
@pytest.mark.parametrize("hidden", [576, 61])
def test_rms_norm_with_residual_adds_then_normalizes(isa, threads, dtype, rows, hidden):
    """The decoder block's residual connection fused into the next norm: residual += x in the
    dtype (HF's `residual + hidden_states`), in place, then the norm of the sum."""
    g = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 4).to(dtype)
    residual = (torch.randn(rows, hidden, generator=g) * 4).to(dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)
    expected_sum = residual + x
    got = run_kernel(layer_ops.rms_norm, x, weight, 1e-5, residual)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(got, hf_rms_norm(expected_sum, weight, 1e-5), **TOLERANCE[dtype])
    # the torch fallback (float16, which the kernels do not take) updates the residual too
    half, half_residual = x.half(), expected_sum.half()
    expected_half = half_residual + half
    out = layer_ops.rms_norm(half, weight.half(), 1e-5, half_residual)
    assert torch.equal(half_residual, expected_half) and out.dtype == torch.float16


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


def rope_case(rows: int, heads: int, kv_heads: int, dim: int, cache_dtype, seed: int):
    """A qkv projection, rope tables for scattered positions, distinct random slots, caches."""
    from pyserve.worker.kv_cache import PagedKVCache

    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g) * 3
    qkv[0, :dim] = 1e6  # float16 caches saturate this row's k... (q: any value)
    qkv[0, heads * dim : (heads + 1) * dim] = 1e6
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.randint(0, 4000, (rows,), generator=g).float()[:, None] * inv_freq
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None, :]
    signed_sin = torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None, :]
    block = 16
    cache = PagedKVCache(num_layers=1, num_blocks=rows // block + 8, block_size=block,
                         num_kv_heads=kv_heads, head_dim=dim, dtype=cache_dtype)  # fmt: skip
    slots = torch.randperm(cache.num_blocks * block, generator=g)[:rows]
    return qkv, cos, signed_sin, slots, cache


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 128), (3, 1, 40)], ids=str)
def test_rope_write_kv_is_torch_rope_then_cache_write_bit_for_bit(
    isa, threads, cache_dtype, rows, shape
):
    """q rotated in place and the cache written exactly as rope.apply_rope followed by
    PagedKVCache.write do it (HF's float32 rotation; torch's conversion and float16 clamp)."""
    from pyserve.worker.rope import apply_rope

    heads, kv_heads, dim = shape
    qkv, cos, signed_sin, slots, cache = rope_case(rows, heads, kv_heads, dim, cache_dtype, rows)
    _, _, _, _, expected = rope_case(rows, heads, kv_heads, dim, cache_dtype, rows)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim), cos, signed_sin)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    expected.write(0, slots, qk[:, heads:], v)
    done = run_kernel(layer_ops.rope_write_kv, qkv, cos, signed_sin, slots, cache.k[0],
                      cache.v[0], num_heads=heads, num_kv_heads=kv_heads)  # fmt: skip
    assert done
    assert torch.equal(qkv[:, : heads * dim].view(rows, heads, dim), qk[:, :heads])
    assert torch.equal(cache.k[0], expected.k[0]) and torch.equal(cache.v[0], expected.v[0])
    assert torch.isfinite(cache.k[0]).all()


def test_rope_write_kv_checks_its_arguments():
    qkv, cos, signed_sin, slots, cache = rope_case(8, 9, 3, 64, torch.float16, 1)

    def call(**changes):
        args = dict(qkv=qkv, cos=cos, signed_sin=signed_sin, slots=slots, k_cache=cache.k[0],
                    v_cache=cache.v[0], num_heads=9, num_kv_heads=3)  # fmt: skip
        args.update(changes)
        return run_kernel(layer_ops.rope_write_kv, *[args.pop(n) for n in list(args)[:6]], **args)

    assert call()
    assert not call(qkv=qkv.double())  # not the kernel's dtype: the caller rotates with torch
    bad = {
        "heads": dict(num_heads=8),
        "kv heads": dict(num_kv_heads=2),
        "table rows": dict(cos=cos[:4], signed_sin=signed_sin[:4]),
        "slot count": dict(slots=slots[:4]),
        "int32 slots": dict(slots=slots.int()),
        "v as k": dict(k_cache=cache.v[0]),
    }
    for what, changes in bad.items():
        with pytest.raises(ValueError):
            call(**changes)
            pytest.fail(what)
    for slot in (-1, cache.num_blocks * cache.block_size):
        with pytest.raises(ValueError, match="out of range"):
            call(slots=torch.full_like(slots, slot))


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

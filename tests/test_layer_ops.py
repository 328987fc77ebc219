"""Fused RMSNorm, SiLU·up, GELU-tanh·up and gpt-oss's clamped SwiGLU (pyserve._kernels via
worker/backends/cpu/layer_ops.py).

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

from pyserve.worker import quant
from pyserve.worker.backends.cpu import layer_ops
from pyserve.worker.backends.torch.activations import clamped_swiglu

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
    if cache_dtype == torch.int8 and rows > 1:  # float16 scales: subnormal, and saturated
        qkv[1, heads * dim : (heads + 1) * dim] *= 1e-4  # the whole head, as rope mixes it
        v_head = (heads + kv_heads) * dim
        qkv[1, v_head : v_head + 32] *= 3e-4
        qkv[1, v_head + 32 : v_head + 64] *= 1e9
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.randint(0, 4000, (rows,), generator=g).float()[:, None] * inv_freq
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None, :]
    signed_sin = torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None, :]
    block = 16
    cache = PagedKVCache(num_layers=1, num_blocks=rows // block + 8, block_size=block,
                         num_kv_heads=kv_heads, head_dim=dim, dtype=cache_dtype)  # fmt: skip
    slots = torch.randperm(cache.num_blocks * block, generator=g)[:rows]
    return qkv, cos, signed_sin, slots, cache


def scales(cache) -> dict:
    """An int8 cache's layer-0 scales as rope_write_kv's keywords (none for a float cache)."""
    return {"k_scale": cache.k_scale[0], "v_scale": cache.v_scale[0]} if cache.quantized else {}


@pytest.mark.parametrize(
    "cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8], ids=str
)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 128), (3, 1, 40), (4, 2, 80)], ids=str)
def test_rope_write_kv_is_torch_rope_then_cache_write_bit_for_bit(
    isa, threads, cache_dtype, rows, shape
):
    """q rotated in place and the cache written exactly as rope.apply_rope followed by
    PagedKVCache.write do it (HF's float32 rotation; torch's conversion and float16 clamp; an
    int8 cache's values and float16 scales per 32 values as kv_cache.quantize_int8's, in their
    layouts, subnormal and saturated scales included)."""
    from pyserve.worker.rope import apply_rope

    heads, kv_heads, dim = shape
    qkv, cos, signed_sin, slots, cache = rope_case(rows, heads, kv_heads, dim, cache_dtype, rows)
    _, _, _, _, expected = rope_case(rows, heads, kv_heads, dim, cache_dtype, rows)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim), cos, signed_sin)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    expected.write(0, slots, qk[:, heads:], v)
    done = run_kernel(layer_ops.rope_write_kv, qkv, cos, signed_sin, slots, cache.k[0],
                      cache.v[0], num_heads=heads, num_kv_heads=kv_heads,
                      **scales(cache))  # fmt: skip
    assert done
    assert torch.equal(qkv[:, : heads * dim].view(rows, heads, dim), qk[:, :heads])
    assert torch.equal(cache.k[0], expected.k[0]) and torch.equal(cache.v[0], expected.v[0])
    assert torch.isfinite(cache.k[0]).all()
    if cache.quantized:
        assert torch.equal(cache.k_scale[0], expected.k_scale[0])
        assert torch.equal(cache.v_scale[0], expected.v_scale[0])
        groups = cache.scale_groups  # every written token's, in every group (row 1's tiny K
        # group included: its scale is a float16 subnormal)
        assert (cache.k_scale[0] > 0).sum() == rows * kv_heads * groups
        if rows > 1:
            k_scales = expected.k_scale[0]
            assert ((k_scales > 0) & (k_scales < 2**-14)).any()
            assert (expected.v_scale[0] == 65504).any()


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


# ------------------------------------------------------------------ GELU (tanh) · up


def gelu_tanh_exact(x: torch.Tensor) -> torch.Tensor:
    """float64 gelu_tanh as x·sigmoid(2u), u = √(2/π)·(x + 0.044715·x³): the function of
    F.gelu(approximate="tanh"), whose own 0.5·x·(1 + tanh(u)) loses every digit to the
    cancellation below x ≈ −4 even in float64 (checked where it does not)."""
    x = x.double()
    exact = x / (1 + torch.exp(-2 * (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
    torch_form = F.gelu(x, approximate="tanh")
    fine = (x > -3) & (x != 0)
    assert ((torch_form - exact).abs() <= 1e-13 * exact.abs())[fine].all()
    return exact


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    rounded = exact.float().abs()
    spacing = (torch.nextafter(rounded, torch.tensor(float("inf"))) - rounded).double()
    return (got.double() - exact).abs() / spacing


def gelu_gates(n: int, seed: int) -> torch.Tensor:
    """Gates over the whole range: normal ones, a dense sweep of [-12, 12], exp's ends and
    beyond (|x| 1e4, 1e30), zeros, infinities."""
    g = torch.Generator().manual_seed(seed)
    sweep = torch.linspace(-12, 12, n)
    special = torch.tensor([0.0, -0.0, 1e4, -1e4, 1e30, -1e30, float("inf"), -9.9, 9.9])
    return torch.cat((torch.randn(n, generator=g) * 4, sweep, special))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 45])
def test_gelu_tanh_mul_float32_within_4_ulp(isa, threads, rows, width):
    """float32 against the float64 function: the activation within 4 ulp (measured: 3.8 on the
    AVX-512 loops, which compute exp as float32; 0.5 on the scalar ones, which round double's)
    down to x = −9.9, where gelu is 1e-37; the product with up rounded once more. torch's own
    float32 op is within 3.1 ulp for x ≥ −1 and off by up to |x|·2^-24 (all digits, below −4)
    under it: the kernel is as close to torch as that."""
    g = torch.Generator().manual_seed(rows * width)
    gates = gelu_gates(rows * width, rows + width)[: rows * width].view(rows, width)
    up = torch.randn(rows, width, generator=g)
    gate_up = torch.cat((gates, up), 1)
    ones = torch.cat((gates, torch.ones_like(up)), 1)
    act = run_kernel(layer_ops.gelu_tanh_mul, ones)
    exact = gelu_tanh_exact(gates)
    measurable = exact.abs() > 1e-36
    assert ulps(act, exact)[measurable].max() <= 4.0
    assert (act[~measurable].abs() <= 1e-36).all()
    out = run_kernel(layer_ops.gelu_tanh_mul, gate_up)
    assert torch.equal(out, act * up)  # one rounding: the product
    reference = F.gelu(gates, approximate="tanh")
    torch_error = (reference.double() - exact).abs()
    assert ((act.double() - reference.double()).abs()
            <= 4 * torch_error + 5e-7 * exact.abs() + 1e-36).all()  # fmt: skip
    assert (torch_error <= gates.double().abs() * 2**-24 + 4e-7 * exact.abs()).all()


def test_gelu_tanh_mul_special_values(isa):
    gates = torch.tensor([0.0, -0.0, 1e4, -1e4, 1e30, -1e30, float("inf"), float("nan"), -20.0])
    act = run_kernel(layer_ops.gelu_tanh_mul, torch.cat((gates, torch.ones(9)))[None])[0]
    assert torch.equal(act[:7], torch.tensor([0.0, 0.0, 1e4, 0.0, 1e30, 0.0, float("inf")]))
    assert act[7].isnan() and act[8] == 0


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 45])
def test_gelu_tanh_mul_bfloat16_is_torchs(isa, threads, rows, width):
    """bf16: F.gelu(gate, approximate="tanh") * up, bit for bit, wherever the bf16 rounding of the
    activation is determined: every value within both float32 results' error bounds (the
    kernel's 4 ulp, torch's 4 ulp + |x|·2^-24) rounds to the same bf16: all but ~1 in 1000
    from x = −2 up; further down torch's cancellation error nears and then exceeds a bf16 step."""
    g = torch.Generator().manual_seed(rows + 3 * width)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 3).to(torch.bfloat16)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, -30.0, 30.0, -5.0, 1e30])  # width ≥ 6
    gate, up = gate_up.chunk(2, dim=-1)
    got = run_kernel(layer_ops.gelu_tanh_mul, gate_up)
    expected = F.gelu(gate, approximate="tanh") * up
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    exact = gelu_tanh_exact(gate)
    bound = 8 * exact.abs() * 2**-24 + gate.double().abs() * 2**-24 + 1e-37
    determined = (exact - bound).float().bfloat16() == (exact + bound).float().bfloat16()
    determined |= gate == 0
    accurate = gate > -2  # where torch's error is below a bf16 step by 2^-9 or more
    assert (~determined[accurate]).sum() <= max(1, accurate.sum() // 200)
    assert torch.equal(got[determined], expected[determined])
    # elsewhere the activation is one bf16 step from torch's, or within torch's error bound
    act = run_kernel(layer_ops.gelu_tanh_mul, torch.cat((gate, torch.ones_like(up)), 1))
    step = F.gelu(gate, approximate="tanh").float() - act.float()
    assert (step.abs() <= act.float().abs() * 2**-7 + gate.float().abs() * 2**-23 + 1e-37).all()


def test_gated_activation_dispatches_and_falls_back():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2 * 40, generator=g)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(run_kernel(layer_ops.gated_activation, x, "silu"),
                       run_kernel(layer_ops.silu_mul, x))  # fmt: skip
    assert torch.equal(run_kernel(layer_ops.gated_activation, x, "gelu_tanh"),
                       run_kernel(layer_ops.gelu_tanh_mul, x))  # fmt: skip
    assert "gelu_tanh" in KERNELS.GATED_ACTIVATIONS
    # torch where the kernel does not apply (float16); 3-D inputs keep their shape
    half = x.half()
    torch.testing.assert_close(run_kernel(layer_ops.gelu_tanh_mul, half),
                               F.gelu(half[:, :40], approximate="tanh") * half[:, 40:])  # fmt: skip
    batched = torch.randn(2, 3, 2 * 16)
    assert run_kernel(layer_ops.gelu_tanh_mul, batched).shape == (2, 3, 16)
    assert run_kernel(layer_ops.gelu_tanh_mul, torch.empty(0, 64)).shape == (0, 32)
    with pytest.raises(ValueError, match="activation"):
        layer_ops.gated_activation(x, "relu")
    torch.testing.assert_close(run_kernel(layer_ops.gated_activation, x, "gelu_tanh"),
                               F.gelu(gate, approximate="tanh") * up)  # fmt: skip


# ------------------------------------------------------------------ gpt-oss's clamped SwiGLU

ALPHA, LIMIT = 1.702, 7.0


def clamped_swiglu_exact(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """transformers' GptOssExperts._apply_gate with its float32 clamps, u + 1 and g · alpha (exact
    in float32 or rounded once, as torch's ops round them) and the rest in float64: the sigmoid
    exact, where torch's and the kernel's each err by an ulp or two."""
    g, u = gate.clamp(max=LIMIT), up.clamp(min=-LIMIT, max=LIMIT)
    z = (g * ALPHA).double()
    return (u + 1).double() * (g.double() * torch.sigmoid(z))


def swiglu_inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gates and ups over the whole range: normal ones, sweeps across ±limit (up: ±9) and down
    to −60 (sigmoid(alpha·g) ~1e-44), the float32 neighbours of ±limit, large negatives."""
    gen = torch.Generator().manual_seed(seed)
    limit = torch.tensor(LIMIT)
    beside = [torch.nextafter(limit, limit + 1), torch.nextafter(limit, limit - 1)]
    edges = torch.stack([limit, *beside, -limit, -beside[0], -beside[1]])
    gate = torch.cat((torch.randn(n, generator=gen) * 4, torch.linspace(-12, 12, n),
                      torch.linspace(-60, -40, n), edges))  # fmt: skip
    up = torch.cat((torch.randn(n, generator=gen) * 4, torch.linspace(-9, 9, n),
                    torch.randn(n, generator=gen), edges.flip(0)))  # fmt: skip
    return gate, up


@pytest.mark.parametrize("rows", [1, 3, 129])
@pytest.mark.parametrize("width", [1536, 45])
def test_clamped_swiglu_float32_is_the_torch_formula_within_4_ulp(isa, threads, rows, width):
    """float32 against transformers' formula with an exact sigmoid: within 4 ulp wherever the
    result is above 1e-30 (measured: 3.1 on the AVX-512 loops, whose exp is a float32
    polynomial; 2.5 on the scalar ones; torch's own ops 2.8), and torch's ops within the same
    bound; where alpha·g ≤ −87 the kernel gives 0 (torch: 0 or up to ~1e-36)."""
    gate, up = swiglu_inputs(rows * width, rows + width)
    gate, up = gate[: rows * width].view(rows, width), up[: rows * width].view(rows, width)
    out = run_kernel(layer_ops.clamped_swiglu_mul, torch.cat((gate, up), 1), ALPHA, LIMIT)
    exact = clamped_swiglu_exact(gate, up)
    reference = clamped_swiglu(gate, up, ALPHA, LIMIT)
    measurable = exact.abs() > 1e-30
    assert ulps(out, exact)[measurable].max() <= 4.0
    assert ulps(reference, exact)[measurable].max() <= 4.0
    assert (out[~measurable].abs() <= 1e-30).all()
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-30)


def test_clamped_swiglu_edges(isa):
    """The clamps as torch's: a gate past the limit (inf too) is the limit, an up past ±limit is
    ±limit, bit for bit; up = −1 gives ±0; very negative gates give −0 as torch's ops do; a NaN
    gate or up stays NaN (clamp keeps it), and a gate of −inf is NaN (−inf · 0), as in torch."""
    limit = torch.tensor(LIMIT)
    past = torch.nextafter(limit, limit + 1)

    def act(gate, up):
        gate_up = torch.cat((torch.tensor(gate), torch.tensor(up)))[None]
        return run_kernel(layer_ops.clamped_swiglu_mul, gate_up, ALPHA, LIMIT)[0]

    gates = [LIMIT, past.item(), 8.0, 1e30, float("inf")]
    at_limit = act(gates, [0.5] * 5)
    assert (at_limit == at_limit[0]).all() and at_limit[0] > 0
    ups = [LIMIT, past.item(), 1e30, float("inf"), -LIMIT, -past.item(), -1e30, -float("inf")]
    out = act([1.5] * 8, ups)
    assert (out[:4] == out[0]).all() and (out[4:] == out[4]).all()
    torch.testing.assert_close(out[0] / out[4], torch.tensor((LIMIT + 1) / (1 - LIMIT)))
    large, ups = [-60.0, -1e4, -1e30, 3.0, -2.0], [2.0, 2.0, 2.0, -1.0, -1.0]
    got = act(large, ups)
    want = clamped_swiglu(torch.tensor(large), torch.tensor(ups), ALPHA, LIMIT)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    nan = act([float("nan"), 1.0, -float("inf")], [1.0, float("nan"), 1.0])
    assert nan.isnan().all()


@pytest.mark.parametrize("rows", [1, 3, 129])
@pytest.mark.parametrize("width", [1536, 45])
def test_clamped_swiglu_bfloat16_is_torchs(isa, threads, rows, width):
    """bf16: each op rounded to bf16 as torch's bf16 ops round it, so the result is torch's bit
    for bit but where the two float32 sigmoids (a few ulps apart) round to different bf16
    values: at most 1 element in 1000, each one bf16 step of the sigmoid away."""
    gen = torch.Generator().manual_seed(rows + 5 * width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 5).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([LIMIT, 8.0, -60.0, 0.0])  # width ≥ 4
    gate_up[0, width : width + 4] = torch.tensor([-LIMIT, 9.0, 2.0, -1.0])
    gate, up = gate_up.chunk(2, dim=-1)
    got = run_kernel(layer_ops.clamped_swiglu_mul, gate_up, ALPHA, LIMIT)
    expected = clamped_swiglu(gate, up, ALPHA, LIMIT)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    differ = got != expected
    assert differ.sum() <= max(1, got.numel() // 1000)
    torch.testing.assert_close(got[differ].float(), expected[differ].float(), rtol=2**-6, atol=0)


def test_clamped_swiglu_dispatch_and_arguments():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2 * 40, generator=gen) * 4
    gate, up = x.chunk(2, dim=-1)
    assert "clamped_swiglu" in KERNELS.GATED_ACTIVATIONS
    fused = run_kernel(layer_ops.clamped_swiglu_mul, x, ALPHA, LIMIT)
    dispatched = run_kernel(
        layer_ops.gated_activation, x, "clamped_swiglu", alpha=ALPHA, limit=LIMIT
    )
    assert torch.equal(fused, dispatched)
    # another alpha and limit reach the kernel
    other = run_kernel(layer_ops.clamped_swiglu_mul, x, 1.0, 2.5)
    torch.testing.assert_close(other, clamped_swiglu(gate, up, 1.0, 2.5))
    # torch where the kernel does not apply (float16); 3-D inputs keep their shape
    half = x.half()
    torch.testing.assert_close(
        run_kernel(layer_ops.clamped_swiglu_mul, half, ALPHA, LIMIT),
        clamped_swiglu(half[:, :40], half[:, 40:], ALPHA, LIMIT),
    )
    batched = torch.randn(2, 3, 2 * 16)
    assert run_kernel(layer_ops.clamped_swiglu_mul, batched, ALPHA, LIMIT).shape == (2, 3, 16)
    for alpha, limit in ((ALPHA, 0.0), (float("nan"), LIMIT), (ALPHA, float("inf"))):
        with pytest.raises(ValueError, match="clamped SwiGLU"):
            layer_ops.clamped_swiglu_mul(x, alpha, limit)
    with pytest.raises(ValueError, match="limit must be finite"):
        out = torch.empty(3, 40)
        KERNELS.clamped_swiglu_mul(0, x.data_ptr(), 80, 3, 40, out.data_ptr(), 40, ALPHA, -1.0)


# ------------------------------------------------------------------ rope + KV: q/k norm, partial


def rope_tables(rows: int, rotary: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [rows, 1, rotary] for scattered positions, as RotaryTable.cos_sin."""
    g = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
    freqs = torch.randint(0, 4000, (rows,), generator=g).float()[:, None] * inv_freq
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None, :]
    return cos, torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None, :]


def torch_rope_write(qkv, cos, signed_sin, slots, cache, heads, kv_heads, norms, eps):
    """The torch path: F.rms_norm per head (Qwen3's q_norm / k_norm), rope.apply_rope (partial
    where cos is narrower than a head), PagedKVCache.write. Returns the rotated q."""
    from pyserve.worker.rope import apply_rope

    rows, dim = qkv.shape[0], cache.head_dim
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    if norms is not None:
        q, k = (F.rms_norm(x, (dim,), w, eps) for x, w in zip((q, k), norms, strict=True))
    q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
    cache.write(0, slots, k, v)
    return q


ROPE_SHAPES = [(9, 3, 64), (4, 4, 128), (3, 1, 40)]


def rotary_dims_for(dim: int) -> list[int]:
    return [dim // 2, dim // 4 * 2 - 2, 2] if dim > 40 else [dim // 2, 18, 2]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rope_write_kv_partial_rotary_is_torchs_bit_for_bit(isa, threads, cache_dtype, rows, shape):
    """Only a head's first rotary_dim dims rotate (rotate-half within them), the rest pass
    through: q and the cache exactly as rope.apply_rope's partial rotary and PagedKVCache.write
    leave them."""
    heads, kv_heads, dim = shape
    for rotary in rotary_dims_for(dim):
        qkv, _, _, slots, cache = rope_case(rows, heads, kv_heads, dim, cache_dtype, rows)
        _, _, _, _, expected = rope_case(rows, heads, kv_heads, dim, cache_dtype, rows)
        cos, signed_sin = rope_tables(rows, rotary, rows + rotary)
        q = torch_rope_write(qkv, cos, signed_sin, slots, expected, heads, kv_heads, None, 0.0)
        done = run_kernel(layer_ops.rope_write_kv, qkv, cos, signed_sin, slots, cache.k[0],
                          cache.v[0], num_heads=heads, num_kv_heads=kv_heads)  # fmt: skip
        assert done
        assert torch.equal(qkv[:, : heads * dim].view(rows, heads, dim), q), f"{rotary=}"
        assert torch.equal(cache.k[0], expected.k[0]) and torch.equal(cache.v[0], expected.v[0])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rope_write_kv_with_qk_norm_matches_torch(isa, threads, cache_dtype, rows, shape):
    """Each q and k head RMS-normalized (float32, F.rms_norm per head) before the rotation, full
    and partial rotary: within float32 rounding of the torch path (the norm's sum of squares is
    added in another order), the cache within one step of its dtype where that rounding moves a
    value across a rounding edge (rarely); v untouched."""
    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(rows + dim)
    norms = tuple(torch.randn(dim, generator=g) * 0.5 + 1 for _ in range(2))
    step = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}[cache_dtype]
    for rotary in (dim, dim // 2):
        qkv, _, _, slots, cache = rope_case(rows, heads, kv_heads, dim, cache_dtype, rows)
        _, _, _, _, expected = rope_case(rows, heads, kv_heads, dim, cache_dtype, rows)
        cos, signed_sin = rope_tables(rows, rotary, rows)
        v = qkv[:, (heads + kv_heads) * dim :].clone()
        q = torch_rope_write(qkv, cos, signed_sin, slots, expected, heads, kv_heads, norms, 1e-6)
        done = run_kernel(layer_ops.rope_write_kv, qkv, cos, signed_sin, slots, cache.k[0],
                          cache.v[0], num_heads=heads, num_kv_heads=kv_heads, q_norm=norms[0],
                          k_norm=norms[1], eps=1e-6)  # fmt: skip
        assert done
        got_q = qkv[:, : heads * dim].view(rows, heads, dim)
        torch.testing.assert_close(got_q, q, rtol=1e-6, atol=2e-6)
        assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v)
        for got, want in ((cache.k[0], expected.k[0]), (cache.v[0], expected.v[0])):
            got, want = got.float(), want.float()
            assert ((got - want).abs() <= want.abs() * (step * 2 + 1e-6) + 2e-6).all()
            if step:  # a float32 difference of an ulp or two seldom changes a rounded value
                written = want != 0
                assert (got != want)[written].sum() <= 1 + written.sum() // 500
        assert torch.equal(cache.v[0], expected.v[0])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rope_write_kv_with_an_exact_norm_is_torchs_bit_for_bit(isa, cache_dtype, shape):
    """Heads of ±2^e (e per head) and eps 0: mean(x²) = 4^e and its rsqrt 2^-e are exact in any
    order, so the normalized heads are ±w exactly on both paths and everything after (the
    rotation, full and partial, and the cache) must match bit for bit."""
    heads, kv_heads, dim = shape
    rows = 33
    g = torch.Generator().manual_seed(dim)
    norms = tuple(torch.randn(dim, generator=g) for _ in range(2))
    for rotary in (dim, dim // 2):
        qkv, _, _, slots, cache = rope_case(rows, heads, kv_heads, dim, cache_dtype, 7)
        _, _, _, _, expected = rope_case(rows, heads, kv_heads, dim, cache_dtype, 7)
        qk = qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim)
        exponents = torch.randint(-6, 7, (rows, heads + kv_heads, 1), generator=g).float()
        signs = torch.randint(0, 2, qk.shape, generator=g).float() * 2 - 1
        qk.copy_(signs * 2**exponents)
        cos, signed_sin = rope_tables(rows, rotary, 3)
        q = torch_rope_write(qkv, cos, signed_sin, slots, expected, heads, kv_heads, norms, 0.0)
        assert run_kernel(layer_ops.rope_write_kv, qkv, cos, signed_sin, slots, cache.k[0],
                          cache.v[0], num_heads=heads, num_kv_heads=kv_heads, q_norm=norms[0],
                          k_norm=norms[1], eps=0.0)  # fmt: skip
        assert torch.equal(qkv[:, : heads * dim].view(rows, heads, dim), q)
        assert torch.equal(cache.k[0], expected.k[0]) and torch.equal(cache.v[0], expected.v[0])


def test_rope_write_kv_norm_of_q_or_k_alone():
    """q_norm without k_norm (and back): only those heads are normalized."""
    heads, kv_heads, dim, rows = 4, 2, 64, 5
    w = torch.randn(dim, generator=torch.Generator().manual_seed(1))
    for which in (0, 1):
        qkv, cos, signed_sin, slots, cache = rope_case(rows, heads, kv_heads, dim, torch.float32, 2)
        _, _, _, _, expected = rope_case(rows, heads, kv_heads, dim, torch.float32, 2)
        q = qkv[:, : heads * dim].view(rows, heads, dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
        if which == 0:
            q_ref, k_ref = F.rms_norm(q, (dim,), w, 1e-5), k
        else:
            q_ref, k_ref = q, F.rms_norm(k, (dim,), w, 1e-5)
        from pyserve.worker.rope import apply_rope

        q_ref, k_ref = apply_rope(q_ref, cos, signed_sin), apply_rope(k_ref, cos, signed_sin)
        expected.write(0, slots, k_ref, qkv[:, (heads + kv_heads) * dim :].view(rows, -1, dim))
        kw = {"q_norm" if which == 0 else "k_norm": w}
        assert run_kernel(layer_ops.rope_write_kv, qkv, cos, signed_sin, slots, cache.k[0],
                          cache.v[0], num_heads=heads, num_kv_heads=kv_heads, eps=1e-5,
                          **kw)  # fmt: skip
        torch.testing.assert_close(qkv[:, : heads * dim].view(rows, heads, dim), q_ref,
                                   rtol=1e-6, atol=2e-6)  # fmt: skip
        torch.testing.assert_close(cache.k[0], expected.k[0], rtol=1e-6, atol=2e-6)


def test_rope_write_kv_checks_norms_and_rotary_dim():
    qkv, cos, signed_sin, slots, cache = rope_case(8, 9, 3, 64, torch.float16, 1)
    w = torch.ones(64)

    def call(**changes):
        args = dict(cos=cos, signed_sin=signed_sin, num_heads=9, num_kv_heads=3)
        args.update(changes)
        return run_kernel(layer_ops.rope_write_kv, qkv, args.pop("cos"), args.pop("signed_sin"),
                          slots, cache.k[0], cache.v[0], **args)  # fmt: skip

    assert call(q_norm=w, k_norm=w)
    assert not call(q_norm=w.double(), k_norm=w.double())  # not the kernel's: torch's ops
    for what, changes in {
        "norm length": dict(q_norm=torch.ones(32), k_norm=w),
        "odd rotary": dict(cos=cos[..., :31], signed_sin=signed_sin[..., :31]),
        "rotary wider than a head": dict(cos=torch.cat((cos, cos), -1),
                                         signed_sin=torch.cat((signed_sin, signed_sin), -1)),
        "sin narrower than cos": dict(signed_sin=signed_sin[..., :32].contiguous()),
        "negative eps": dict(q_norm=w, k_norm=w, eps=-1.0),
        "nan eps": dict(q_norm=w, k_norm=w, eps=float("nan")),
    }.items():  # fmt: skip
        with pytest.raises(ValueError):
            call(**changes)
            pytest.fail(what)
    with pytest.raises(ValueError, match="rotary_dim"):  # the C++ checks too
        KERNELS.rope_write_kv(qkv.data_ptr(), qkv.shape[1], 8, 9, 3, 64, cos.data_ptr(),
                              signed_sin.data_ptr(), slots.data_ptr(), cache.k[0].data_ptr(),
                              cache.v[0].data_ptr(), 2, cache.num_blocks, cache.block_size,
                              rotary_dim=66)  # fmt: skip
    assert set(KERNELS.ROPE_FEATURES) == {"qk_norm", "partial", "int8_q8_0"}

"""pyserve._kernels and pyserve.worker.quant: the quantized matmul against float references.

Two kinds of reference:
- exact: the kernel computes Σ_g s·(d·Σu·q + m·Σq) from the packed integers (u, d, m) and the
  quantized activations (q, s); recomputed here in float64, the only difference left is float32
  rounding, so any indexing or packing mistake shows up as a large error;
- float: against x @ wᵀ with the original float weights, within the bound that the two roundings
  imply, |Δ| ≤ Σ_k |x_k|·|w_k − w'_k| + |x_k − x'_k|·|w'_k|, with |w − w'| ≤ d/2 and
  |x − x'| ≤ s/2 checked on their own.
Every instruction set this CPU supports is tested (the scalar path always is).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from pyserve.worker import quant
from pyserve.worker.backends.cpu import quant_linear
from pyserve.worker.env import KERNELS_ISA

torch.set_num_threads(2)
KERNELS = quant.kernels()
MIN_EXPONENT = -100  # qgemm.h's kMinExponent
BEST_ISA = KERNELS.isa()
ISAS = KERNELS.supported_isas()

# (rows, n, k): odd sizes, partial tiles (n % 16) and partial groups (k % 32), M past the
# kernels' 4/8/16-row blocks and the AVX-512 path's 8-row panels (19: a 16-row pass and 3 rows
# of a third panel; 40: two passes and half of one), and one layer-sized shape.
SHAPES = [
    (1, 1, 32), (1, 37, 45), (2, 17, 33), (5, 100, 97), (8, 33, 200), (13, 50, 70),
    (19, 21, 70), (40, 33, 100),
]  # fmt: skip
BIG_SHAPE = (3, 960, 576)


def random_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows on different scales and a few outliers, as trained weights have
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    w[torch.rand(n, k, generator=g) < 0.01] *= 8
    return w


def random_input(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(rows, k, generator=g)
    x[:, :: max(1, k // 5)] *= 10  # outlier channels
    return x


def headroom(weight_bits: int, activation_bits: int, group: int) -> int:
    """How many bits the largest possible |Σu·q| of a group can shift left inside int32 (6-bit
    Q6_K weights: of |Σ(u − 32)·q| over the 16 inputs one scale covers)."""
    top = 2 ** (activation_bits - 1) - 1
    most = 32 * top * 16 if weight_bits == 6 else (2**weight_bits - 1) * top * group
    return max(h for h in range(32) if most << h <= 2**31 - 1)


def reference_activations(x: torch.Tensor, group: int, bits: int, weight_bits: int = 4):
    """What the kernel quantizes activations to: q (ties to even) and s per group. int8:
    s = max|x|/127 (float32 math). int16: s = 2^e, e the smallest exponent with
    max|x|·2^−e ≤ 32767, raised to at least (the row's largest e) − headroom; every product is
    then by a power of two, so exact."""
    rows, k = x.shape
    k_pad = -(-k // group) * group
    top = 127.0 if bits == 8 else 32767.0
    padded = torch.cat([x, x.new_zeros(rows, k_pad - k)], 1).view(rows, -1, group)
    amax = padded.abs().amax(-1)
    if bits == 8:
        scale = amax / top
        # tensor / tensor: a Python number over a tensor is computed as reciprocal × number
        inverse = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
        q = torch.round(padded * inverse[..., None]).clamp(-top, top)
        return q.view(rows, k_pad), scale
    e = torch.frexp(amax / top).exponent
    e = torch.where(torch.ldexp(amax, -e) > top, e + 1, e)
    e = torch.where(torch.ldexp(amax, 1 - e) <= top, e - 1, e)
    e = torch.where(amax > 0, e, MIN_EXPONENT).clamp(min=MIN_EXPONENT)
    unit = e.amax(-1, keepdim=True) - headroom(weight_bits, bits, group)
    e = torch.maximum(e, unit)
    scale = torch.ldexp(torch.ones_like(amax), e)
    q = torch.round(torch.ldexp(padded, -e[..., None])).clamp(-top, top)
    return q.view(rows, k_pad), scale


def kernel_activations(x: torch.Tensor, group: int, bits: int, weight_bits: int = 4):
    rows, k = x.shape
    groups = -(-k // group)
    q = torch.empty(rows, groups * group, dtype=torch.int8 if bits == 8 else torch.int16)
    scale = torch.empty(rows, groups)
    total = torch.empty(rows, groups, dtype=torch.int32)
    KERNELS.quantize_activations(
        x.data_ptr(), k, rows, k, group, bits, weight_bits, q.data_ptr(), scale.data_ptr(),
        total.data_ptr(),
    )  # fmt: skip
    return q, scale, total


def exact_reference(x, packed, activation_bits, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 Σ_g s·(d·Σu·q + m·Σq) (+ bias), and Σ_g of the terms' magnitudes for a tolerance."""
    q, scale = reference_activations(x, packed.group, activation_bits, packed.bits)
    u, d, m = quant.unpack_weight(packed)
    rows, n = x.shape[0], packed.n
    per = 16 if packed.bits == 6 else packed.group  # inputs a weight scale covers
    q = q.double().view(rows, -1, per)  # [rows, groups, group]
    u = u[:n].double().view(n, -1, per)  # [n, groups, group]
    d, m = d[:n].double(), m[:n].double()
    s = scale.double().repeat_interleave(packed.group // per, dim=1)
    dots = torch.einsum("rgi,ngi->rng", q, u)
    term_d = s[:, None, :] * d[None] * dots
    term_m = s[:, None, :] * m[None] * q.sum(-1)[:, None, :]
    out = (term_d + term_m).sum(-1)
    if bias is not None:
        out = out + bias.double()
    return out, (term_d.abs() + term_m.abs()).sum(-1)


def assert_formula(x, packed, activation_bits, bias=None, where: object = None) -> torch.Tensor:
    """The kernels' x @ Wᵀ (+ bias), checked against exact_reference within float32 rounding;
    returns it."""
    got = quant_linear.quantized_matmul(x, packed, bias, activation_bits=activation_bits)
    want, magnitude = exact_reference(x, packed, activation_bits, bias)
    error = (got.double() - want).abs()
    assert (error <= 2e-6 * magnitude + 1e-6).all(), (where, error.max().item())
    return got


@pytest.mark.parametrize("weight_bits", [4, 8])
@pytest.mark.parametrize("bits", [8, 16])
def test_activation_quantization_is_exactly_the_reference(isa, bits, weight_bits):
    # k = 1100: 35 groups, the AVX-512 quantizer's panels of 16 groups twice and a partial third
    for rows, _, k in [*SHAPES, BIG_SHAPE, (3, 1, 1100)]:
        x = random_input(rows, k, seed=k)
        x[0, : min(k, 32)] = 0  # an all-zero group: q 0
        if k > 64:
            x[-1, 32:64] *= 1e-4  # a group far below its row's largest: its scale is raised
        if k > 1056:
            x[1, 1024:1056] = 0  # in the third panel
        q, scale, total = kernel_activations(x, quant.GROUP, bits, weight_bits)
        ref_q, ref_scale = reference_activations(x, quant.GROUP, bits, weight_bits)
        assert torch.equal(q.float(), ref_q)
        assert torch.equal(scale, ref_scale)
        assert torch.equal(total, ref_q.view(rows, -1, quant.GROUP).sum(-1).int())
        if bits == 16:  # powers of two, a group's raised at most to (row's largest) / 2^H
            assert torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))
            ratio = scale.amax(-1, keepdim=True) / scale
            assert (ratio <= 2 ** headroom(weight_bits, bits, quant.GROUP)).all()
        # the rounding bound the float test relies on, |x − s·q| ≤ s/2, in float64; int8 rounds
        # x·(Q/max) to float32 before it rounds to an integer: ≤ Q·2⁻²³ more (int16's is exact)
        scale64 = ref_scale.double()
        x_hat = (ref_q.double().view(rows, -1, quant.GROUP) * scale64[..., None]).view(rows, -1)
        half_step = scale64.repeat_interleave(quant.GROUP, 1)[:, :k] / 2
        assert ((x.double() - x_hat[:, :k]).abs() <= half_step * (1 + 1e-4)).all()


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_largest_dot_product_shifted_by_the_headroom_stays_in_int32(isa, bits, activation_bits):
    """Group 0: every |q| at its top and every weight at its largest code, the row's largest
    exponent; group 1 tiny: group 0's dot product is shifted by the whole headroom."""
    top = 127 if activation_bits == 8 else 32767
    x = torch.full((1, 64), 1e-6)
    x[0, :32] = top * 2.0**-15  # q = top exactly at e = −15
    w = torch.zeros(3, 64)
    w[:, :32] = 1.0  # 8-bit: u = 255; 4-bit: u = 15 (the group's minimum is the 0 below)
    w[:, 0] = 0.0
    w[1, 32:] = 0.5
    w[2] = -w[2]
    packed = quant.quantize_weight(w, bits)
    got = assert_formula(x, packed, activation_bits)
    assert (got[0, :2] > 0).all() and got[0, 2] < 0


def assert_integer_formula(shapes, bits, activation_bits, group=quant.GROUP, biased=True):
    for i, (rows, n, k) in enumerate(shapes):
        packed = quant.quantize_weight(random_weight(n, k, seed=i), bits, group=group)
        x = random_input(rows, k, seed=i)
        bias = torch.randn(n) if biased and i % 2 else None
        assert_formula(x, packed, activation_bits, bias, (rows, n, k))


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("bits", [8, 4])
def test_matmul_is_the_integer_formula(isa, bits, activation_bits):
    assert_integer_formula([*SHAPES, BIG_SHAPE], bits, activation_bits)


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [64, 256])
def test_matmul_with_groups_longer_than_32_is_the_integer_formula(
    isa, bits, activation_bits, group
):
    """Groups of several 32-input blocks: one integer sum and one scale per group."""
    assert_integer_formula([(3, 40, 300), (19, 17, 600)], bits, activation_bits, group, False)


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("bits", [8, 4])
def test_matmul_is_within_the_rounding_bound_of_float(isa, bits, activation_bits):
    for i, (rows, n, k) in enumerate(SHAPES):
        w = random_weight(n, k, seed=i)
        x = random_input(rows, k, seed=i)
        packed = quant.quantize_weight(w, bits)
        w_hat = quant.dequantize_weight(packed)
        _, d, _ = quant.unpack_weight(packed)
        step = d[:n].float().repeat_interleave(quant.GROUP, 1)[:, :k]
        # weight rounding: half a step (fp16 rounding of d can move the extreme value by more;
        # that case is clamped, so allow a sliver)
        assert ((w - w_hat).abs() <= step * 0.5 * (1 + 1e-2) + 1e-7).all()
        q, scale = reference_activations(x, quant.GROUP, activation_bits)
        x_hat = (q.view(rows, -1, quant.GROUP) * scale[..., None]).view(rows, -1)[:, :k]
        bound = x.abs() @ (w - w_hat).abs().T + (x - x_hat).abs() @ w_hat.abs().T
        got = quant_linear.quantized_matmul(x, packed, activation_bits=activation_bits)
        slack = 1e-5 * (x.abs() @ w.abs().T) + 1e-6
        assert ((got - x @ w.T).abs() <= bound + slack).all()


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [100, 1100])
def test_a_nan_or_inf_input_gives_its_row_nan_and_leaves_the_others(isa, bits, activation_bits, k):
    """A non-finite activation shows in its own row's outputs (NaN), never as finite garbage,
    and the other rows are what they are without it (k = 1100: past the first 16 groups)."""
    rows, n = 4, 40
    packed = quant.quantize_weight(random_weight(n, k, seed=3), bits)
    x = random_input(rows, k, seed=3)
    want = quant_linear.quantized_matmul(x, packed, activation_bits=activation_bits)
    x[1, k - 30] = float("nan")  # in the first vector of its group: the next vector max drops it
    x[2, 5] = float("inf")
    got = quant_linear.quantized_matmul(x, packed, activation_bits=activation_bits)
    assert got[1:3].isnan().all()
    assert torch.equal(got[[0, 3]], want[[0, 3]])


# GGML types the kernels read at their own width: bits, and whether with super-block scales
OWN_WIDTH = {"Q4_K": (4, True), "Q5_K": (5, True), "Q6_K": (6, True), "Q5_0": (5, False)}
OWN_WIDTH["Q5_1"] = (5, False)
OWN_WIDTH["MXFP4"] = (4, False)  # its codes and exponents (tests/test_mxfp4.py)


def ggml_weight(type_name: str, n: int, k: int, seed: int) -> quant.PackedWeight:
    """A random weight of ``type_name`` packed at its own width (OWN_WIDTH): K-quants as random
    blocks, the others as gguf-py quantizes a random float weight."""
    import gguf
    from gguf_files import random_blocks

    rng = np.random.default_rng(seed)
    bits, own_scales = OWN_WIDTH[type_name]
    if own_scales:
        blocks = random_blocks(type_name, n, k, rng)
    else:
        weight = rng.normal(0, 0.05, (n, k)).astype(np.float32)
        blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[type_name])
    return quant.pack_ggml_blocks([(type_name, blocks)], n, k, bits, super_scales=own_scales)


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize(
    ("type_name", "bits_a_weight"),
    [
        ("Q4_K", 4.625),
        ("Q5_K", 5.625),
        ("Q6_K", 6.5625),
        ("Q5_0", 6.0),
        ("Q5_1", 6.0),
        ("MXFP4", 4.25),
    ],
)
def test_ggml_types_at_their_own_width_are_the_integer_formula(
    isa, activation_bits, type_name, bits_a_weight
):
    """The K-quants' own scales and the 5- and 6-bit tiles (qgemm.h), against the float64
    formula over the dequantized weights. Q4_K, Q5_K: d = D·sc and m = −Dmin·mn per group, from
    fp16 D, −Dmin per 256 inputs and 8-bit sc, mn. Q6_K: D·sc·(Σu·q − 32·Σq) per 16 inputs,
    from fp16 D and a signed sc per 16. Q5_0, Q5_1: fp16 d, m per 32, 5-bit u from nibbles and a
    plane of high bits. MXFP4: e2m1 codes looked up per nibble, a power of two per 32. Row
    counts through the kernels' 4/8/16-row blocks and 8-row panels,
    partial tiles, a bias on every other shape."""
    shapes = [(1, 1, 256), (2, 37, 512), (5, 100, 256), (19, 33, 768), (40, 17, 256)]
    for i, (rows, n, k) in enumerate([*shapes, (3, 300, 1024)]):
        packed = ggml_weight(type_name, n, k, seed=i)
        assert packed.nbytes * 8 / (-(-n // 16) * 16 * k) == bits_a_weight
        x = random_input(rows, k, seed=i)
        bias = torch.randn(n) if i % 2 else None
        assert_formula(x, packed, activation_bits, bias, (rows, n, k))


@pytest.mark.parametrize("activation_bits", [8, 16])
def test_the_largest_q6_k_sum_shifted_by_the_headroom_stays_in_int32(isa, activation_bits):
    """Every u = 0 (w = −32·D·sc, the largest magnitude) against every |q| at its top in group 0
    and a tiny group 1: group 0's Σ(u − 32)·q is shifted by the whole headroom."""
    top = 127 if activation_bits == 8 else 32767
    blocks = np.zeros((16, 210), dtype=np.uint8)  # one super-block a row: ql = qh = 0
    blocks[:, 192:208] = 1  # sc = 1
    blocks[:, 208:210] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)  # d = 1
    packed = quant.pack_ggml_blocks([("Q6_K", blocks)], 16, 256, 6, super_scales=True)
    x = torch.full((1, 256), 1e-6)
    x[0, :32] = top * 2.0**-15
    got = assert_formula(x, packed, activation_bits)
    assert (got < 0).all()


@pytest.mark.skipif(KERNELS.amx_status() != "", reason=f"no AMX here: {KERNELS.amx_status()}")
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_1", "MXFP4"])
def test_own_widths_stay_off_the_amx_tiles(type_name):
    """The AMX path reads 4- and 8-bit tiles with fp16 group scales only: a K-quant with its own
    scales, or 5- or 6-bit tiles, take the VNNI loops even where int8 activations on many rows
    would go to the tiles."""
    packed = ggml_weight(type_name, 48, 512, seed=3)
    x = random_input(40, 512, seed=3)
    before = KERNELS.amx()
    KERNELS.set_amx(True)
    try:
        got = quant_linear.quantized_matmul(x, packed, activation_bits=8)
    finally:
        KERNELS.set_amx(before)
    want, magnitude = exact_reference(x, packed, 8)
    assert ((got.double() - want).abs() <= 2e-6 * magnitude + 1e-6).all()


def test_super_block_scales_need_q4_k_shapes():
    w = quant.quantize_weight(random_weight(16, 288, seed=1), 4)
    x, out = random_input(1, 288, seed=1), torch.empty(1, 16)
    with pytest.raises(ValueError, match="super-block scales need 4-, 5- or 6-bit weights"):
        KERNELS.matmul(x.data_ptr(), 288, 1, 16, w.data.data_ptr(), w.scales.data_ptr(), 16, 288,
                       4, 32, 0, out.data_ptr(), 16, True)  # fmt: skip
    q6 = ggml_weight("Q6_K", 16, 256, seed=1)
    with pytest.raises(
        ValueError, match=r"6-bit weights \(Q6_K\) come with their super-block scales"
    ):
        KERNELS.matmul(x.data_ptr(), 256, 1, 16, q6.data.data_ptr(), q6.scales.data_ptr(), 16,
                       256, 6, 32, 0, out.data_ptr(), 16, False)  # fmt: skip


def test_the_isas_agree():
    rows, n = 6, 200
    for bits in (8, 6, 5, 4):
        k = 300 if bits in (4, 8) else 512  # Q6_K, Q5_1: whole blocks
        x = random_input(rows, k, seed=7)
        if bits in (5, 6):
            packed = ggml_weight("Q6_K" if bits == 6 else "Q5_1", n, k, 7)
        else:
            packed = quant.quantize_weight(random_weight(n, k, 7), bits)
        results = []
        for name in ISAS:
            KERNELS.set_isa(name)
            results.append(quant_linear.quantized_matmul(x, packed))
        KERNELS.set_isa(BEST_ISA)
        scale = (x.abs() @ quant.dequantize_weight(packed).abs().T).max()
        for other in results[1:]:
            assert (other - results[0]).abs().max() <= 1e-6 * scale


def test_thread_count_does_not_change_a_bit():
    packed = quant.quantize_weight(random_weight(2000, 576, seed=3), 4)  # many tile chunks
    x = random_input(5, 576, seed=3)
    threads = KERNELS.num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            KERNELS.set_num_threads(count)
            results.append(quant_linear.quantized_matmul(x, packed))
    finally:
        KERNELS.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_concurrent_callers_get_their_own_results():
    """The GIL is released inside; calls from two threads queue on the pool, each with its own
    activation buffer."""
    from concurrent.futures import ThreadPoolExecutor

    packed = quant.quantize_weight(random_weight(300, 200, seed=6), 4)
    inputs = [random_input(1 + i % 5, 200, seed=i) for i in range(16)]
    want = [quant_linear.quantized_matmul(x, packed) for x in inputs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda x: quant_linear.quantized_matmul(x, packed), inputs))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_strided_input_and_given_output():
    packed = quant.quantize_weight(random_weight(40, 64, seed=5), 8)
    wide = random_input(4, 100, seed=5)
    x = wide[:, 10:74]  # row stride 100, unit column stride: passed without a copy
    out = torch.full((4, 40), float("nan"))
    got = quant_linear.quantized_matmul(x, packed, out=out)
    assert got is out
    assert torch.equal(got, quant_linear.quantized_matmul(x.contiguous(), packed))
    transposed = x.contiguous().T.contiguous().T  # column stride ≠ 1: copied first
    assert torch.equal(quant_linear.quantized_matmul(transposed, packed), got)
    assert quant_linear.quantized_matmul(x[:0], packed).shape == (0, 40)


def test_bad_arguments_raise_clear_errors():
    packed = quant.quantize_weight(random_weight(16, 32, seed=1), 8)
    with pytest.raises(ValueError, match="float32"):
        quant_linear.quantized_matmul(torch.randn(1, 32, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="columns"):
        quant_linear.quantized_matmul(torch.randn(1, 31), packed)
    with pytest.raises(ValueError, match="bias"):
        quant_linear.quantized_matmul(torch.randn(1, 32), packed, torch.randn(15))
    with pytest.raises(ValueError, match="bits"):
        quant.quantize_weight(torch.randn(4, 32), 3)
    with pytest.raises(ValueError, match="group"):
        quant.quantize_weight(torch.randn(4, 32), 8, group=48)
    with pytest.raises(ValueError, match="inf or nan"):
        quant.quantize_weight(torch.tensor([[float("inf")] * 32]), 8)
    x, out = torch.randn(1, 32), torch.empty(1, 16)
    with pytest.raises(ValueError, match="activation bits"):  # the C++ side checks too
        KERNELS.matmul(
            x.data_ptr(), 32, 1, 12, packed.data.data_ptr(), packed.scales.data_ptr(),
            16, 32, 8, 32, 0, out.data_ptr(), 16,
        )  # fmt: skip
    with pytest.raises(ValueError, match="unknown ISA"):
        KERNELS.set_isa("sse9")
    assert KERNELS.isa() == BEST_ISA


def test_isa_environment_variable_forces_the_fallback():
    code = (
        "import torch\n"
        "from pyserve.worker import quant\n"
        "from pyserve.worker.backends.cpu import quant_linear\n"
        "k = quant.kernels()\n"
        "p = quant.quantize_weight(torch.ones(20, 40), 4)\n"
        "y = quant_linear.quantized_matmul(torch.ones(2, 40), p)\n"
        "print(k.isa(), float(y.sum()))\n"
    )
    env = {**os.environ, KERNELS_ISA: "scalar"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    isa, total = done.stdout.split()
    assert isa == "scalar" and float(total) == pytest.approx(2 * 20 * 40, rel=1e-6)
    env[KERNELS_ISA] = "sse9"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "PYSERVE_KERNELS_ISA='sse9'" in done.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_working_pool():
    packed = quant.quantize_weight(random_weight(500, 64, seed=2), 8)
    x, out = random_input(2, 64, seed=2), torch.zeros(2, 500)
    want = quant_linear.quantized_matmul(x, packed)  # the parent's pool exists before the fork
    pid = os.fork()
    if pid == 0:  # child: no torch ops, just the kernel on memory the parent set up
        try:
            KERNELS.matmul(
                x.data_ptr(), 64, 2, 16, packed.data.data_ptr(), packed.scales.data_ptr(),
                500, 64, 8, 32, 0, out.data_ptr(), 500,
            )  # fmt: skip
            os._exit(0 if torch.equal(out, want) else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the kernel hung in a forked child")


def test_gguf_weights_quantize_back_to_themselves():
    """The default model's Q4_1 layers and Q8_0 embedding are already on our grids."""
    from gguf import GGUFReader, dequantize

    from pyserve.model_files import default_model_path

    reader = GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    for name, bits in [("blk.0.attn_q.weight", 4), ("blk.3.ffn_down.weight", 4),
                       ("token_embd.weight", 8)]:  # fmt: skip
        t = tensors[name]
        rows = t.data[:2048]  # quantized rows: [rows, bytes]; the whole matrix is slower
        k = int(t.shape[0])
        w = torch.from_numpy(dequantize(rows, t.tensor_type).reshape(-1, k).copy())
        assert torch.equal(quant.dequantize_weight(quant.quantize_weight(w, bits)), w), name


def test_quant_linear_uses_the_kernel_for_small_batches_and_torch_beyond():
    w, bias = random_weight(70, 96, seed=4), torch.randn(70)
    layer = quant_linear.QuantLinear(w, bias, 8, max_kernel_rows=4)
    w_hat = quant.dequantize_weight(layer.packed)
    assert torch.equal(layer.weight, w_hat)
    small, large = random_input(4, 96, seed=4), random_input(9, 96, seed=4)
    want_small = quant_linear.quantized_matmul(small, layer.packed, bias)
    assert torch.equal(layer(small), want_small)
    assert torch.allclose(layer(large), large @ w_hat.T + bias, atol=1e-5)
    # leading dimensions and bfloat16 pass through
    x3 = small.view(2, 2, 96).bfloat16()
    y3 = layer(x3)
    assert y3.shape == (2, 2, 70) and y3.dtype == torch.bfloat16
    want_bf16 = quant_linear.quantized_matmul(x3.float().view(4, 96), layer.packed, bias)
    assert torch.equal(y3.view(4, 70), want_bf16.bfloat16())
    assert layer.max_kernel_rows == 4
    assert (
        quant_linear.QuantLinear(w, None, 4).max_kernel_rows
        == quant_linear.MAX_KERNEL_ROWS[torch.float32]
    )
    # float32 default: the kernel at every size, and no float copy of the weights
    unbounded = quant_linear.QuantLinear(w, bias, 8)
    assert unbounded.weight is None and unbounded.max_kernel_rows is None
    assert torch.equal(
        unbounded(large), quant_linear.quantized_matmul(large, unbounded.packed, bias)
    )
    # no rows (a step of unfinished prefill chunks samples none): an empty output, no call
    for empty in (torch.empty(0, 96), torch.empty(2, 0, 96, dtype=torch.bfloat16)):
        out = unbounded(empty)
        assert out.shape == (*empty.shape[:-1], 70) and out.dtype == empty.dtype


def tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
        max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("mode", quant_linear.MODES)
def test_quantize_model_linears_on_a_transformers_llama(mode):
    model = tiny_llama(tied=True)
    embedding = model.model.embed_tokens.weight
    replaced = quant_linear.quantize_model_linears(model, mode)
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert len(replaced) == 2 * len(projections) + 1 and "lm_head" in replaced
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    head = model.lm_head
    assert head.bits == 8  # in both modes
    assert model.model.layers[0].mlp.down_proj.bits == (8 if mode == "int8" else 4)
    # the embedding lookup is untouched; a float32 model keeps no float copy of the packed weights
    assert model.model.embed_tokens.weight is embedding
    assert head.weight is None and head.max_kernel_rows is None

    # against the same model with the dequantized weights in float: only the int16 activation
    # rounding is left, so logits agree closely
    reference = tiny_llama(tied=True)
    with torch.no_grad():
        for name in replaced:
            target = reference.get_submodule(name)
            packed = model.get_submodule(name).packed
            target.weight = nn.Parameter(quant.dequantize_weight(packed))
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    with pytest.raises(ValueError, match="mode"):
        quant_linear.quantize_model_linears(tiny_llama(tied=False), "int3")


def test_quantize_model_linears_takes_the_workers_own_linear():
    from pyserve.worker.linear import Linear

    model = nn.Module()
    model.proj = Linear(64, 40, bias=True, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        model.proj.weight.copy_(random_weight(40, 64, seed=9))
        model.proj.bias.copy_(torch.randn(40))
    x = random_input(3, 64, seed=9)
    want = x @ model.proj.weight.T + model.proj.bias
    assert quant_linear.quantize_model_linears(model, "int8") == ["proj"]
    assert isinstance(model.proj, quant_linear.QuantLinear) and model.proj.bits == 8
    assert (model.proj(x) - want).abs().max() <= 1e-2 * want.abs().max()
    packed = nn.Module()
    packed.proj = Linear(64, 40, bias=False, dtype=torch.float32, device="cpu")
    packed.proj.weight = None  # what Linear.pack() leaves behind
    with pytest.raises(ValueError, match="already packed"):
        quant_linear.quantize_model_linears(packed, "int4")


_BACK_TO_BACK_RUNS = """
import sys, time, torch
from pyserve.worker import quant
from pyserve.worker.backends.cpu.quant_linear import quantized_matmul
quant.kernels().set_num_threads(4)
torch.manual_seed(0)
small = quant.quantize_weight(torch.randn(128, 1024), 8)  # a few chunks
big = quant.quantize_weight(torch.randn(2048, 1024), 8)  # many chunks
x = torch.randn(1, 1024)
want_small, want_big = quantized_matmul(x, small), quantized_matmul(x, big)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(100):
        got_small, got_big = quantized_matmul(x, small), quantized_matmul(x, big)
    assert torch.equal(got_small, want_small) and torch.equal(got_big, want_big)
print("ok")
"""


def test_pool_survives_back_to_back_runs_of_different_sizes():
    """A run with few chunks right before one with many, over and over, with more pool threads
    than cores (so workers get preempted mid-claim): a worker late from the small run must not
    claim a chunk of the big one. Before the fix this hung the worker within seconds here."""
    done = subprocess.run(
        [sys.executable, "-c", _BACK_TO_BACK_RUNS, "6"],
        capture_output=True,
        text=True,
        timeout=300,  # a hang fails the test instead of blocking the suite
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]

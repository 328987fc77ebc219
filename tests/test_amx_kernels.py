"""The AMX path of the quantized matmul (cpp/kernels/qgemm_amx.cpp) and its fallback.

With AMX switched on (``set_amx(True)``, ``PYSERVE_KERNELS_AMX=1``) where the CPU has AMX-INT8 and
Linux grants the tile state, int8 activations from 32 rows on run on AMX tiles; everywhere else the
AVX-512 VNNI loops do. The two compute the same integer sums and the same float operations in the
same order, so their outputs are equal bit for bit. The fallback is tested wherever AVX-512 VNNI
runs: a subprocess asking for AMX in which the tile permission is refused
(``PYSERVE_KERNELS_FAKE_AMX_REFUSAL`` makes the C++ side treat Linux's answer as a refusal), or
with AMX off, must keep working and answer what AMX answers here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_kernels import random_input, random_weight

from pyserve.worker import quant
from pyserve.worker.backends.cpu import quant_linear
from pyserve.worker.env import KERNELS_AMX, KERNELS_ISA

KERNELS = quant.kernels()
HAS_VNNI = "avx512_vnni" in KERNELS.supported_isas()
HAS_AMX = KERNELS.amx_status() == ""
needs_amx = pytest.mark.skipif(not HAS_AMX, reason=f"no AMX here: {KERNELS.amx_status()}")
needs_vnni = pytest.mark.skipif(not HAS_VNNI, reason="the CPU lacks AVX-512 VNNI")


def matmul(x, packed, bias, amx: bool) -> torch.Tensor:
    before = KERNELS.amx()
    KERNELS.set_amx(amx)
    try:
        return quant_linear.quantized_matmul(x, packed, bias, activation_bits=8)
    finally:
        KERNELS.set_amx(before)


# (rows, n, k): rows at and past the 32-row threshold, not multiples of 16 (a last pass of a few
# rows), partial tiles (n % 16), partial groups (k % 32), and a layer-sized shape
SHAPES = [(32, 16, 32), (33, 37, 45), (47, 200, 300), (64, 960, 576), (129, 100, 600),
          (300, 33, 257)]  # fmt: skip


@needs_amx
@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("bits", [4, 8])
def test_amx_equals_the_vnni_int8_path_bit_for_bit(threads, bits, group):
    KERNELS.set_isa("avx512_vnni")
    for i, (rows, n, k) in enumerate(SHAPES):
        packed = quant.quantize_weight(random_weight(n, k, seed=i), bits, group=group)
        x = random_input(rows, k, seed=i)
        bias = torch.randn(n) if i % 2 else None
        got, want = matmul(x, packed, bias, True), matmul(x, packed, bias, False)
        assert torch.equal(got, want), (rows, n, k, (got - want).abs().max().item())


@needs_amx
def test_amx_handles_extreme_activations_and_nan_as_vnni_does():
    packed = quant.quantize_weight(random_weight(70, 200, seed=8), 4)
    x = random_input(40, 200, seed=8)
    x[3, :32] = 0  # an all-zero group
    x[5] *= 1e30
    x[7, 100] = float("nan")
    x[9, 10] = float("inf")
    got, want = matmul(x, packed, None, True), matmul(x, packed, None, False)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got[7].isnan().all() and got[9].isnan().all()


@needs_amx
def test_amx_is_off_until_asked_for():
    before = KERNELS.amx()
    try:
        KERNELS.set_amx(False)
        assert not KERNELS.amx()
        KERNELS.set_amx(True)
        assert KERNELS.amx()
    finally:
        KERNELS.set_amx(before)
    code = "from pyserve.worker import quant; print(quant.kernels().amx())"
    env = {k: v for k, v in os.environ.items() if k != KERNELS_AMX}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


_FALLBACK = """
import sys, torch
from pyserve.worker import quant
from pyserve.worker.backends.cpu import quant_linear
k = quant.kernels()
torch.manual_seed(0)
x = torch.load(sys.argv[1])
packed = quant.PackedWeight(*torch.load(sys.argv[2]))
y = quant_linear.quantized_matmul(x, packed, activation_bits=8)
used = k.amx()
try:
    k.set_amx(True)
    refused = "accepted"
except ValueError as e:
    refused = str(e)
print(k.isa(), used, repr(k.amx_status()), refused, sep="\\n")
torch.save(y, sys.argv[3])
"""


@needs_vnni
@pytest.mark.parametrize(
    "env",
    [{"PYSERVE_KERNELS_FAKE_AMX_REFUSAL": "1", KERNELS_AMX: "1"}, {KERNELS_AMX: "0"}],
    ids=["permission-refused", "switched-off"],
)
def test_without_amx_the_vnni_path_runs_and_answers_the_same(tmp_path, env):
    """llama.cpp's AMX build dies on a VM that advertises AMX; here a refused permission (or the
    switch) must leave a working process on the VNNI loops, with the same outputs."""
    packed = quant.quantize_weight(random_weight(200, 576, seed=4), 4)
    x = random_input(64, 576, seed=4)
    want = matmul(x, packed, None, HAS_AMX)  # AMX here where it runs
    torch.save(x, tmp_path / "x.pt")
    torch.save(
        (packed.data, packed.scales, packed.n, packed.k, packed.bits, packed.group),
        tmp_path / "w.pt",
    )
    env = {**os.environ, **env}
    env.pop(KERNELS_ISA, None)
    done = subprocess.run(
        [sys.executable, "-c", _FALLBACK, *(str(tmp_path / f) for f in ("x.pt", "w.pt", "y.pt"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    isa, amx, status, refused = done.stdout.strip().splitlines()[-4:]
    assert isa == "avx512_vnni" and amx == "False"
    if "PYSERVE_KERNELS_FAKE_AMX_REFUSAL" in env:
        assert status != "''" and ("refused" in status or "lacks" in status), status
        assert refused.startswith("AMX cannot run here"), refused
        assert "PYSERVE_KERNELS_AMX=1, but the AVX-512 VNNI loops run" in done.stderr
    assert torch.equal(torch.load(tmp_path / "y.pt"), want)


def test_the_amx_switch_refuses_bad_values():
    code = "from pyserve.worker import quant; quant.kernels()"
    env = {**os.environ, KERNELS_AMX: "yes"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "PYSERVE_KERNELS_AMX='yes'" in done.stderr
    if not HAS_AMX:
        with pytest.raises(ValueError, match="AMX cannot run here"):
            KERNELS.set_amx(True)

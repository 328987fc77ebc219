"""Weight quantization for small-batch CPU decode: int8 / 4-bit linear layers on `pyserve._kernels`.

Batch-1 decode on a CPU is bound by how fast the weights stream from memory, so storing them in
8 or 4 bits (plus an fp16 scale and offset per group of 32 inputs) cuts the time a token takes.
The kernel quantizes each activation row per group to int8 on the fly (llama.cpp's Q8_1) and
accumulates the integer dot products with AVX-512 VNNI (AVX2 and portable fallbacks exist, see
cpp/kernels/README.md).

Formats (w = d·u + m per group, d and m fp16):
- ``int8``: symmetric, u = q + 128 with q ∈ [−127, 127] and m = −128·d (llama.cpp's Q8_0);
- ``int4``: asymmetric 4-bit, u ∈ [0, 15], d = (max − min)/15, m = min (llama.cpp's Q4_1).
Both match llama.cpp's rounding, so re-quantizing weights that a Q8_0 or Q4_1 GGUF held gives
those exact weights back.

Quantization changes the logits (see benchmarks/RESULTS.md, "Kernels"), so it is opt-in per run;
the float path stays the default. A ``QuantLinear`` keeps the dequantized weights too, in the
model's dtype, for batches larger than ``max_kernel_rows`` (prefill, big decode batches), where
a BLAS matmul is faster than streaming the packed weights again per chunk of rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32  # inputs per quantization group (llama.cpp's block size)
TILE_ROWS = 16  # output rows per packed tile (one AVX-512 register)
MODES = ("int8", "int4")
# Rows up to which the kernel beats a float32 BLAS matmul here (benchmarks/bench_kernels.py).
DEFAULT_MAX_KERNEL_ROWS = 16
ISA_ENV = "PYSERVE_KERNELS_ISA"  # force a kernel path: avx512_vnni, avx2 or scalar


def kernels():
    """The compiled module, set up once: the ISA from PYSERVE_KERNELS_ISA, torch's thread count."""
    global _kernels_module
    if _kernels_module is None:
        from pyserve import _kernels

        isa = os.environ.get(ISA_ENV)
        if isa:
            try:
                _kernels.set_isa(isa)
            except ValueError as e:
                raise ValueError(f"{ISA_ENV}={isa!r}: {e}") from None
        _kernels.set_num_threads(torch.get_num_threads())
        _kernels_module = _kernels
    return _kernels_module


_kernels_module = None


@dataclass(frozen=True)
class PackedWeight:
    """A [n, k] weight in the kernel's layout (cpp/kernels/qgemm.h)."""

    data: torch.Tensor  # uint8 [tiles, groups, group·16·bits/8]
    scales: torch.Tensor  # float16 [tiles, groups, 2, 16]: d of the tile's rows, then m
    n: int
    k: int
    bits: int
    group: int

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, bits: int, group: int = GROUP) -> PackedWeight:
    """Quantizes a float [n, k] weight per group of ``group`` inputs and packs it for the kernel."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if group <= 0 or group % 32:
        raise ValueError(f"group must be a positive multiple of 32, not {group}")
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"expected a non-empty 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    n_pad, k_pad = _ceil_to(n, TILE_ROWS), _ceil_to(k, group)
    w = weight.detach().to("cpu", torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("the weight holds inf or nan")
    # Pad inputs by repeating the last column (it leaves every group's min and max as they were;
    # the kernel pairs padded inputs with zero activations) and outputs with zero rows.
    w = torch.cat([w, w[:, -1:].expand(n, k_pad - k)], dim=1)
    w = torch.cat([w, w.new_zeros(n_pad - n, k_pad)], dim=0)
    groups = w.view(n_pad, k_pad // group, group)
    if bits == 8:
        d = (groups.abs().amax(-1) / 127).half()
        m = d * -128  # exact in fp16 (a power of two)
        q = torch.round(groups / _nonzero(d.float()).unsqueeze(-1)).clamp_(-127, 127)
        u = (q + 128).to(torch.uint8)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        d, m = ((high - low) / 15).half(), low.half()
        u = torch.round((groups - m.float().unsqueeze(-1)) / _nonzero(d.float()).unsqueeze(-1))
        u = u.clamp_(0, 15).to(torch.uint8)
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError("the weight's range overflows the fp16 scales")
    packed = _pack(u.view(n_pad, k_pad), bits, group)
    return PackedWeight(packed, _pack_scales(d, m), n, k, bits, group)


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """d with zeros replaced by one: a group of equal values quantizes to u = 0 (or 128)."""
    return torch.where(d == 0, torch.ones_like(d), d)


def _pack(u: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """[n_pad, k_pad] uint8 → [tiles, groups, bytes]: per group, quads of 4 inputs × 16 rows."""
    n_pad, k_pad = u.shape
    tiles, groups, quads = n_pad // TILE_ROWS, k_pad // group, group // 4
    blocks = u.view(tiles, TILE_ROWS, groups, quads, 4).permute(0, 2, 3, 1, 4)
    blocks = blocks.reshape(tiles, groups, quads, TILE_ROWS * 4)
    if bits == 4:  # quad 2p in the low nibbles, quad 2p+1 in the high nibbles of block p
        pairs = blocks.view(tiles, groups, quads // 2, 2, TILE_ROWS * 4)
        blocks = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)
    return blocks.reshape(tiles, groups, -1).contiguous()


def _pack_scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[n_pad, groups] fp16 d and m → [tiles, groups, 2, 16]."""
    n_pad, groups = d.shape
    both = torch.stack([d, m]).view(2, n_pad // TILE_ROWS, TILE_ROWS, groups)
    return both.permute(1, 3, 0, 2).contiguous()


@torch.no_grad()
def dequantize_weight(packed: PackedWeight) -> torch.Tensor:
    """The float32 [n, k] weight that the packed one stands for (w = d·u + m)."""
    tiles, groups, _ = packed.data.shape
    group, quads = packed.group, packed.group // 4
    blocks = packed.data.view(tiles, groups, -1, TILE_ROWS * 4)
    if packed.bits == 4:
        low, high = blocks & 0x0F, blocks >> 4
        blocks = torch.stack([low, high], dim=3).view(tiles, groups, quads, TILE_ROWS * 4)
    u = blocks.view(tiles, groups, quads, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)
    u = u.reshape(tiles * TILE_ROWS, groups, group).float()
    scales = packed.scales.float().permute(0, 3, 1, 2).reshape(tiles * TILE_ROWS, groups, 2)
    w = scales[..., :1] * u + scales[..., 1:]
    return w.view(tiles * TILE_ROWS, groups * group)[: packed.n, : packed.k].contiguous()


def quantized_matmul(
    x: torch.Tensor,
    packed: PackedWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [rows, n] = x [rows, k] @ Wᵀ (+ bias) through the kernel; x is float32 on the CPU.

    Checks everything the kernel relies on: dtypes, devices, shapes, unit inner strides.
    """
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"x must be a 2-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)}")
    rows, k = x.shape
    if k != packed.k:
        raise ValueError(f"x has {k} columns, the weight expects {packed.k}")
    if x.stride(1) != 1 or (rows > 1 and x.stride(0) < k):
        x = x.contiguous()
    if out is None:
        out = torch.empty(rows, packed.n, dtype=torch.float32)
    elif (
        out.dtype != torch.float32
        or out.device.type != "cpu"
        or tuple(out.shape) != (rows, packed.n)
        or out.stride(1) != 1
        or (rows > 1 and out.stride(0) < packed.n)
    ):
        raise ValueError(f"out must be a float32 CPU [{rows}, {packed.n}] tensor with unit stride")
    bias_address = 0
    if bias is not None:
        if bias.dtype != torch.float32 or tuple(bias.shape) != (packed.n,):
            raise ValueError(f"bias must be float32 [{packed.n}]")
        bias = bias.contiguous()
        bias_address = bias.data_ptr()
    if rows == 0:
        return out
    kernels().matmul(
        x.data_ptr(), max(x.stride(0), k), rows,
        packed.data.data_ptr(), packed.scales.data_ptr(),
        packed.n, packed.k, packed.bits, packed.group,
        bias_address, out.data_ptr(), max(out.stride(0), packed.n),
    )  # fmt: skip
    return out


class QuantLinear(nn.Module):
    """A linear layer with packed weights: the kernel for up to ``max_kernel_rows`` rows, a float
    matmul over the dequantized weights (in the model's dtype) beyond that."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bits: int,
        *,
        group: int = GROUP,
        max_kernel_rows: int = DEFAULT_MAX_KERNEL_ROWS,
    ):
        super().__init__()
        if weight.device.type != "cpu":
            raise ValueError("QuantLinear runs on the CPU only")
        self.out_features, self.in_features = weight.shape
        self.bits, self.group = bits, group
        self.max_kernel_rows = max_kernel_rows
        self.packed = quantize_weight(weight, bits, group)
        dequantized = dequantize_weight(self.packed).to(weight.dtype)
        # Weights that were already on the grid (a Q8_0 / Q4_1 GGUF) come back bit for bit:
        # share the original tensor (a tied embedding, say) instead of holding a second copy.
        if torch.equal(dequantized, weight.detach()):
            dequantized = weight.detach()
        self.weight = nn.Parameter(dequantized, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._bias32 = None if bias is None else bias.detach().float().contiguous()
        kernels()  # fail here, not in the first forward, if the module or the ISA is missing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.max_kernel_rows:
            return F.linear(x, self.weight, self.bias)
        out = quantized_matmul(flat.float(), self.packed, self._bias32)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group={self.group}, max_kernel_rows={self.max_kernel_rows}"
        )


def quantize_model_linears(
    model: nn.Module,
    mode: str,
    *,
    max_kernel_rows: int = DEFAULT_MAX_KERNEL_ROWS,
    head_names: tuple[str, ...] = ("lm_head",),
) -> list[str]:
    """Replaces every ``nn.Linear`` in ``model`` with a QuantLinear; returns the replaced names.

    ``int8`` quantizes all of them to 8 bits; ``int4`` quantizes to 4 bits all but the output
    projection (a module named in ``head_names``), which stays 8-bit as in llama.cpp's Q4_1
    files: logits are the most sensitive to rounding. A head tied to the embedding keeps the
    embedding's tensor as it is, so token lookups are unchanged. Call it after loading weights.
    """
    if mode not in MODES:
        raise ValueError(f"quantization mode {mode!r} is not supported (choose from {MODES})")
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        is_head = name.rsplit(".", 1)[-1] in head_names
        bits = 8 if mode == "int8" or is_head else 4
        quantized = QuantLinear(
            module.weight, module.bias, bits, max_kernel_rows=max_kernel_rows
        )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)
        replaced.append(name)
    return replaced

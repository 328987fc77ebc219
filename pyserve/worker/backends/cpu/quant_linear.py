"""The CPU kernels backend's quantized layers: packed weights (pyserve/worker/quant.py) run by
`pyserve._kernels` for small-batch CPU decode.

Batch-1 decode on a CPU is bound by how fast the weights stream from memory, so storing them in
8 or 4 bits (plus an fp16 scale and offset per group of 32 inputs) cuts the time a token takes.
The kernel quantizes each activation row per group on the fly, to int16 by default or to int8
(llama.cpp's Q8_1: faster from a few rows on, with coarser rounding), and accumulates integer
dot products with AVX-512 VNNI; AVX2 and portable paths exist for other CPUs
(cpp/kernels/README.md).

Quantization changes the logits (benchmarks/RESULTS.md, "Kernels"), so the server applies it
only where the checkpoint was quantized already (``quantization="auto"``: a GGUF served at the
precision its file holds, pyserve/worker/dtypes.py) or when asked; ModelRunner defaults to none.
In a bfloat16 model a ``QuantLinear`` keeps the dequantized weights too, for batches of more
than ``max_kernel_rows`` rows (long prefill chunks), where oneDNN's bf16 matmul overtakes the
kernel; in a float32 model the kernel wins at every size, so only the packed weights are kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.worker.dtypes import ACTIVATION_BITS
from pyserve.worker.quant import (
    DEFAULT_ACTIVATION_BITS,
    GROUP,
    PackedWeight,
    SegmentedWeight,
    dequantize_weight,
    kernels,
    packed_rows,
    quantize_weight,
    segments_of,
)
from pyserve.worker.weight_packing import QuantizedLayers

MODES = ("int8", "int4")
# Rows up to which the kernel beats torch's matmul in the model's dtype (benchmarks/
# bench_kernels.py; RESULTS.md, "Worker"): with int16 activations, int4 beats float32 at every
# size measured, from a decode batch to a whole prefill chunk and beyond, and is about even with
# bfloat16 at 64 rows. None: the kernel at any size, so a float32 model keeps no float copy
# of its quantized weights (a 7B model would otherwise hold 28 GB of float32 beside 4 GB of int4).
MAX_KERNEL_ROWS = {torch.float32: None, torch.bfloat16: 64, torch.float16: 64}


def quantized_matmul(
    x: torch.Tensor,
    packed: PackedWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    activation_bits: int = DEFAULT_ACTIVATION_BITS,
) -> torch.Tensor:
    """float32 [rows, n] = x [rows, k] @ Wᵀ (+ bias) through the kernel; x is float32 on the CPU,
    quantized per row and group to ``activation_bits`` (8 or 16) integers on the way.

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
        x.data_ptr(), max(x.stride(0), k), rows, activation_bits,
        packed.data.data_ptr(), packed.scales.data_ptr(),
        packed.n, packed.k, packed.bits, packed.group,
        bias_address, out.data_ptr(), max(out.stride(0), packed.n), packed.super_scales,
        packed.mxfp4,
    )  # fmt: skip
    return out


_DEFAULT_ROWS = object()  # QuantLinear's max_kernel_rows: MAX_KERNEL_ROWS of the weight's dtype


class QuantLinear(nn.Module):
    """A linear layer with packed weights: the kernel for up to ``max_kernel_rows`` rows, a float
    matmul over the dequantized weights (in the model's dtype) beyond that. With
    ``max_kernel_rows=None`` every batch takes the kernel and no float weight is kept
    (``weight`` is None; ``dequantize_weight(layer.packed)`` rebuilds it)."""

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        bits: int,
        *,
        group: int = GROUP,
        activation_bits: int = DEFAULT_ACTIVATION_BITS,
        max_kernel_rows: int | object | None = _DEFAULT_ROWS,
        # instead of weight: packed already (from_packed), maybe as segments of their own bits
        packed: PackedWeight | SegmentedWeight | None = None,
        dtype: torch.dtype = torch.float32,  # with packed: the model's dtype
    ):
        super().__init__()
        if weight is not None:
            if weight.device.type != "cpu":
                raise ValueError("QuantLinear runs on the CPU only")
            dtype = weight.dtype
            packed = quantize_weight(weight, bits, group)
        if packed is None:
            raise ValueError("QuantLinear needs a weight or a packed one")
        if activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits must be 8 or 16, not {activation_bits}")
        self.out_features, self.in_features = packed.n, packed.k
        self.bits, self.group, self.activation_bits = packed.bits, packed.group, activation_bits
        if max_kernel_rows is _DEFAULT_ROWS:
            max_kernel_rows = MAX_KERNEL_ROWS.get(dtype, 64)
        self.max_kernel_rows = max_kernel_rows
        self.packed = packed
        if max_kernel_rows is None:
            self.weight = None  # every batch goes through the kernel: no float copy to keep
        else:
            dequantized = dequantize_weight(self.packed).to(dtype)
            # Weights that were already on the grid (a Q8_0 / Q4_1 GGUF) come back bit for bit:
            # share the original tensor (a tied embedding, say) instead of holding a second copy.
            if weight is not None and torch.equal(dequantized, weight.detach()):
                dequantized = weight.detach()
            self.weight = nn.Parameter(dequantized, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._bias32 = None if bias is None else bias.detach().float().contiguous()
        # A decode step makes ~120 of these calls, so forward() skips quantized_matmul's checks:
        # everything about the weight is fixed here, x is made float32 and contiguous below.
        self._matmul = kernels().matmul  # fails here, not in a forward, if the module is missing
        # the kernel's weight arguments (addresses, sizes, bias), for forward() and for callers
        # that run the kernel themselves (stack.py's decoder stack): one tuple, or
        # for a SegmentedWeight a list of them, one per segment (its rows of the bias)
        self._segment_rows: list[int] = []  # each segment's first output
        # each segment's super_scales and mxfp4, the kernel's last two arguments
        self.super_scales = [segment.super_scales for segment in segments_of(packed)]
        self.mxfp4 = [segment.mxfp4 for segment in segments_of(packed)]
        args, row0 = [], 0
        for segment in segments_of(packed):
            bias_address = 0 if self._bias32 is None else self._bias32.data_ptr() + 4 * row0
            self._segment_rows.append(row0)
            row0 += segment.n
            args.append((
                segment.data.data_ptr(), segment.scales.data_ptr(), segment.n, segment.k,
                segment.bits, segment.group, bias_address,
            ))  # fmt: skip
        self.weight_args = args if isinstance(packed, SegmentedWeight) else args[0]

    @classmethod
    def from_packed(
        cls,
        packed: PackedWeight | SegmentedWeight,
        bias: torch.Tensor | None,
        *,
        dtype: torch.dtype = torch.float32,
        activation_bits: int = DEFAULT_ACTIVATION_BITS,
        max_kernel_rows: int | object | None = _DEFAULT_ROWS,
    ) -> QuantLinear:
        """A layer over weights packed already (read from a GGUF file without float32)."""
        return cls(
            None,
            bias,
            packed.bits,
            activation_bits=activation_bits,
            max_kernel_rows=max_kernel_rows,
            packed=packed,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        rows = x.numel() // k
        limit = self.max_kernel_rows
        if limit is not None and rows > limit:
            return F.linear(x, self.weight, self.bias)
        if rows == 0:  # a step whose rows all belong to unfinished prefill chunks samples none
            return x.new_empty(*x.shape[:-1], n)
        flat = x.reshape(rows, k)
        if flat.dtype != torch.float32:
            flat = flat.float()
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.empty(rows, n)
        if isinstance(self.weight_args, tuple):
            self._matmul(
                flat.data_ptr(), k, rows, self.activation_bits, *self.weight_args,
                out.data_ptr(), n, self.super_scales[0], self.mxfp4[0],
            )  # fmt: skip
        else:  # each segment writes its columns of the rows
            calls = zip(
                self._segment_rows, self.weight_args, self.super_scales, self.mxfp4, strict=True
            )
            for row0, args, super_scales, mxfp4 in calls:
                address = out.data_ptr() + 4 * row0
                self._matmul(
                    flat.data_ptr(), k, rows, self.activation_bits, *args, address, n,
                    super_scales, mxfp4,
                )  # fmt: skip
        if x.dtype != torch.float32:
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group={self.group}, activation_bits={self.activation_bits}, "
            f"max_kernel_rows={self.max_kernel_rows}"
        )


class QuantEmbedding(nn.Module):
    """A token embedding kept packed: each lookup dequantizes only the rows it reads, so a
    quantized file's table never exists in float32 (a tied output projection shares it)."""

    def __init__(self, packed: PackedWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.packed = packed
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = packed.n, packed.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = packed_rows(self.packed, ids)
        rows = rows if self.dtype == torch.float32 else rows.to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.packed.precision}"


def quantize_model_linears(
    model: nn.Module,
    mode: str,
    *,
    activation_bits: int = DEFAULT_ACTIVATION_BITS,
    head_activation_bits: int | None = None,
    max_kernel_rows: int | object | None = _DEFAULT_ROWS,
    head_names: tuple[str, ...] = ("lm_head",),
    linear_types: tuple[type[nn.Module], ...] | None = None,
) -> list[str]:
    """Replaces every linear layer of ``model`` with a QuantLinear; returns the replaced names.

    Linear layers are ``nn.Linear`` and the worker's own ``pyserve.worker.linear.Linear`` (or
    the ``linear_types`` given): modules with a ``weight`` [out, in] and a ``bias`` or None.
    ``int8`` quantizes all of them to 8 bits; ``int4`` quantizes to 4 bits all but the output
    projection (a module named in ``head_names``), which stays 8-bit as in llama.cpp's Q4_1
    files: logits are the most sensitive to rounding. A head tied to the embedding leaves the
    embedding's tensor as it is, so token lookups are unchanged. ``head_activation_bits``
    (None: ``activation_bits``) is what the output projection rounds its inputs to. Call it after
    loading the weights and before anything repacks them.
    """
    if mode not in MODES:
        raise ValueError(f"quantization mode {mode!r} is not supported (choose from {MODES})")
    if linear_types is None:
        from pyserve.worker.linear import Linear

        linear_types = (nn.Linear, Linear)
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, linear_types):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"{name}: no plain [out, in] weight to quantize (already packed?)")
        is_head = name.rsplit(".", 1)[-1] in head_names
        bits = 8 if mode == "int8" or is_head else 4
        activations = head_activation_bits if is_head and head_activation_bits else activation_bits
        quantized = QuantLinear(
            weight,
            getattr(module, "bias", None),
            bits,
            activation_bits=activations,
            max_kernel_rows=max_kernel_rows,
        )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)
        replaced.append(name)
    return replaced


# the layers the CPU kernels run packed weights on (Backend.quantized_layers)
CPU_QUANTIZED_LAYERS = QuantizedLayers(
    own_widths=True, linear=QuantLinear.from_packed, embedding=QuantEmbedding
)

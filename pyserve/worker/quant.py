"""Packed weights: the 4-, 5-, 6- and 8-bit tiles of `pyserve._kernels` (cpp/kernels/qgemm.h)
that a quantized model is loaded into, whatever backend runs it.

The loader packs each projection straight from the file's tensors (weight_packing.py, with the
compiled module's repacking); the CPU kernels backend runs the tiles as they are
(backends/cpu/quant_linear.py), the Triton backend lays them out again for the GPU
(backends/triton/quant_matmul.py). ``kernels()`` sets the compiled module up once for both.

Weight formats (w = d·u + m per group, d and m fp16):
- ``int8``: symmetric, u = q + 128 with q ∈ [−127, 127] and m = −128·d (llama.cpp's Q8_0);
- ``int4``: asymmetric 4-bit, u ∈ [0, 15], d = (max − min)/15, m = min (llama.cpp's Q4_1).
Both round as llama.cpp does, so weights that a Q8_0 or Q4_1 GGUF held (the default model's)
quantize back to exactly themselves. A GGUF's Q5_0/Q5_1/Q5_K and Q6_K tensors are packed as
they are, at 5 and 6 bits with their own scales, and its MXFP4 tensors at 4 bits as their e2m1
codes with a power-of-two exponent per group (``pack_ggml_blocks``; nothing quantizes floats to
those forms).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from pyserve.worker import env

GROUP = 32  # inputs per quantization group (llama.cpp's block size)
MAX_GROUP = 256  # keeps a group's integer dot product inside int32 with int16 activations
TILE_ROWS = 16  # output rows per packed tile (one AVX-512 register)
DEFAULT_ACTIVATION_BITS = 16
logger = logging.getLogger(__name__)


def kernels():
    """The compiled module, set up once: the ISA from PYSERVE_KERNELS_ISA, AMX tiles from
    PYSERVE_KERNELS_AMX (why not logged where they cannot run), torch's thread count."""
    global _kernels_module
    if _kernels_module is None:
        from pyserve import _kernels

        isa = env.kernels_isa()
        if isa:
            try:
                _kernels.set_isa(isa)
            except ValueError as e:
                raise ValueError(f"{env.KERNELS_ISA}={isa!r}: {e}") from None
        if env.kernels_amx():
            try:
                _kernels.set_amx(True)
                logger.info("int8 activations from 32 rows on: AMX tiles")
            except ValueError:
                logger.warning(
                    "%s=1, but the AVX-512 VNNI loops run: %s",
                    env.KERNELS_AMX,
                    _kernels.amx_status(),
                )
        _kernels.set_num_threads(torch.get_num_threads())
        _kernels_module = _kernels
    return _kernels_module


_kernels_module = None


@dataclass(frozen=True)
class PackedWeight:
    """A [n, k] weight in the kernel's layout (cpp/kernels/qgemm.h)."""

    data: torch.Tensor  # uint8 [tiles, groups, group·16·bits/8] (5 and 6 bits: cpp/kernels/qgemm.h)
    # float16 [tiles, groups, 2, 16]: d of the tile's rows, then m; with super_scales, uint8
    # [tiles, groups / 8, 320]: per 256 inputs the rows' fp16 D and −Dmin, then 8-bit sc and mn
    # per group (llama.cpp's Q4_K, d = D·sc and m = −Dmin·mn: cpp/kernels/qgemm.h); 6 bits (always
    # super_scales), uint8 [tiles, groups / 8, 288]: the rows' fp16 D, then a signed sc per 16
    # inputs and row (llama.cpp's Q6_K, w = D·sc·(u − 32)); with mxfp4, uint8 [tiles, groups,
    # 16]: the rows' E8M0 exponents e, the nibbles e2m1 codes (w = MXFP4_VALUES[code]·2^(e − 128))
    scales: torch.Tensor
    n: int
    k: int
    bits: int
    group: int
    super_scales: bool = False
    mxfp4: bool = False

    @property
    def precision(self) -> str:
        """What the startup log and /server_info call this weight's form: int4, ..., mxfp4."""
        return "mxfp4" if self.mxfp4 else f"int{self.bits}"

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class SegmentedWeight:
    """A fused projection kept as row segments, each packed at its own precision (q and k at 4
    bits beside a v that the file holds at 6 or 8): the segments' rows one after another, every
    segment on its own kernel call, so no part is widened to the widest one's bits."""

    segments: tuple[PackedWeight, ...]

    @property
    def n(self) -> int:
        return sum(segment.n for segment in self.segments)

    @property
    def k(self) -> int:
        return self.segments[0].k

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(segment.bits for segment in self.segments)

    @property
    def group(self) -> int:
        return self.segments[0].group

    @property
    def nbytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments)


def segments_of(packed: PackedWeight | SegmentedWeight) -> tuple[PackedWeight, ...]:
    return packed.segments if isinstance(packed, SegmentedWeight) else (packed,)


HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14  # Linux's madvise advice
_libc = None


def weight_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape)`` for packed weights, its whole 2 MiB pages advised to be huge ones
    before anything touches them (Linux's transparent huge pages, offered on request where
    ``/sys/kernel/mm/transparent_hugepage/enabled`` says ``madvise``): a decode step streams
    every weight once, and with 4 KiB pages the TLB misses left part of the memory's bandwidth
    unused (RESULTS.md, "Kernels"). Elsewhere, or where the advice fails, the buffer is plain."""
    buffer = torch.empty(shape, dtype=dtype)
    start = _ceil_to(buffer.data_ptr(), HUGE_PAGE)
    end = (buffer.data_ptr() + buffer.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start and sys.platform == "linux":
        _c_library().madvise(start, end - start, MADV_HUGEPAGE)  # a failure: 4 KiB pages
    return buffer


def _c_library() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _libc


def return_freed_memory() -> None:
    """Gives the memory freed into glibc's heap back to the system (``malloc_trim``): buffers
    under its mmap threshold, freed after loading (a repack into another layout), would
    otherwise stay in the process's resident set. A no-op elsewhere."""
    if sys.platform != "linux":
        return
    trim = getattr(_c_library(), "malloc_trim", None)  # glibc's; musl has none
    if trim is not None:
        trim(0)


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# Rows quantized at a time: their float32 copies at most this many bytes, so that quantizing a
# large table (an embedding, an output projection) never holds several float copies of it
PIECE_BYTES = 4 * 2**20


def piece_rows(k: int) -> int:
    """Rows of ``k`` inputs converted at a time: whole tiles, about PIECE_BYTES in float32."""
    return max(TILE_ROWS, PIECE_BYTES // (4 * k) // TILE_ROWS * TILE_ROWS)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, bits: int, group: int = GROUP) -> PackedWeight:
    """Quantizes a float [n, k] weight per group of ``group`` inputs and packs it for the kernel."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if group <= 0 or group % 32 or group > MAX_GROUP:
        raise ValueError(f"group must be a multiple of 32 up to {MAX_GROUP}, not {group}")
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"expected a non-empty 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    rows = piece_rows(k)
    if n <= rows:
        return _quantize_rows(weight, bits, group)
    pieces = (_quantize_rows(weight[i : i + rows], bits, group) for i in range(0, n, rows))
    return concat_packed(pieces, n)


def _quantize_rows(weight: torch.Tensor, bits: int, group: int) -> PackedWeight:
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
    # d and m are rounded to fp16; where rounding would leave the group's extremes off the grid
    # (they would be clamped, an error above d/2) they move one fp16 step outwards. Weights that
    # are on the grid already (a Q8_0 / Q4_1 GGUF's) keep their exact d and m.
    if bits == 8:
        amax = groups.abs().amax(-1)
        d = (amax / 127).half()
        d = torch.where(d.float() * 127 < amax, _next_half(d, up=True), d)
        m = d * -128  # exact in fp16 (a power of two)
        q = torch.round(groups / _nonzero(d.float()).unsqueeze(-1)).clamp_(-127, 127)
        u = (q + 128).to(torch.uint8)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        m = low.half()
        m = torch.where(m.float() > low, _next_half(m, up=False), m)
        d = ((high - m.float()) / 15).half()
        d = torch.where(d.float() * 15 + m.float() < high, _next_half(d, up=True), d)
        u = torch.round((groups - m.float().unsqueeze(-1)) / _nonzero(d.float()).unsqueeze(-1))
        u = u.clamp_(0, 15).to(torch.uint8)
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError("the weight's range overflows the fp16 scales")
    packed = _pack(u.view(n_pad, k_pad), bits, group)
    return PackedWeight(packed, _pack_scales(d, m), n, k, bits, group)


def ggml_largest_u() -> dict[str, int]:
    """The GGML types whose blocks the kernels pack straight into tiles (cpp/kernels/ggml_repack.h
    says how: bit for bit but for the K-quants' fp16 scales, and Q6_K, rounded to int8), with the
    largest integer each holds: up to 15 fits 4-bit tiles, the rest need 8."""
    return kernels().GGML_PACKED_TYPES


SUPER_GROUPS = 8  # groups of a super-block (256 inputs)
SUPER_SCALE_BYTES = 2 * (2 * TILE_ROWS) + 2 * SUPER_GROUPS * TILE_ROWS  # of a tile's super-block
Q6_SCALE_BYTES = 2 * TILE_ROWS + 2 * SUPER_GROUPS * TILE_ROWS  # D, then sc per 16 inputs
Q6_OFFSET = 32  # a Q6_K weight is D·sc·(u − 32)
# the file type each super-block form holds, by bits
SUPER_TYPES = {4: "Q4_K", 5: "Q5_K", 6: "Q6_K"}


def super_scales_fit(type_names: Iterable[str], bits: int, k: int) -> bool:
    """Whether blocks of these types pack into ``bits``-bit tiles with super-block scales: all
    Q4_K into 4 bits (4.625 bits a weight, against 5 with fp16 scales per group), all Q5_K into
    5 (5.625) or all Q6_K into 6 (6.5625, against 9 as int8 with fp16 scales): every weight the
    file's."""
    kind = SUPER_TYPES.get(bits)
    return (
        kind is not None and k % (SUPER_GROUPS * GROUP) == 0 and all(t == kind for t in type_names)
    )


# MXFP4's e2m1 values doubled, by code (gguf-py's quants.MXFP4.kvalues; cpp/kernels/qgemm.h)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
MXFP4_OFFSET = 12  # unpack_weight's u = value + 12, m = −12·d
MXFP4 = "MXFP4"


def mxfp4_fits(type_names: Iterable[str], bits: int) -> bool:
    """Whether blocks of these types pack into 4-bit tiles in MXFP4's own form (all MXFP4: the
    codes and exponents as they are, 4.25 bits a weight, every weight the file's; the CPU
    kernels read it, the Triton ones do not)."""
    return bits == 4 and all(t == MXFP4 for t in type_names)


def ggml_fits(type_name: str, bits: int) -> bool:
    """Whether ``type_name`` blocks pack straight into ``bits``-bit tiles (6 bits: Q6_K only)."""
    if bits == 6:
        return type_name == "Q6_K"
    largest = ggml_largest_u().get(type_name)
    return largest is not None and largest < (1 << bits)


def pack_ggml_blocks(
    parts: Iterable[tuple[str, np.ndarray]],
    rows: int,
    k: int,
    bits: int,
    *,
    super_scales: bool = False,
) -> PackedWeight:
    """A weight of ``rows`` rows made of parts of GGML blocks, (type name, uint8 [rows, bytes of
    a row] as a GGUF file stores them) one after another, packed straight into one weight's
    ``bits``-bit tiles with no float in between; every part but the last fills whole tiles.
    ``super_scales``: Q4_K, Q5_K or Q6_K parts keep their super-block scales (super_scales_fit;
    Q6_K's 6-bit tiles have no other form). MXFP4 parts into 4 bits keep their own form
    (mxfp4_fits: every part MXFP4)."""
    parts = iter(parts)
    first = next(parts, None)
    if first is None:
        raise ValueError("no parts")
    parts = itertools.chain([first], parts)  # each part's bytes still read when its turn comes
    mxfp4 = mxfp4_fits([first[0]], bits)
    if mxfp4 and super_scales:
        raise ValueError("MXFP4 blocks keep their own exponents, not super-block scales")
    tiles, groups = _ceil_to(rows, TILE_ROWS) // TILE_ROWS, k // GROUP
    data = weight_buffer((tiles, groups, GROUP * TILE_ROWS * bits // 8), torch.uint8)
    if bits == 6 and not super_scales:
        raise ValueError("6-bit tiles hold Q6_K blocks with their super-block scales only")
    if mxfp4:
        scales = torch.empty(tiles, groups, TILE_ROWS, dtype=torch.uint8)
    elif super_scales:
        size = Q6_SCALE_BYTES if bits == 6 else SUPER_SCALE_BYTES
        scales = torch.empty(tiles, groups // SUPER_GROUPS, size, dtype=torch.uint8)
    else:
        scales = torch.empty(tiles, groups, 2, TILE_ROWS, dtype=torch.float16)
    done = 0
    for type_name, part in parts:
        if mxfp4 != mxfp4_fits([type_name], bits):
            raise ValueError(
                "MXFP4 blocks pack into 4-bit tiles in their own form, all parts MXFP4"
            )
        if not (mxfp4 or ggml_fits(type_name, bits)):
            raise ValueError(f"{type_name} blocks do not pack into {bits}-bit tiles")
        if super_scales and not super_scales_fit([type_name], bits, k):
            raise ValueError(f"{type_name} blocks do not pack with super-block scales")
        if done % TILE_ROWS or done + part.shape[0] > rows:
            raise ValueError(f"parts before the last must hold a multiple of {TILE_ROWS} rows")
        part = np.ascontiguousarray(part)
        tile = done // TILE_ROWS
        kernels().repack_ggml(
            type_name, part.ctypes.data, part.shape[1], part.shape[0], k, bits,
            data[tile:].data_ptr(), scales[tile:].data_ptr(), super_scales,
        )  # fmt: skip
        done += part.shape[0]
    if done != rows:
        raise ValueError(f"the parts hold {done} rows, not {rows}")
    if mxfp4:  # exponent bytes: every one a finite power of two
        return PackedWeight(data, scales, rows, k, bits, GROUP, mxfp4=True)
    fp16_bytes = 2 * TILE_ROWS if bits == 6 else 4 * TILE_ROWS  # D (and −Dmin) of the rows
    halves = scales[..., :fp16_bytes].contiguous().view(torch.float16) if super_scales else scales
    if not torch.isfinite(halves).all():
        raise ValueError("a group's scale or offset is inf or nan")
    return PackedWeight(data, scales, rows, k, bits, GROUP, super_scales)


def concat_packed(parts: Iterable[PackedWeight], rows: int) -> PackedWeight:
    """The weight of ``rows`` rows made of the parts' rows one after another (q, k and v into
    one projection; a table converted piece by piece), filled in as the parts come; every part
    but the last must fill whole tiles, and all share bits, group and inputs."""
    data = scales = first = None
    tile = done = 0
    for part in parts:
        if first is None:
            first = part
            tiles = _ceil_to(rows, TILE_ROWS) // TILE_ROWS
            data = weight_buffer((tiles, *part.data.shape[1:]), part.data.dtype)
            scales = part.scales.new_empty((tiles, *part.scales.shape[1:]))
        elif (part.bits, part.group, part.k, part.super_scales, part.mxfp4) != (
            first.bits, first.group, first.k, first.super_scales, first.mxfp4,
        ):  # fmt: skip
            raise ValueError("parts of one weight must share bits, group, inputs and scales")
        if done % TILE_ROWS:
            raise ValueError(f"parts before the last must hold a multiple of {TILE_ROWS} rows")
        count = part.data.shape[0]
        if tile + count > data.shape[0]:
            raise ValueError(f"the parts hold more than {rows} rows")
        data[tile : tile + count] = part.data
        scales[tile : tile + count] = part.scales
        tile, done = tile + count, done + part.n
    if first is None or done != rows:
        raise ValueError(f"the parts hold {done} rows, not {rows}")
    return PackedWeight(
        data, scales, rows, first.k, first.bits, first.group, first.super_scales, first.mxfp4
    )


@torch.no_grad()
def packed_rows(packed: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), k]: the given rows of the weight (an embedding lookup), computed as
    dequantize_weight computes them, without unpacking the rest."""
    rows = rows.reshape(-1).long()
    tile, at = rows // TILE_ROWS, rows % TILE_ROWS
    picked = torch.arange(len(rows))
    groups = packed.data.shape[1]
    blocks = packed.data[tile]  # [R, groups, bytes]
    if packed.bits == 8:
        u = blocks.view(len(rows), groups, -1, TILE_ROWS, 4)[picked, :, :, at]
    else:  # block p: quad 2p in the low nibbles, 2p+1 in the high ones
        both = blocks.view(len(rows), groups, -1, TILE_ROWS, 4)[picked, :, :, at]
        u = _merge_nibbles(both, packed.bits)
    u = u.reshape(len(rows), groups, packed.group)
    if packed.bits == 6:
        d = _q6_half_scales(packed.scales[tile])  # [R, groups, 2, 16]
        d = d[picked, :, :, at].repeat_interleave(GROUP // 2, dim=-1)
        w = d * (u.float() - Q6_OFFSET)
        return w.view(len(rows), -1)[:, : packed.k]
    if packed.mxfp4:
        u, d, m = _mxfp4_u_d_m(u, packed.scales[tile][picked, :, at])
    elif packed.super_scales:
        d, m = _super_group_scales(packed.scales[tile])  # [R, groups, 16] each
        d, m = d[picked, :, at], m[picked, :, at]
    else:
        scales = packed.scales[tile]  # [R, groups, 2, 16]
        d = scales[picked, :, 0, at].float()
        m = scales[picked, :, 1, at].float()
    w = d[..., None] * u.float() + m[..., None]
    return w.view(len(rows), -1)[:, : packed.k]


def _mxfp4_u_d_m(
    codes: torch.Tensor, exponents: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 codes (uint8, any shape) and their groups' exponent bytes → u = value + 12
    (uint8), d = 2^(e − 128) and m = −12·d (float32, the exponents' shape): d·u + m is every
    weight exactly (ggml's GGML_E8M0_TO_FP32_HALF: e < 2 gives subnormals)."""
    lookup = torch.tensor([v + MXFP4_OFFSET for v in MXFP4_VALUES], dtype=torch.uint8)
    u = lookup[codes.long()]
    e = exponents.int()
    bits = torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1) << 23)
    d = bits.contiguous().view(torch.float32)
    return u, d, -MXFP4_OFFSET * d


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """d with zeros replaced by one: a group of equal values quantizes to u = 0 (or 128)."""
    return torch.where(d == 0, torch.ones_like(d), d)


def _next_half(h: torch.Tensor, *, up: bool) -> torch.Tensor:
    """The neighbouring fp16 value of each element, above (up) or below; h is finite."""
    bits = h.view(torch.int16).int()
    magnitude_grows = (bits >= 0) == up  # positive numbers grow upwards, negative downwards
    stepped = torch.where(magnitude_grows, bits + 1, bits - 1)
    # ±0 has no smaller magnitude: step to the smallest subnormal of the other sign instead
    zero = (bits & 0x7FFF) == 0
    stepped = torch.where(
        zero & ~magnitude_grows, torch.full_like(bits, 1 if up else -32767), stepped
    )
    return stepped.short().view(torch.float16)


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


def _super_group_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Super-block scales uint8 [..., blocks, 320] → each group's float32 d = D·sc and
    m = −Dmin·mn, [..., blocks · 8, 16] (exact: 11-bit by 6-bit products)."""
    *lead, blocks, _ = scales.shape
    halves = scales[..., : 4 * TILE_ROWS].contiguous().view(torch.float16).float()
    big_d, neg_dmin = halves[..., :TILE_ROWS], halves[..., TILE_ROWS:]
    sc_mn = scales[..., 4 * TILE_ROWS :].float().view(*lead, blocks, 2, SUPER_GROUPS, TILE_ROWS)
    d = big_d.unsqueeze(-2) * sc_mn[..., 0, :, :]
    m = neg_dmin.unsqueeze(-2) * sc_mn[..., 1, :, :]
    return d.reshape(*lead, blocks * SUPER_GROUPS, TILE_ROWS), m.reshape(
        *lead, blocks * SUPER_GROUPS, TILE_ROWS
    )


def _merge_nibbles(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """[a, b, blocks, c] 4-, 5- or 6-bit group bytes (a group's 64-byte blocks at dim 2: pairs
    of quads in nibbles; 5 bits: 4 such, then 1 of high bits; 6 bits: 4, then 2 of high bit
    pairs) → [a, b, quads, c] u."""
    nibbles = blocks[:, :, :4] if bits in (5, 6) else blocks
    u = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=3).flatten(2, 3)
    if bits == 5:  # the plane's bit j: quad j's high bit
        plane = blocks[:, :, 4:]
        high = torch.stack([(plane >> j) & 1 for j in range(8)], dim=3).flatten(2, 3)
        u = u | (high << 4)
    if bits == 6:  # plane h, bits 2j: quad 4h + j's high pair
        planes = blocks[:, :, 4:]
        pairs = torch.stack([(planes >> (2 * j)) & 3 for j in range(4)], dim=3).flatten(2, 3)
        u = u | (pairs << 4)
    return u


def _q6_half_scales(scales: torch.Tensor) -> torch.Tensor:
    """Q6_K super-block scales uint8 [..., blocks, 288] → float32 D·sc per 16 inputs,
    [..., blocks · 8, 2, 16] (group, its half, row; exact: 11-bit by 8-bit products)."""
    *lead, blocks, _ = scales.shape
    big_d = scales[..., : 2 * TILE_ROWS].contiguous().view(torch.float16).float()
    sc = scales[..., 2 * TILE_ROWS :].contiguous().view(torch.int8).float()
    sc = sc.view(*lead, blocks, SUPER_GROUPS, 2, TILE_ROWS)
    d = big_d[..., None, None, :] * sc
    return d.reshape(*lead, blocks * SUPER_GROUPS, 2, TILE_ROWS)


@torch.no_grad()
def unpack_weight(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed integers and scales back in row order: u uint8 [n_pad, k_pad] and d, m
    [n_pad, groups], padding included: fp16, or float32 with super-block scales; 6 bits (scales
    per 16 inputs): d and m [n_pad, k_pad / 16], m = −32·d; MXFP4: u = the code's value + 12,
    d = 2^(e − 128) and m = −12·d, float32."""
    tiles, groups, _ = packed.data.shape
    group, quads = packed.group, packed.group // 4
    blocks = packed.data.view(tiles, groups, -1, TILE_ROWS * 4)
    if packed.bits in (4, 5, 6):
        blocks = _merge_nibbles(blocks, packed.bits).view(tiles, groups, quads, TILE_ROWS * 4)
    u = blocks.view(tiles, groups, quads, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)
    u = u.reshape(tiles * TILE_ROWS, groups * group)
    if packed.bits == 6:
        d = _q6_half_scales(packed.scales).permute(0, 3, 1, 2).reshape(tiles * TILE_ROWS, -1)
        return u, d, -Q6_OFFSET * d
    if packed.mxfp4:
        exponents = packed.scales.permute(0, 2, 1).reshape(tiles * TILE_ROWS, groups)
        return _mxfp4_u_d_m(u, exponents)
    if packed.super_scales:
        d, m = (s.permute(0, 2, 1).reshape(tiles * TILE_ROWS, groups)
                for s in _super_group_scales(packed.scales))  # fmt: skip
        return u, d, m
    d, m = packed.scales.permute(2, 0, 3, 1).reshape(2, tiles * TILE_ROWS, groups)
    return u, d, m


@torch.no_grad()
def dequantize_weight(packed: PackedWeight | SegmentedWeight) -> torch.Tensor:
    """The float32 [n, k] weight that the packed one stands for (w = d·u + m)."""
    if isinstance(packed, SegmentedWeight):
        return torch.cat([dequantize_weight(segment) for segment in packed.segments])
    u, d, m = unpack_weight(packed)
    rows, groups = d.shape  # 6 bits: per 16 inputs
    if packed.bits == 6:  # D·sc·(u − 32), as llama.cpp computes it
        w = d[..., None] * (u.view(rows, groups, -1).float() - Q6_OFFSET)
        return w.reshape(rows, -1)[: packed.n, : packed.k].contiguous()
    w = d.float()[..., None] * u.view(rows, groups, -1).float() + m.float()[..., None]
    return w.reshape(rows, -1)[: packed.n, : packed.k].contiguous()

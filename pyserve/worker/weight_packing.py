"""What precision each projection is packed at, and packing it straight from the file's tensors.

A quantized GGUF is served at the precision it holds, tensor by tensor (``Packing("native")``):
Q4_0/Q4_1/Q4_K weights on the 4-bit kernels, Q5_0/Q5_1/Q5_K and Q6_K on the CPU's 5- and 6-bit
ones, MXFP4 on the CPU's 4-bit kernels in its own form (e2m1 codes and a power-of-two exponent
per 32, 4.25 bits a weight), Q8_0 (and Q5_*, Q6_K elsewhere) on the 8-bit ones; MXFP4 elsewhere
(the Triton kernels have no MXFP4 loop) on the 8-bit ones too, exactly (its values are integers
times a power of two that fp16 holds, in any trained model). Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K and Q6_K blocks are packed from their own integers by the kernels module
(cpp/kernels/ggml_repack.h), never passing through float32 (on the CPU kernels Q4_K, Q5_K and
Q6_K keep their own super-block scales: 4.625, 5.625 and 6.5625 bits a weight, each the
file's); the others (Q2_K/Q3_K, IQ*) are dequantized a piece of rows at a time and quantized to
their precision. A projection made of several tensors (q, k and v; gate and up) keeps each
tensor at its own precision on the CPU kernels (a ``SegmentedWeight``: q and k on the 4-bit
kernels beside a Q6_K v on the 6-bit ones, not all three at 8 bits), and takes the highest
precision among them elsewhere. The output projection is 8-bit, or Q5_*/Q6_K as the file holds
it on the CPU kernels: the logits are the most sensitive to rounding (llama.cpp keeps it at Q6_K
or above for the same reason). ``Packing("int8")`` and ``Packing("int4")`` put every projection
at that precision, whatever the file holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pyserve.worker.loading.base import StoredTensor
from pyserve.worker.loading.progress import LoadProgress
from pyserve.worker.quant import (
    DEFAULT_ACTIVATION_BITS,
    MXFP4,
    TILE_ROWS,
    PackedWeight,
    SegmentedWeight,
    concat_packed,
    ggml_fits,
    mxfp4_fits,
    pack_ggml_blocks,
    piece_rows,
    quantize_weight,
    super_scales_fit,
)

PACKING_MODES = ("native", "int8", "int4")
logger = logging.getLogger(__name__)
# types the CPU kernels read at their own width, beyond the 4- and 8-bit ones
OWN_WIDTH = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}


@dataclass(frozen=True)
class QuantizedLayers:
    """What a backend runs packed weights on (Backend.quantized_layers): the loader makes each
    packed projection's layer and a packed embedding table's module with these."""

    # reads what the file holds as it is: Q5_* and Q6_K at their own widths, Q4_K/Q5_K with
    # their super-block scales, MXFP4 as its codes and exponents, a fused projection's parts each
    # at its own precision (the CPU kernels); False: 4- and 8-bit tiles with fp16 scales per
    # group, one precision a projection
    own_widths: bool
    # (PackedWeight | SegmentedWeight, bias or None, *, dtype, activation_bits) -> the layer
    linear: Callable[..., nn.Module]
    # (PackedWeight, *, dtype) -> the model's embed_tokens
    embedding: Callable[..., nn.Module | nn.Parameter]


@dataclass(frozen=True)
class Packing:
    mode: str  # one of PACKING_MODES
    layers: QuantizedLayers  # what runs the packed layers: the backend's
    activation_bits: int = DEFAULT_ACTIVATION_BITS  # what the layers round activations to
    # the output projection decides the tokens and runs on few rows: int16 whatever the layers use
    head_activation_bits: int = DEFAULT_ACTIVATION_BITS
    dtype: torch.dtype = torch.float32  # the model's

    def __post_init__(self) -> None:
        if self.mode not in PACKING_MODES:
            raise ValueError(f"packing mode must be one of {PACKING_MODES}, not {self.mode!r}")

    def bits(self, parts: list[StoredTensor], *, head: bool = False) -> int:
        """The precision of the projection made of ``parts`` (its rows' tensors, in order)."""
        if not self.layers.own_widths and any(part.type_name == MXFP4 for part in parts):
            _note_mxfp4_on_8_bits()
        own = {self._own_bits(part) for part in parts}
        if self.mode == "native" and own in ({5}, {6}):
            return own.pop()  # Q5_*, Q6_K as they are, the output projection too: fewer bytes
        if head or self.mode == "int8":
            return 8
        if self.mode == "int4":
            return 4
        # a float tensor inside a quantized file: the 8-bit kernels, closest to its precision;
        # Q5_*, Q6_K beside other types: 8 (5- and 6-bit tiles hold their own types only)
        return max(8 if bits in (5, 6) else bits for bits in map(self._own_bits, parts))

    def _own_bits(self, part: StoredTensor) -> int:
        if self.layers.own_widths and part.type_name in OWN_WIDTH:
            return OWN_WIDTH[part.type_name]
        if part.type_name == MXFP4 and not self.layers.own_widths:
            return 8  # its values are exact in 8-bit tiles; in fp16-scaled 4-bit ones they are not
        return part.native_bits or 8

    @property
    def super_scales(self) -> bool:
        """Whether Q4_K blocks keep their super-block scales (4.625 bits a weight, exactly the
        file's values) and MXFP4 blocks their codes and exponents (4.25): the CPU kernels read
        them; the Triton ones read fp16 scales per group."""
        return self.layers.own_widths

    def part_bits(self, parts: list[StoredTensor], *, head: bool = False) -> list[int] | None:
        """Each part's own precision, where the projection made of ``parts`` keeps them as
        segments (native packing on the CPU kernels, parts at different precisions); None where
        one precision, ``bits(parts)``, serves the whole projection."""
        if head or self.mode != "native" or not self.layers.own_widths or len(parts) < 2:
            return None
        bits = [self._own_bits(part) for part in parts]
        return bits if len(set(bits)) > 1 else None


def pack_parts(parts: list[StoredTensor], bits: int, *, super_scales: bool = False) -> PackedWeight:
    """The weight made of ``parts``' rows one after another, packed at ``bits``: straight from
    the file's blocks into one weight where they fit ``bits``-bit tiles, else from their float
    values a piece of rows at a time; all parts' float values at once only when a part ends
    mid-tile (rare head sizes). ``super_scales``: the file's own scales where the layers read
    them (Packing.super_scales): all-Q4_K parts keep their super-block scales, all-MXFP4 parts
    at 4 bits their codes and exponents."""
    rows, k = sum(part.shape[0] for part in parts), parts[0].shape[1]
    if any(part.shape[0] % TILE_ROWS for part in parts[:-1]):
        values = torch.cat([part.values().float() for part in parts])
        return quantize_weight(values, bits)
    types = [part.type_name for part in parts]
    if super_scales and all(part.quantized for part in parts) and mxfp4_fits(types, bits):
        blocks = ((part.type_name, _blocks(part)) for part in parts)
        return pack_ggml_blocks(blocks, rows, k, bits)
    if all(part.quantized and ggml_fits(part.type_name, bits) for part in parts):
        # each part's bytes are read when its turn comes: one part's at a time
        blocks = ((part.type_name, _blocks(part)) for part in parts)
        keep = super_scales and super_scales_fit([part.type_name for part in parts], bits, k)
        return pack_ggml_blocks(blocks, rows, k, bits, super_scales=keep)
    return concat_packed((pack_tensor(part, bits) for part in parts), rows)


def pack_segments(
    parts: list[StoredTensor], bits: list[int], *, super_scales: bool = False
) -> SegmentedWeight:
    """The weight made of ``parts``' rows, each run of parts that share a precision packed as
    one segment at it (``bits``: each part's)."""
    runs: list[tuple[int, list[StoredTensor]]] = []
    for part, part_bits in zip(parts, bits, strict=True):
        if runs and runs[-1][0] == part_bits:
            runs[-1][1].append(part)
        else:
            runs.append((part_bits, [part]))
    return SegmentedWeight(tuple(pack_parts(run, b, super_scales=super_scales) for b, run in runs))


def pack_tensor(tensor: StoredTensor, bits: int) -> PackedWeight:
    n, k = tensor.shape
    if tensor.quantized and ggml_fits(tensor.type_name, bits):
        return pack_ggml_blocks([(tensor.type_name, _blocks(tensor))], n, k, bits)
    # from float values, a piece of rows at a time
    pieces = tensor.pieces(piece_rows(k))
    return concat_packed((quantize_weight(piece.values(), bits) for piece in pieces), n)


def _blocks(tensor: StoredTensor) -> np.ndarray:
    blocks = tensor.blocks()
    if blocks is None:
        raise ValueError(f"{tensor.name}: a quantized tensor without blocks")
    return blocks


_mxfp4_noted = False


def _note_mxfp4_on_8_bits() -> None:
    """Says once per process where a backend without MXFP4 kernels puts MXFP4 tensors."""
    global _mxfp4_noted
    if not _mxfp4_noted:
        _mxfp4_noted = True
        logger.info(
            "MXFP4 tensors: this backend's quantized kernels have no MXFP4 loop; packed as 8-bit "
            "tiles (u = 2·e2m1 + 128, d = the block's power of two: every weight exact where fp16 "
            "holds d, else rounded to int8), 8.5 bits a weight against the file's 4.25"
        )


class PackingPool:
    """Packs projections on background threads while the loader goes on reading (numpy's and
    torch's loops release the GIL), with at most one per thread in flight, so memory holds a
    few tensors' transients at a time."""

    def __init__(self, threads: int, progress: LoadProgress | None = None):
        one_malloc_arena()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pack")
        self._in_flight: deque[tuple[str, Future, int, int]] = deque()
        self._limit = threads
        self._progress = progress
        self.done: dict[str, PackedWeight] = {}

    def submit(self, key: str, tensors: int, nbytes: int, pack: Callable[[], PackedWeight]) -> None:
        while len(self._in_flight) >= self._limit:
            self._collect()
        self._in_flight.append((key, self._executor.submit(pack), tensors, nbytes))

    def finish(self) -> dict[str, PackedWeight]:
        while self._in_flight:
            self._collect()
        self._executor.shutdown()
        return self.done

    def cancel(self) -> None:
        self._executor.shutdown(cancel_futures=True)

    def _collect(self) -> None:
        key, future, tensors, nbytes = self._in_flight.popleft()
        self.done[key] = future.result()
        if self._progress is not None:
            self._progress.advance(nbytes, tensors)


M_ARENA_MAX = -8  # glibc's mallopt parameter


def one_malloc_arena() -> None:
    """Makes new threads share glibc's one malloc arena (for the whole process: the worker's
    other threads do not allocate in their loops). With an arena per packing thread, the
    buffers each one freed stayed resident beside the others': the 0.5B Q4_K_M load peaked
    visibly higher (RESULTS.md, "Loading real model files")."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1)

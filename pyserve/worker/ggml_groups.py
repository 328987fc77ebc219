"""GGML quantized blocks read as the kernels' groups: w = d·u + m per 32 inputs, u unsigned.

The kernels (pyserve.worker.quant) hold every group of 32 inputs as unsigned integers u with an
fp16 scale d and offset m. Most of llama.cpp's block types are that form already, so a file's
weights reach the kernels without passing through float32:

- Q4_0 (d·(q − 8)), Q4_1 (d·q + m), Q5_0 (d·(q − 16)), Q5_1 (d·q + m), Q8_0 (d·q, q signed):
  one fp16 d (and m) per 32 weights; u = q (Q8_0: q + 128) and m = −8d, −16d or −128d, all
  exact in fp16. Bit for bit the file's weights.
- Q4_K and Q5_K: super-blocks of 256 with a 6-bit scale and min per 32 (w = d·sc·q − dmin·mn).
  d·sc and dmin·mn are exact in float32 and rounded once to fp16 here: a relative error of at
  most 2^-11 on each group's scale and offset (benchmarks/RESULTS.md measures the logit drift).

Q6_K (scales per 16 weights), Q2_K/Q3_K (per 16) and the IQ types do not fit groups of 32: the
loader dequantizes those tensors one at a time with gguf-py and quantizes them (Q6_K → int8).
"""

from __future__ import annotations

import numpy as np

GROUP = 32
# Types read straight as groups, with the largest u they hold: ≤ 15 fits the 4-bit kernels.
GROUPED_TYPES = {
    "Q4_0": 15,
    "Q4_1": 15,
    "Q4_K": 15,
    "Q5_0": 31,
    "Q5_1": 31,
    "Q5_K": 31,
    "Q8_0": 255,
}
_BLOCK = {  # type → (weights, bytes) per block
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
}


def groups_from_blocks(
    type_name: str, raw: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw: uint8 [rows, bytes of a row] of ``type_name`` blocks, ``k`` weights a row →
    (u uint8 [rows, k], d fp16 [rows, k/32], m fp16 [rows, k/32]) with w = d·u + m."""
    weights, size = _BLOCK[type_name]
    rows = raw.shape[0]
    if k % weights or raw.shape[1] != k // weights * size:
        raise ValueError(f"{type_name}: {raw.shape[1]} bytes cannot hold a row of {k} weights")
    blocks = np.ascontiguousarray(raw).reshape(-1, size)
    u, d, m = _DECODE[type_name](blocks)
    return u.reshape(rows, k), d.reshape(rows, -1), m.reshape(rows, -1)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16)  # [blocks, 1]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes → 32 weights: the low nibbles are weights 0-15, the high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian uint32) → bit j for weight j, shifted to 16."""
    bits = qh.copy().view("<u4")  # [blocks, 1]
    return (((bits >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q4_0(blocks):
    d = _half(blocks, 0)
    return _nibbles(blocks[:, 2:18]), d, _scaled(d, -8)


def _q4_1(blocks):
    return _nibbles(blocks[:, 4:20]), _half(blocks, 0), _half(blocks, 2)


def _q5_0(blocks):
    d = _half(blocks, 0)
    return _nibbles(blocks[:, 6:22]) | _high_bits(blocks[:, 2:6]), d, _scaled(d, -16)


def _q5_1(blocks):
    u = _nibbles(blocks[:, 8:24]) | _high_bits(blocks[:, 4:8])
    return u, _half(blocks, 0), _half(blocks, 2)


def _q8_0(blocks):
    d = _half(blocks, 0)
    u = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return u, d, _scaled(d, -128)


def _scaled(d: np.ndarray, factor: int) -> np.ndarray:
    """factor·d in fp16: exact for a power of two unless it overflows, which a file never has."""
    with np.errstate(over="ignore"):
        return (d.astype(np.float32) * factor).astype(np.float16)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fp16 d and m of the 8 groups of each Q4_K/Q5_K super-block (llama.cpp's
    get_scale_min_k4: 6-bit scales and mins packed into 12 bytes)."""
    d = _half(blocks, 0).astype(np.float32)
    dmin = _half(blocks, 2).astype(np.float32)
    s = blocks[:, 4:16].astype(np.uint8)
    sc = np.empty((len(blocks), 8), np.uint8)
    mn = np.empty((len(blocks), 8), np.uint8)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    with np.errstate(over="ignore"):
        return (d * sc).astype(np.float16), (-(dmin * mn)).astype(np.float16)


def _q4_k(blocks):
    d, m = _k_scales(blocks)
    qs = blocks[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
    u = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    return u, d, m


def _q5_k(blocks):
    d, m = _k_scales(blocks)
    qh = blocks[:, 16:48][:, None, None, :]  # bit 2c (low nibbles) and 2c+1 of chunk c
    qs = blocks[:, 48:176].reshape(-1, 4, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
    high = ((qh >> shifts) & 1) << 4
    u = np.stack([qs & 0x0F, qs >> 4], axis=2) | high
    return u.reshape(-1, 256), d, m


_DECODE = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
}

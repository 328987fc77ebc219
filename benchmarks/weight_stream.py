"""How fast the CPU kernels stream packed K-quant weights from memory, against the machine's read
bandwidth: random Q4_K, Q5_K and Q6_K blocks packed as a GGUF load packs them (at 4, 5 and 6
bits with their own scales; Q5_K and Q6_K also at 8 bits, their form before), copies enough to pass
well beyond the caches (``--total-mb``), multiplied one after another by M rows of activations as
a decode step does. Prints GB/s of weights read a second for each layout and M.

    .venv/bin/python benchmarks/weight_stream.py --rows 1 4 16 --threads 2
    .venv/bin/python benchmarks/weight_stream.py --plain-pages  # 4 KiB pages, for comparison
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gguf_files import random_blocks

from pyserve.worker import quant
from pyserve.worker.backends.cpu import quant_linear

LAYOUTS = {"Q4_K 4-bit": ("Q4_K", 4, True), "Q5_K 5-bit": ("Q5_K", 5, True)}
LAYOUTS |= {"Q5_K 8-bit": ("Q5_K", 8, False), "Q6_K 6-bit": ("Q6_K", 6, True)}
LAYOUTS["Q6_K 8-bit"] = ("Q6_K", 8, False)


def copies(packed: quant.PackedWeight, count: int, plain: bool) -> list[quant.PackedWeight]:
    def buffer(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t) if plain else quant.weight_buffer(tuple(t.shape), t.dtype)
        return out.copy_(t)

    return [
        dataclasses.replace(packed, data=buffer(packed.data), scales=buffer(packed.scales))
        for _ in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="outputs of each weight")
    parser.add_argument("--k", type=int, default=4096, help="inputs (a multiple of 256)")
    parser.add_argument("--total-mb", type=int, default=1000, help="weights cycled through")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plain-pages", action="store_true", help="no huge-page advice")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quant.kernels().set_num_threads(args.threads)
    print(
        f"{args.n} x {args.k} weights, ~{args.total_mb} MB each layout, {args.threads} threads, "
        f"{'4 KiB' if args.plain_pages else 'huge-page advised'} buffers, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    rng = np.random.default_rng(0)
    for name, (type_name, bits, own_scales) in LAYOUTS.items():
        blocks = random_blocks(type_name, args.n, args.k, rng)
        packed = quant.pack_ggml_blocks(
            [(type_name, blocks)], args.n, args.k, bits, super_scales=own_scales
        )
        weights = copies(packed, max(1, args.total_mb * 10**6 // packed.nbytes), args.plain_pages)
        total = sum(w.nbytes for w in weights)
        for rows in args.rows:
            x = torch.randn(rows, args.k)
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for w in weights:
                    quant_linear.quantized_matmul(x, w)
                times.append(time.perf_counter() - start)
            best, median = min(times), statistics.median(times)
            bits_a_weight = packed.nbytes * 8 / (args.n * args.k)
            print(
                f"{name:11s} M={rows:3d}: {total / 1e6:6.0f} MB, {bits_a_weight:.3f} bits a weight,"
                f" best {total / best / 1e9:5.1f} GB/s, median {total / median / 1e9:5.1f} GB/s"
            )


if __name__ == "__main__":
    main()

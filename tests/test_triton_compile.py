"""Every Triton kernel compiles for the GPUs it is meant for (sm_90: H100/H200; sm_80: A100),
at the shapes and dtypes of the model families the backend serves (and the 8-/4-bit matmul and
the grouped-expert matmul at each tile height), on a machine without a GPU.

The interpreter that test_triton_kernels.py runs the kernels in accepts code that the compiler
rejects, so this test records the launches the kernel wrappers make for real model shapes (the
kernels do not run) and compiles each in a child without ``TRITON_INTERPRET``
(tests/triton_compile.py), checking the shared memory each needs against the target's limit and,
from cuobjdump's resource usage, that none spills registers on sm_90.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from triton_compile import record_launches, unique

from pyserve.worker.backends.triton import attention, fused
from pyserve.worker.backends.triton.backend import MAX_SPLITS
from pyserve.worker.backends.triton.experts import (
    ExpertStack,
    group_by_expert,
    grouped_matmul,
    tile_rows,
)
from pyserve.worker.backends.triton.quant_matmul import device_layout, quant_matmul
from pyserve.worker.dtypes import kv_int8_groups
from pyserve.worker.quant import quantize_weight

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    rotary: int | None = None  # partial rotary dims
    softcap: float | None = None
    window: int | None = None
    activation: str = "silu"
    sinks: bool = False  # a sink logit per head (gpt-oss)


# fmt: off
SHAPES = {
    "smollm2-135m": Shape(9, 3, 64, 576, 1536),
    "llama3-8b": Shape(32, 8, 128, 4096, 14336),
    "qwen2.5-0.5b": Shape(14, 2, 64, 896, 4864),
    "mistral-window": Shape(32, 8, 128, 4096, 14336, window=4096),
    "gemma2-9b": Shape(16, 8, 256, 3584, 14336, softcap=50.0, window=4096,
                       activation="gelu_tanh"),
    "phi3-partial-rotary": Shape(32, 32, 96, 3072, 8192, rotary=48),
    # head_dim 80 (Phi-2's, StableLM's): int8 K/V's short last group, in a tile of 128 dims
    "head80-partial-rotary": Shape(32, 32, 80, 2560, 10240, rotary=32),
    # its clamped SwiGLU runs in torch; the experts' grouped kernel is compiled below
    "gpt-oss-20b": Shape(64, 8, 64, 2880, 2880, window=128, sinks=True),
}
# fmt: on
DTYPES = {
    "llama3-8b": (torch.bfloat16, torch.float16, torch.float32),
    "smollm2-135m": (torch.bfloat16, torch.float32),
}
# the activations' dtypes each shape runs in over int8 K/V (--kv-cache-dtype int8)
INT8_KV_DTYPES = {
    "llama3-8b": (torch.bfloat16, torch.float16, torch.float32),
    "smollm2-135m": (torch.bfloat16, torch.float16),
    "head80-partial-rotary": (torch.bfloat16, torch.float16),
}
BLOCK_SIZE = 16


def launches_of(shape: Shape, dtype: torch.dtype, int8_kv: bool = False) -> list[dict]:
    """The launches one layer's kernels make for a step with a decode row and a prefill entry
    (over a cached prefix), at 1 and MAX_SPLITS decode splits; ``int8_kv``: over an int8 cache
    with its scales."""
    tokens, slots = 3, 4 * BLOCK_SIZE
    qkv = torch.zeros(tokens, (shape.heads + 2 * shape.kv_heads) * shape.head_dim, dtype=dtype)
    rotary = shape.rotary or shape.head_dim
    cos = torch.zeros(tokens, 1, rotary, dtype=torch.float32)
    kv_dtype = torch.int8 if int8_kv else dtype
    cache = torch.zeros(slots, shape.kv_heads, shape.head_dim, dtype=kv_dtype)
    scale = torch.zeros(slots, shape.kv_heads, kv_int8_groups(shape.head_dim), dtype=torch.float16)
    scales = dict(k_scale=scale, v_scale=scale.clone()) if int8_kv else {}
    ints = lambda *values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    common = dict(
        block_size=BLOCK_SIZE,
        num_kv_heads=shape.kv_heads,
        scale=shape.head_dim**-0.5,
        softcap=shape.softcap,
        window=shape.window,
        sinks=torch.zeros(shape.heads) if shape.sinks else None,
        **scales,
    )
    x = torch.zeros(tokens, shape.hidden, dtype=dtype)
    with record_launches() as launches:
        fused.rms_norm(x, torch.ones(shape.hidden, dtype=dtype), 1e-5)
        fused.rms_norm(x, torch.ones(shape.hidden, dtype=dtype), 1e-5, residual=x.clone())
        fused.gated_activation(
            torch.zeros(tokens, 2 * shape.intermediate, dtype=dtype), shape.activation
        )
        slot_ids = torch.arange(tokens, dtype=torch.int64)
        q = fused.rope_kv_store(
            qkv, cos, cos, slot_ids, cache, cache.clone(),
            num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, **scales,
        )  # fmt: skip
        out = torch.empty_like(q)
        tables = ints(0, 1, 2, 3).view(1, 4)
        for splits in (1, MAX_SPLITS):
            attention.paged_decode_attention(
                q, cache, cache, out, tables, ints(40), ints(0),
                max_context=40, num_splits=splits, **common,
            )  # fmt: skip
        attention.paged_extend_attention(
            q, cache, cache, out, tables, ints(1), ints(2), ints(30), max_q_len=2, **common
        )
    return launches


def quantized_launches(dtype: torch.dtype) -> list[dict]:
    """The 8- and 4-bit matmul for a decode step (split-K) and prefill chunks of each tile
    height, with and without a bias."""
    launches = []
    for bits in (8, 4):
        u, d, m = device_layout(quantize_weight(torch.zeros(64, 512), bits))
        bias = torch.zeros(64, dtype=dtype)
        with record_launches() as recorded:
            for rows, split in ((1, 4), (16, 1), (32, 1), (200, 1)):
                x = torch.zeros(rows, 512, dtype=dtype)
                quant_matmul(x, u, d, m, bits=bits, group=32, n=64, split=split)
                quant_matmul(x, u, d, m, bits=bits, group=32, n=64, bias=bias, split=split)
        launches += recorded
    return launches


def expert_launches(dtype: torch.dtype) -> list[dict]:
    """The grouped-expert matmul's gate/up (rows gathered from the tokens) and down launches at
    Qwen3-MoE-30B-A3B's shapes (hidden 2048, experts of 768, top 8 of 128), float and 8-/4-bit,
    for a decode step and a long prefill (each tile height)."""
    hidden, width, experts, top_k = 2048, 768, 128, 8
    stacks = [
        (
            ExpertStack(torch.zeros(experts, 2 * width, hidden, dtype=dtype), k=hidden),
            ExpertStack(torch.zeros(experts, hidden, width, dtype=dtype), k=width),
        )
    ]
    for bits in (8, 4):
        stacks.append(
            tuple(
                quantized_stack(experts, n, k, bits)
                for n, k in ((2 * width, hidden), (hidden, width))
            )
        )
    with record_launches() as launches:
        for tokens in (1, 512):
            routing = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
            block_m = tile_rows(routing.numel(), experts, dtype)
            groups = group_by_expert(routing, experts, block_m)
            x = torch.zeros(tokens, hidden, dtype=dtype)
            h = torch.zeros(tokens * top_k, width, dtype=dtype)
            for gate_up, down in stacks:
                grouped_matmul(x, gate_up, groups, gather=True)
                grouped_matmul(h, down, groups, gather=False)
    return launches


def quantized_stack(experts: int, n: int, k: int, bits: int) -> ExpertStack:
    """Every expert's [n, k] weight at ``bits`` (all zero: only the shapes matter here)."""
    u, d, m = device_layout(quantize_weight(torch.zeros(n, k), bits))
    stacked = [t.expand(experts, *t.shape) for t in (u, d, m)]
    return ExpertStack(stacked[0], k=k, bits=bits, group=32, d=stacked[1], m=stacked[2])


def all_launches() -> list[dict]:
    launches = []
    for name, shape in SHAPES.items():
        for dtype in DTYPES.get(name, (torch.bfloat16,)):
            launches += launches_of(shape, dtype)
        for dtype in INT8_KV_DTYPES.get(name, (torch.bfloat16,)):
            launches += launches_of(shape, dtype, int8_kv=True)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        launches += quantized_launches(dtype)
        launches += expert_launches(dtype)
    return unique(launches)


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    launches = all_launches()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(HERE / "triton_compile.py")],
        input=json.dumps(launches),
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_the_recorder_sees_every_kernel_with_its_constexprs() -> None:
    launches = launches_of(SHAPES["gemma2-9b"], torch.bfloat16)
    names = [launch["name"] for launch in launches]
    assert names == [
        "_rms_norm_kernel", "_rms_norm_kernel", "_gated_kernel", "_rope_kv_store_kernel",
        "_decode_split_kernel", "_decode_merge_kernel", "_decode_split_kernel",
        "_decode_merge_kernel", "_extend_kernel",
    ]  # fmt: skip
    decode = launches[4]
    assert decode["signature"]["q_ptr"] == "*bf16"
    assert decode["signature"]["out_ptr"] == "*fp32"  # the split partials
    assert (
        decode["constexprs"] | {"HAS_SOFTCAP": True, "HAS_WINDOW": True, "GROUP": 2}
        == (decode["constexprs"])
    )
    assert launches[6]["constexprs"]["NUM_SPLITS"] == MAX_SPLITS
    assert decode["options"] == {"num_warps": 4} and launches[8]["options"] == {"num_warps": 8}


def test_the_recorder_sees_the_int8_kv_launches() -> None:
    launches = launches_of(SHAPES["gpt-oss-20b"], torch.float16, int8_kv=True)
    store, decode, extend = launches[3], launches[4], launches[8]
    assert store["signature"]["k_cache_ptr"] == "*i8" and store["constexprs"]["QUANTIZED"]
    assert store["signature"]["k_scale_ptr"] == "*fp16" and store["constexprs"]["BLOCK_G"] == 2
    assert store["options"] == {"enable_fp_fusion": False}
    for launch in (decode, extend):
        assert launch["signature"]["k_ptr"] == launch["signature"]["v_ptr"] == "*i8"
        assert launch["signature"]["k_scale_ptr"] == "*fp16" and launch["constexprs"]["QUANTIZED"]
        assert launch["constexprs"]["GROUPS"] == 2 and launch["constexprs"]["BLOCK_G"] == 2
        assert launch["signature"]["q_ptr"] == "*fp16"


def test_every_kernel_compiles_for_sm90_and_sm80_within_shared_memory(compiled) -> None:
    failures = [
        f"{row['kernel']} sm_{row['capability']} {row['constexprs']}: {row['error']}"
        for row in compiled
        if "error" in row
    ]
    assert not failures, "\n".join(failures)
    kernels = {row["kernel"] for row in compiled}
    assert kernels == {
        "_rms_norm_kernel", "_gated_kernel", "_rope_kv_store_kernel", "_decode_split_kernel",
        "_decode_merge_kernel", "_extend_kernel", "_quant_matmul_kernel", "_grouped_matmul_kernel",
    }  # fmt: skip
    assert {row["capability"] for row in compiled} == {90, 80}


def test_no_kernel_spills_registers_on_sm90(compiled) -> None:
    """Spilled registers go to local memory (the stack): each such access is a memory round
    trip in the kernel's inner loop. The tile sizes (attention.decode_tiles/extend_tiles,
    quant_matmul's) are chosen so that none does on the H100/H200."""
    spilling = [
        f"{row['kernel']} {row['signature']} {row['constexprs']} {row['options']}: "
        f"{row['registers']} registers, {row['stack']} stack bytes"
        for row in compiled
        if row["capability"] == 90 and row["stack"]
    ]
    assert not spilling, "\n".join(spilling)

"""Tensor parallelism: one model split over ``--tp N`` worker processes (ranks).

Megatron's split, as SGLang and vLLM do it: q/k/v and gate/up are column-parallel (each rank
holds a slice of the heads and of the MLP width, and computes them alone), o_proj and down_proj
row-parallel (each rank multiplies its slice of the input; an all-reduce sums the partial
outputs), the embedding and lm_head vocab-parallel (each rank looks up or scores its slice of
the vocabulary; an all-reduce completes the embeddings, an all-gather the logits). Every rank
holds the KV cache of its own kv heads.

Rank 0 takes every message from the ring and broadcasts it; every rank then runs the same
requests, steps and sampling, so their request tables stay equal, and only rank 0 sends
tokens on. The sampled tokens are broadcast from rank 0 as well, so that no rank can drift
even where sampling would not be bitwise equal across processes.

Control messages travel on a gloo group whatever the device (NCCL moves CUDA tensors only);
on CUDA the model's collectives use NCCL, rank r on ``cuda:r``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re

import numpy as np
import torch
import torch.distributed as dist

from pyserve.worker.errors import TensorParallelError
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.settings import tp_split_problem

log = logging.getLogger("pyserve.worker")

# How long a rank waits in a collective for the others: a step's compute between two
# collectives, or the slowest rank's load at start. Rank 0 sends a keepalive when idle
# (process.KEEPALIVE_S) so that waiting for the next message never comes near it.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
LOAD_ERROR_BYTES = 4096  # the longest load error a rank reports to rank 0


def check_divisible(config: ModelConfig, size: int) -> None:
    """Raises ValueError, naming the model's numbers, if ``size`` ranks cannot split it."""
    counts = {
        "attention heads": config.num_heads,
        "kv heads": config.num_kv_heads,
        "MLP width": config.intermediate_size,
    }
    if config.moe is not None:  # every expert splits as a dense MLP does
        counts["expert width"] = config.moe.expert_size
        if config.moe.shared_expert_size:
            counts["shared expert width"] = config.moe.shared_expert_size
    problem = tp_split_problem(size, counts)
    if problem is not None:
        raise ValueError(problem)


def vocab_shard(vocab_size: int, size: int) -> int:
    """Rows of the vocabulary a rank holds (the last rank's tail is zero padding)."""
    return -(-vocab_size // size)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """What one rank computes: its share of the heads, the MLP (of every expert) and the
    vocabulary."""
    check_divisible(config, size)
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            expert_size=moe.expert_size // size,
            shared_expert_size=moe.shared_expert_size // size,
        )
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=config.num_kv_heads // size,
        intermediate_size=config.intermediate_size // size,
        vocab_size=vocab_shard(config.vocab_size, size),
        moe=moe,
    )


class TensorParallel:
    """This process's place in the group, and the collectives the model and the worker use."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size = rank, size
        self.device = device
        self.control: object | None = None  # the gloo group for messages (None: the default)
        self.set_vocab_size(0)  # known once the checkpoint is open

    def set_vocab_size(self, vocab_size: int) -> None:
        """The whole model's vocabulary (known once the checkpoint is open)."""
        self.vocab_size = vocab_size
        self.vocab_rows = vocab_shard(vocab_size, self.size)
        self.vocab_start = self.rank * self.vocab_rows

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: str) -> TensorParallel:
        """Joins the group (blocks until every rank has); on CUDA rank r takes ``cuda:r``."""
        torch_device = torch.device(device)
        backend = "gloo"
        if torch_device.type == "cuda":
            torch_device = torch.device("cuda", rank)
            torch.cuda.set_device(torch_device)
            backend = "nccl"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
        )
        tp = cls(rank, size, torch_device)
        if backend != "gloo":
            tp.control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        log.info("tensor-parallel rank %d of %d joined (%s)", rank, size, backend)
        return tp

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ the model's collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place)."""
        _checked(dist.all_reduce, x)
        return x

    def embed(self, table: torch.nn.Module | torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids`` from this rank's slice of the table (zeros for the ids
        of other ranks), summed over the ranks."""
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_rows)
        local = torch.where(inside, local, torch.zeros_like(local))
        if isinstance(table, torch.nn.Module):
            hidden = table(local)
        else:
            hidden = torch.nn.functional.embedding(local, table)
        hidden = hidden * inside.unsqueeze(-1).to(hidden.dtype)
        return self.all_reduce(hidden)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[S, vocab] from every rank's [S, vocab_rows] slice."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        _checked(dist.all_gather, parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

    # ------------------------------------------------------------------ the worker's messages

    def broadcast_frames(self, frames: list[bytes] | None) -> list[bytes]:
        """Rank 0's ``frames`` on every rank (the others pass None). An empty list is a
        keepalive."""
        header = torch.zeros(2, dtype=torch.int64)
        if self.rank == 0:
            assert frames is not None
            payload = b"".join(frames)
            lengths = np.asarray([len(f) for f in frames], dtype="<i8").tobytes()
            header[0], header[1] = len(frames), len(lengths) + len(payload)
        _checked(dist.broadcast, header, 0, group=self.control)
        count, nbytes = int(header[0]), int(header[1])
        if count == 0:
            return []
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(lengths + payload), dtype=torch.uint8)
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        _checked(dist.broadcast, buffer, 0, group=self.control)
        if self.rank == 0:
            return frames
        raw = buffer.numpy().tobytes()
        lengths = np.frombuffer(raw[: 8 * count], dtype="<i8")
        out, at = [], 8 * count
        for n in lengths:
            out.append(raw[at : at + int(n)])
            at += int(n)
        return out

    def broadcast_tokens(self, token_ids: list[int]) -> list[int]:
        """Rank 0's sampled tokens on every rank."""
        tokens = torch.tensor(token_ids, dtype=torch.int64)
        _checked(dist.broadcast, tokens, 0, group=self.control)
        return tokens.tolist()

    def agree_loaded(self, error: str | None) -> str | None:
        """After every rank's load: the first rank's error ("rank R: ..."), or None when every
        rank loaded."""
        message = (f"rank {self.rank}: {error}" if error else "").encode()[:LOAD_ERROR_BYTES]
        mine = torch.zeros(LOAD_ERROR_BYTES, dtype=torch.uint8)
        if message:
            mine[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        _checked(dist.all_gather, everyone, mine, group=self.control)
        for got in everyone:
            text = got.numpy().tobytes().rstrip(b"\0").decode(errors="replace")
            if text:
                return text
        return None

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None)."""
        return self.broadcast_frames([data] if self.rank == 0 else None)[0]

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (of any lengths)."""
        mine = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(mine) for _ in range(self.size)]
        _checked(dist.all_gather, sizes, mine, group=self.control)
        lengths = [int(n) for n in sizes]
        if not max(lengths):
            return [b""] * self.size
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        _checked(dist.all_gather, parts, padded, group=self.control)
        return [part[:n].numpy().tobytes() for part, n in zip(parts, lengths, strict=True)]

    def any_flags(self, flags: list[bool]) -> list[bool]:
        """Each flag or-ed over the ranks (every rank passes as many)."""
        if not flags:
            return []
        t = torch.tensor(flags, dtype=torch.int32)
        _checked(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.control)
        return [bool(v) for v in t.tolist()]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (a KV pool every rank can hold)."""
        return self._reduce_int(value, dist.ReduceOp.MIN)

    def sum_int(self, value: int) -> int:
        """The sum of ``value`` over the ranks."""
        return self._reduce_int(value, dist.ReduceOp.SUM)

    def _reduce_int(self, value: int, op: dist.ReduceOp) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        _checked(dist.all_reduce, t, op=op, group=self.control)
        return int(t[0])


def _checked(collective, *args, **kwargs) -> None:
    try:
        collective(*args, **kwargs)
    except (RuntimeError, dist.DistBackendError) as e:
        # gloo's first line says what broke, after the source location it starts with
        lines = str(e).strip().splitlines() or [type(e).__name__]
        cause = re.sub(r"^\[[^\]]*\]\s*", "", lines[0])[:300]
        raise TensorParallelError(
            f"tensor-parallel {collective.__name__} failed (a rank died or its connection "
            f"broke): {cause}"
        ) from e

"""Helpers shared by the worker tests: a tiny random-weight Llama and HF greedy references."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import random_llama

from pyserve.wire.main_to_worker import Step
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.model_runner import ModelRunner
from pyserve.worker.settings import WorkerSettings

TINY_VOCAB = 512
TINY_EOS = 2


def load_runner(model: str | None, **settings) -> ModelRunner:
    """A ModelRunner over ``WorkerSettings(model=model, **settings)``; ``backend_options``
    (a dict) goes to the backend (e.g. ``max_chunk_tokens``)."""
    options = settings.pop("backend_options", {})
    return ModelRunner(WorkerSettings(model=model, **settings), **options)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One thread: these models are small, and on a busy machine a second OpenMP thread spins
    waiting for a descheduled peer at every op (tests ran 10x slower with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# attention kernels: relative error from rounding the output to its dtype (accumulation is float32)
ATTENTION_OUTPUT_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-10}


def assert_attention_close(
    out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str
) -> None:
    """An attention kernel's output against a float64 reference."""
    err = (out.double() - expected).abs()
    bound = 2e-5 + ATTENTION_OUTPUT_RTOL[dtype] * expected.abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{what}: error {err.flatten()[worst]:.3e} > {bound.flatten()[worst]:.3e}"
    )


def paged_batch(
    shapes: list[tuple[int, int]], block_size: int, num_blocks: int, gen: torch.Generator
) -> tuple[list[list[int]], ForwardBatch]:
    """Block tables drawn at random from ``num_blocks`` and the ForwardBatch of entries given as
    (start_pos, num_tokens); for attention tests that fill the cache themselves."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-(s + n) // block_size))] for s, n in shapes]
    total = sum(n for _, n in shapes)
    batch = ForwardBatch(
        input_ids=torch.zeros(total, dtype=torch.int64),
        positions=torch.cat([torch.arange(s, s + n) for s, n in shapes]),
        start_pos=[s for s, _ in shapes],
        num_tokens=[n for _, n in shapes],
        block_tables=tables,
        sample_index=torch.tensor([0]),
    )
    return tables, batch


def make_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """Saves a 2-layer Llama (safetensors) with a 512-token vocabulary and peaked logits."""
    model = random_llama(TINY_VOCAB, 512, seed, eos_token_id=TINY_EOS, pad_token_id=0)
    model.save_pretrained(directory)
    return directory


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: torch.Tensor  # float32 [new tokens, vocab]: log_softmax of HF's logits


def random_prompts(
    seed: int, lengths: list[int], shared_prefix: int = 0, shuffle: bool = False
) -> list[list[int]]:
    """Prompts of random ids (from 3: past the special ones) of the given lengths, each after the
    same ``shared_prefix`` random ids."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(shared_prefix)]
    if shuffle:
        lengths = list(lengths)
        rng.shuffle(lengths)
    return [prefix + [rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in lengths]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[Reference]:
    """HF ``generate`` (greedy, float32, EOS not a stop), one prompt at a time (no padding)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
            logits = torch.stack(out.logits)[:, 0].float()
            refs.append(Reference(out.sequences[0, len(prompt) :].tolist(), logits.log_softmax(-1)))
    return refs


def check_against_reference(got: list[int], ref: Reference, label: str) -> int:
    """Asserts ``got`` equals HF's tokens, or diverges only at a near-tie; returns tokens equal."""
    for i, (ours, theirs) in enumerate(zip(got, ref.token_ids, strict=False)):
        if ours != theirs:
            top2 = ref.logprobs[i].topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < 1e-3, (
                f"{label}: token {i} is {ours}, HF says {theirs}, and that is no near-tie "
                f"(top-2 logprob gap {gap:.4g})"
            )
            return i
    assert len(got) == len(ref.token_ids), (
        f"{label}: {len(got)} tokens, HF made {len(ref.token_ids)}"
    )
    return len(got)


def assert_same_outputs(  # OfflineEngine Outputs
    got: list, want: list, label: str, *, top_logprobs: bool = True
) -> None:
    """Same tokens and finishes; logprobs and top logprobs within float32 rounding. A greedy
    divergence is allowed only at a near-tie of plain decoding (batching may round otherwise)."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        same = next(
            (t for t, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=False)) if a != b),
            None,
        )
        if same is not None and w.top_logprobs:
            (_, first), (_, second) = w.top_logprobs[same][:2]
            assert first - second < 1e-3, f"{label}, prompt {i}: token {same} differs"
            continue
        assert g.token_ids == w.token_ids, f"{label}, prompt {i}"
        assert g.finish_reason == w.finish_reason, f"{label}, prompt {i}"
        if w.logprobs is not None:
            assert g.logprobs is not None and len(g.logprobs) == len(w.logprobs)
            diff = np.abs(np.subtract(g.logprobs, w.logprobs))
            assert diff.max(initial=0.0) < 1e-4, f"{label}, prompt {i}: logprobs"
        if top_logprobs and w.top_logprobs is not None:
            assert g.top_logprobs is not None and len(g.top_logprobs) == len(w.top_logprobs)
            for a, b in zip(g.top_logprobs, w.top_logprobs, strict=True):
                assert [t for t, _ in a] == [t for t, _ in b], f"{label}, prompt {i}: top ids"
                assert np.allclose([v for _, v in a], [v for _, v in b], atol=1e-4)


def i32(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def make_step(step_id: int, entries: list[dict], dropped: Sequence[int] = ()) -> Step:
    """entries: rid, start, n, decode, sample, ids (prefill ids or drafts), blocks, offset."""
    return Step(
        step_id=step_id,
        rids=np.asarray([e["rid"] for e in entries], dtype="<i8").tobytes(),
        start_pos=i32([e.get("start", 0) for e in entries]),
        num_tokens=i32([e.get("n", 1) for e in entries]),
        is_decode=bytes([e.get("decode", 0) for e in entries]),
        sample=bytes([e.get("sample", 1) for e in entries]),
        input_ids=i32([t for e in entries for t in e.get("ids", [])]),
        block_offsets=i32([e.get("offset", 0) for e in entries]),
        block_counts=i32([len(e.get("blocks", [])) for e in entries]),
        block_ids=i32([b for e in entries for b in e.get("blocks", [])]),
        dropped=np.asarray(dropped, dtype="<i8").tobytes(),
    )

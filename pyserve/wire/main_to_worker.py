"""Channel main → worker (PUSH→PULL): new requests, Step plans, shutdown."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """What the worker needs to turn logits into tokens and to decide EOS/length finishes."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0


class DetokParams(msgspec.Struct, omit_defaults=True):
    """What the detokenizer needs; the worker forwards it untouched."""

    stop: list[str] = []
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class NewRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """Sent once, before any Step that names ``rid``."""

    rid: int
    prompt_ids: bytes  # int32
    sampling: SamplingParams
    detok: DetokParams = msgspec.field(default_factory=DetokParams)


class Step(msgspec.Struct, tag=True):
    """One forward pass, as planned by ``pyserve._core`` (see cpp/README.md, "Step")."""

    step_id: int
    rids: bytes  # int64 per entry
    start_pos: bytes  # int32 per entry
    num_tokens: bytes  # int32 per entry
    is_decode: bytes  # uint8 per entry
    sample: bytes  # uint8 per entry
    input_ids: bytes  # int32, prefill entries concatenated
    block_offsets: bytes  # int32 per entry
    block_counts: bytes  # int32 per entry
    block_ids: bytes  # int32, concatenated
    dropped: bytes  # int64: requests whose state the worker and detokenizer drop


class Shutdown(msgspec.Struct, tag=True):
    """Asks the worker (and, forwarded, the detokenizer) to exit cleanly."""


ToWorker = NewRequest | Step | Shutdown

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ToWorker)


def step_from_plan(plan) -> Step:  # plan: pyserve._core.Step
    """Copies a core Step's packed arrays into the wire message (no per-request Python loop)."""
    return Step(
        step_id=plan.step_id,
        rids=plan.rids,
        start_pos=plan.start_pos,
        num_tokens=plan.num_tokens,
        is_decode=plan.is_decode,
        sample=plan.sample,
        input_ids=plan.input_ids,
        block_offsets=plan.block_offsets,
        block_counts=plan.block_counts,
        block_ids=plan.block_ids,
        dropped=plan.dropped,
    )

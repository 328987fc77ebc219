"""Channel detokenizer → main (PUSH→PULL): text deltas, token ids, finishes, step completions."""

from __future__ import annotations

import msgspec


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """New output of one request since its previous delta."""

    rid: int
    text: str  # never half a UTF-8 character, never part of a stop string
    token_ids: bytes  # int32: the tokens sampled this step (text may lag behind them)
    finish_reason: str | None = None  # "stop" or "length"
    matched_stop: str | int | None = None  # the stop string or token id that ended it
    logprob: float | None = None  # of the sampled token, when asked for
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # the request failed in the worker (its grammar broke): why
    pooled: bytes = b""  # float32: a prefill-only request's vector (NewRequest.pooling)


class StepDone(msgspec.Struct, tag=True, omit_defaults=True):
    """Step ``step_id`` is complete; main reports it to the core, then hands out the deltas."""

    step_id: int
    rids: bytes  # int64: exactly StepTokens.rids, for Planner.report
    token_ids: bytes  # int32: exactly StepTokens.token_ids
    deltas: list[RequestDelta] = []
    forward_ms: float = 0.0
    computed_tokens: int = 0  # from StepTokens
    # Requests the worker and the detokenizer hold state for once this step is done; main's
    # idle self-check expects both to be 0 when nothing runs.
    worker_requests: int = 0
    detokenizer_requests: int = 0
    # Forwarded from StepTokens: the worker's running totals of busy seconds and steps.
    worker_busy_seconds: float = 0.0
    worker_steps: int = 0
    failed_loads: bytes = b""  # int32: forwarded from StepTokens.failed_loads


class WorkerError(msgspec.Struct, tag=True):
    """Forwarded from the worker."""

    message: str
    rids: bytes = b""


class Ready(msgspec.Struct, tag=True):
    """Worker and detokenizer are both up; carries the worker's WorkerReady fields."""

    num_blocks: int
    block_size: int
    dtype: str
    device: str
    load_seconds: float = 0.0
    kv_cache_bytes: int = 0
    weight_bytes: int = 0  # the weights a decode step reads (its ranks' together)
    quantization: str = "none"  # the linear layers' precision: none, int8 or int4
    kv_cache_dtype: str = ""  # what K and V are stored in ("": the model's dtype)
    architecture: str = ""  # the model family that runs
    features: list[str] = []  # what the model computes beyond a plain Llama block
    backend: str = ""  # what computes it, and why it was chosen
    backend_reason: str = ""
    kernels: dict[str, str] = {}  # op → what computes it
    tp_size: int = 1  # tensor-parallel ranks the model is split over
    disk_tier: str = ""  # the disk tier's directory in use (rank 0's; "": none)
    disk_block_bytes: int = 0  # payload bytes of one block on disk (under --tp, every rank's)
    disk_index: bytes = b""  # WorkerReady.disk_index: the block files found at start


class Stopped(msgspec.Struct, tag=True):
    """The ring has shut down cleanly."""


ToMain = StepDone | Ready | WorkerError | Stopped

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ToMain)

"""Channel worker → detokenizer (PUSH→PULL): sampled token ids, finishes, logprobs."""

from __future__ import annotations

import msgspec

from pyserve.wire.main_to_worker import DetokParams

# finish codes in StepTokens.finish
FINISH_NONE = 0
FINISH_STOP = 1  # EOS or a stop_token_id
FINISH_LENGTH = 2  # max_new_tokens reached
FINISH_GRAMMAR = 3  # the request's grammar is complete: a "stop" whose token is output text
# The grammar could not go on: it rejected the token sampled under its own mask, or it failed to
# compile. Never a quiet stop: the request fails with an error.
FINISH_GRAMMAR_ERROR = 4


class DetokRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """A new request's detokenization settings, forwarded by the worker from NewRequest."""

    rid: int
    prompt_ids: bytes  # int32; lets the detokenizer start decoding with the right context
    params: DetokParams = msgspec.field(default_factory=DetokParams)


class TopLogprobs(msgspec.Struct, array_like=True):
    """The top alternatives for one sampled token."""

    index: int  # entry index in StepTokens.rids
    token_ids: bytes  # int32[k]
    logprobs: bytes  # float32[k]


class Pooled(msgspec.Struct, array_like=True):
    """A prefill-only request's vector (NewRequest.pooling), sent with its sampled token."""

    index: int  # entry index in StepTokens.rids
    values: bytes  # float32


class StepTokens(msgspec.Struct, tag=True, omit_defaults=True):
    """What one Step produced. ``rids`` names the request of each reported token, in step order:
    once for a plain sampling entry, once per emitted token (in order) for a verify entry."""

    step_id: int
    rids: bytes  # int64
    token_ids: bytes  # int32, one per rid
    finish: bytes  # uint8, one per rid: FINISH_* (only a request's last token may finish it)
    dropped: bytes = b""  # int64: forwarded from Step.dropped
    logprobs: bytes = b""  # float32, one per rid when any request asked for logprobs
    top_logprobs: list[TopLogprobs] = []
    pooled: list[Pooled] = []
    forward_ms: float = 0.0  # time the worker spent on the forward pass and sampling
    # positions the forward pass computed: a chained entry counts as it ran (0: not known)
    computed_tokens: int = 0
    worker_requests: int = 0  # requests the worker holds state for after this step (accounting)
    # Running totals since the worker started, for utilisation = Δbusy / Δwall: seconds spent
    # handling messages (from holding one to sending its replies; this step up to its encoding)
    # and steps run.
    busy_seconds: float = 0.0
    steps: int = 0
    failed_loads: bytes = b""  # int32: Step.load_blocks that could not be loaded from disk


class WorkerError(msgspec.Struct, tag=True):
    """The worker could not run a step; main fails the named requests (all if empty)."""

    message: str
    rids: bytes = b""  # int64


class WorkerReady(msgspec.Struct, tag=True, omit_defaults=True):
    """The worker has loaded the model and allocated the KV cache; forwarded to main."""

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
    # every block file's header at start: per block, key '<u8', parent key '<u8', then
    # block_size int32 token ids
    disk_index: bytes = b""


class Shutdown(msgspec.Struct, tag=True):
    """Forwarded from main: the detokenizer passes it on and exits."""


ToDetok = DetokRequest | StepTokens | WorkerReady | WorkerError | Shutdown

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ToDetok)

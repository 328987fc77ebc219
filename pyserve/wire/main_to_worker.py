"""Channel main → worker (PUSH→PULL): new requests, Step plans, shutdown."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# The ranges every request is held to, whichever door it came in by (HTTP or the Python Engine):
# the engine checks them before a request reaches the worker (``check_sampling``), and the HTTP
# request bodies reuse the same types, so both give the same errors.
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for each logit_bias value
MAX_LOGIT_BIAS = 1024  # entries; each is one scattered add per step

TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
Count = Annotated[int, Meta(ge=0, lt=2**31)]
PositiveCount = Annotated[int, Meta(ge=1, lt=2**31)]
Temperature = Annotated[float, Meta(ge=0, le=100)]
TopP = Annotated[float, Meta(gt=0, le=1)]
MinP = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Meta(gt=0, le=10)]
LogitBiasValue = Annotated[float, Meta(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]
LogitBias = Annotated[dict[TokenId, LogitBiasValue], Meta(max_length=MAX_LOGIT_BIAS)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
TopLogprobsCount = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "lark"]


class Grammar(msgspec.Struct, frozen=True, omit_defaults=True):
    """A constraint on the output, enforced token by token by the worker's grammar engine.

    ``text`` is a JSON schema (as JSON text), a regular expression, an EBNF (GBNF) or a Lark
    grammar; empty for ``json_object`` (any JSON object).
    """

    kind: GrammarKind
    text: str = ""


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """What the worker needs to turn logits into tokens and to decide EOS/length finishes."""

    max_new_tokens: PositiveCount
    temperature: Temperature = 1.0  # 0 = greedy
    top_p: TopP = 1.0
    top_k: Count = 0  # 0 = disabled
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    seed: int | None = None
    stop_token_ids: StopTokenIds = []
    ignore_eos: bool = False
    min_tokens: Count = 0
    logprobs: bool = False
    top_logprobs: TopLogprobsCount = 0
    logit_bias: LogitBias = {}  # token id -> added to its logit before sampling
    grammar: Grammar | None = None


encoder = msgspec.msgpack.Encoder()
_checker = msgspec.msgpack.Decoder(SamplingParams)


class InvalidSampling(ValueError):
    """A sampling parameter out of its range; ``param`` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_sampling(params: SamplingParams) -> SamplingParams:
    """``params`` validated against the ranges above; ValueError naming the field otherwise.

    A SamplingParams built in Python is not validated on construction (msgspec checks
    constraints when decoding), so it goes through one encode/decode round trip here.
    """
    try:
        return _checker.decode(encoder.encode(params))
    except msgspec.ValidationError as exc:
        # msgspec says "Expected `float` <= 10.0 - at `$.repetition_penalty`" (or "at `key`
        # in `$.logit_bias`" for a dict key)
        message, _, where = str(exc).partition(" - at `")
        path = where.rpartition("`$")[2] if "`$" in where else where.removeprefix("$")
        field = path.strip("`").removeprefix(".").split("[")[0].split(".")[0] or None
        message = message.replace("`", "")
        raise InvalidSampling(f"{field}: {message[0].lower()}{message[1:]}", field) from None


class DetokParams(msgspec.Struct, omit_defaults=True):
    """What the detokenizer needs; the worker forwards it untouched."""

    stop: list[str] = []
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


PoolingKind = Literal["last", "mean", "cls", "logits"]
MAX_POOLED_LOGITS = 16


class Pooling(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a prefill-only request returns besides its one sampled token: a float32 vector from
    its prompt. ``last``, ``mean``, ``cls``: the final-norm hidden state of the last prompt
    token, the mean over every prompt token, or that of the first; ``logits``: the logits of
    ``token_ids`` at the last prompt position (a reranker's "yes"/"no")."""

    kind: PoolingKind
    token_ids: Annotated[list[TokenId], Meta(max_length=MAX_POOLED_LOGITS)] = []

    @property
    def needs_every_position(self) -> bool:
        """Whether the vector reads hidden states of positions a cached prefix would skip:
        such a request is planned without prefix matching (Planner's ``match_prefix``)."""
        return self.kind in ("mean", "cls")


class WireTensor(msgspec.Struct, frozen=True, array_like=True):
    """An array as bytes: numpy's dtype name, its shape, its C-order bytes."""

    dtype: str
    shape: list[int]
    data: bytes


class ImageInput(msgspec.Struct, frozen=True, omit_defaults=True):
    """One image of a prompt, as the model's image processor made it.

    ``positions`` are the prompt positions its embedding rows fill, in row order; the prompt
    holds content-derived ids at or above the vocabulary there (``pyserve.engine.image_prompts``),
    so the radix cache shares them only with the same image. ``tensors`` are what the worker's
    vision tower encodes (``pixel_values`` and the family's others); ``key`` is the image's
    content digest, the key of the worker's cache of encoder outputs."""

    key: bytes
    positions: bytes  # int32, ascending
    tensors: dict[str, WireTensor]


class NewRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """Sent once, before any Step that names ``rid``."""

    rid: int
    prompt_ids: bytes  # int32
    sampling: SamplingParams
    detok: DetokParams = msgspec.field(default_factory=DetokParams)
    pooling: Pooling | None = None  # an embedding or a score (max_new_tokens is then 1)
    images: list[ImageInput] = []


class UncheckedNewRequest(msgspec.Struct, tag="NewRequest", omit_defaults=True):
    """A NewRequest read without checking its sampling ranges: what the worker reads of one
    that failed the check, to reject it by rid (the engine never sends one)."""

    rid: int
    prompt_ids: bytes
    sampling: dict
    detok: DetokParams = msgspec.field(default_factory=DetokParams)
    pooling: dict | None = None
    images: list = []


class Step(msgspec.Struct, tag=True):
    """One forward pass, as planned by ``pyserve._core`` (see cpp/README.md, "Step")."""

    step_id: int
    rids: bytes  # int64 per entry
    start_pos: bytes  # int32 per entry
    num_tokens: bytes  # int32 per entry
    # uint8 per entry: 0 prefill, 1 decode (+ drafts), 2 draft-model verify, 3 chained: planned
    # behind an unreported verify entry of the same request as if it accepts every draft, run
    # as 1 when the request's last sampled token sits at start_pos, else as a plain 1-token
    # decode at that token's position (its drafts unused)
    is_decode: bytes
    sample: bytes  # uint8 per entry
    input_ids: bytes  # int32: prefill entries' tokens and is_decode 1 and 3 entries' drafts
    block_offsets: bytes  # int32 per entry
    block_counts: bytes  # int32 per entry
    block_ids: bytes  # int32, concatenated
    dropped: bytes  # int64: requests whose state the worker and detokenizer drop
    # The disk tier's operations, done before the forward pass in this order: clear (a flush
    # since the last step), saves, loads, drops. A save writes block ``save_blocks[i]`` under
    # ``save_keys[i]``; its parent is the key of the block before it on its path (the root's
    # chain seed for a first block); ``save_tokens`` holds block_size token ids per save. A
    # load fills ``load_blocks[i]`` from the file of ``load_keys[i]``; StepTokens.failed_loads
    # names the blocks that could not be (main recomputes them).
    save_blocks: bytes = b""  # int32
    save_keys: bytes = b""  # uint64
    save_parents: bytes = b""  # uint64
    save_tokens: bytes = b""  # int32, block_size per save
    load_blocks: bytes = b""  # int32
    load_keys: bytes = b""  # uint64
    drop_keys: bytes = b""  # uint64
    clear_disk: bool = False  # delete every block file (after this step's saves and drops)


class Shutdown(msgspec.Struct, tag=True):
    """Asks the worker (and, forwarded, the detokenizer) to exit cleanly."""


ToWorker = NewRequest | Step | Shutdown

decoder = msgspec.msgpack.Decoder(ToWorker)
unchecked_request_decoder = msgspec.msgpack.Decoder(UncheckedNewRequest)


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
        # the disk ops, where the core's Step has them (a core without them plans none)
        save_blocks=getattr(plan, "save_blocks", b""),
        save_keys=getattr(plan, "save_keys", b""),
        save_parents=getattr(plan, "save_parents", b""),
        save_tokens=getattr(plan, "save_tokens", b""),
        load_blocks=getattr(plan, "load_blocks", b""),
        load_keys=getattr(plan, "load_keys", b""),
        drop_keys=getattr(plan, "drop_keys", b""),
        clear_disk=bool(getattr(plan, "clear_disk", False)),
    )

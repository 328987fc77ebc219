"""Embeddings and rerank scores over the generation pipeline.

An embedding is a prefill-only request: ``max_new_tokens`` 1 and a ``Pooling`` on its
NewRequest, so the core plans it like any prompt (chunked, batched beside generation, its KV
blocks cached or freed at the end) and the worker returns a float32 vector with its one token
(pyserve/worker/pooling.py). Here, in the main process: which pooling a model gets by default,
the Matryoshka dimensions it declares, how it reranks, and the arithmetic on the vectors
(truncation, normalization, scores). No torch: numpy only.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyserve.engine.errors import ContextLengthExceeded
from pyserve.engine.requests import RequestState
from pyserve.outputs import GenerationChunk
from pyserve.wire.detok_to_main import RequestDelta

POOLINGS = ("last", "mean", "cls")
RERANK_MODES = ("auto", "yes-no", "cosine")

# Qwen3-Reranker's prompt (its model card): a chat turn whose answer is "yes" or "no"; the score
# is P("yes") against P("no") at the position where the answer starts.
YES_NO_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
YES_NO_PREFIX = f"<|im_start|>system\n{YES_NO_SYSTEM}<|im_end|>\n<|im_start|>user\n"
YES_NO_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class InvalidEmbedding(ValueError):
    """A request this model cannot embed or score as asked; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InputTooLong(ContextLengthExceeded):
    """An input to embed or score has more tokens than the model's context."""

    def __init__(self, tokens: int, context_length: int) -> None:
        ValueError.__init__(
            self,
            f"This model's maximum context length is {context_length} tokens. However, the "
            f"input has {tokens} tokens. Shorten it, or pass truncate_prompt_tokens to keep its "
            "last tokens.",
        )
        self.prompt_tokens = tokens
        self.max_new_tokens = 0
        self.context_length = context_length


@dataclass(frozen=True)
class EmbeddingModel:
    """How the served model embeds and reranks (``/server_info``'s ``embedding``)."""

    pooling: str  # the default: last | mean | cls
    pooling_reason: str
    normalize: bool
    hidden_size: int
    # None: any truncation is refused; otherwise the sizes ``dimensions`` may take
    matryoshka_dimensions: tuple[int, ...] | None
    rerank_mode: str  # yes-no | cosine
    rerank_reason: str
    yes_no_ids: tuple[int, int] | None  # the "yes" and "no" token ids (yes-no mode)

    def info(self) -> dict[str, Any]:
        return {
            "pooling": self.pooling,
            "pooling_reason": self.pooling_reason,
            "normalize": self.normalize,
            "dimensions": self.hidden_size,
            "matryoshka_dimensions": (
                list(self.matryoshka_dimensions) if self.matryoshka_dimensions is not None else None
            ),
            "rerank": {
                "mode": self.rerank_mode,
                "reason": self.rerank_reason,
                "scores": (
                    'softmax of the "yes" and "no" logits after the reranker\'s prompt'
                    if self.rerank_mode == "yes-no"
                    else "cosine similarity of the query's and each document's embeddings"
                ),
            },
        }

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        dims = self.matryoshka_dimensions
        if dims is None:
            raise InvalidEmbedding(
                "dimensions: this model declares no Matryoshka dimensions, so its embeddings "
                f"cannot be shortened (they have {self.hidden_size})",
                "dimensions",
            )
        if dimensions not in dims:
            raise InvalidEmbedding(
                f"dimensions: {dimensions} is not one of the model's Matryoshka dimensions "
                f"{list(dims)}",
                "dimensions",
            )


def describe(
    *,
    path: str,
    kind: str,
    name: str,
    hidden_size: int,
    tokenizer: Any,
    pooling: str | None,
    normalize: bool,
    rerank_mode: str,
) -> EmbeddingModel:
    """The served model's embedding settings: flags first, then what its files declare."""
    directory = Path(path) if kind == "hf" else None
    config = _json(directory / "config.json") if directory is not None else {}
    architectures = [str(a) for a in config.get("architectures") or []]
    if pooling is not None:
        reason = "--pooling"
    else:
        pooling, reason = _default_pooling(directory, name, architectures)
    dims = config.get("matryoshka_dimensions")
    matryoshka: tuple[int, ...] | None = None
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d >= 1 for d in dims):
        matryoshka = tuple(sorted({d for d in dims if d <= hidden_size}))
    elif config.get("is_matryoshka") is True:
        matryoshka = tuple(range(1, hidden_size + 1))
    yes_no = _yes_no_ids(tokenizer)
    if rerank_mode == "auto":
        is_reranker = "rerank" in name.lower() or any("rerank" in a.lower() for a in architectures)
        if is_reranker and yes_no is not None:
            mode, why = "yes-no", f"{name} is a reranker of the Qwen3-Reranker kind"
        else:
            mode, why = "cosine", "not a reranker: scores by its embeddings"
    else:
        mode, why = rerank_mode, "--rerank-mode"
        if mode == "yes-no" and yes_no is None:
            raise ValueError("rerank_mode yes-no needs single tokens 'yes' and 'no'")
    return EmbeddingModel(
        pooling=pooling,
        pooling_reason=reason,
        normalize=normalize,
        hidden_size=hidden_size,
        matryoshka_dimensions=matryoshka,
        rerank_mode=mode,
        rerank_reason=why,
        yes_no_ids=yes_no if mode == "yes-no" else None,
    )


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _default_pooling(
    directory: Path | None, name: str, architectures: list[str]
) -> tuple[str, str]:
    """A sentence-transformers Pooling module's mode, else last-token for a decoder embedding
    model (Qwen3-Embedding's kind: a name saying so, or a bare model class with no LM head),
    else mean."""
    if directory is not None:
        for module in _modules(directory):
            if str(module.get("type", "")).endswith("Pooling"):
                pooling = _json(directory / str(module.get("path", "")) / "config.json")
                for key, kind in (
                    ("pooling_mode_lasttoken", "last"),
                    ("pooling_mode_cls_token", "cls"),
                    ("pooling_mode_mean_tokens", "mean"),
                ):
                    if pooling.get(key) is True:
                        return kind, f"the sentence-transformers Pooling module ({key})"
    if "embedding" in name.lower():
        return "last", "a decoder embedding model (by its name): its last token"
    if architectures and not any(a.endswith("ForCausalLM") for a in architectures):
        return "last", f"a decoder embedding model ({architectures[0]}): its last token"
    return "mean", "a generative model: the mean over its tokens"


def _modules(directory: Path) -> list[dict]:
    try:
        value = json.loads((directory / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    return [m for m in value if isinstance(m, dict)] if isinstance(value, list) else []


def _yes_no_ids(tokenizer: Any) -> tuple[int, int] | None:
    ids = []
    for word in ("yes", "no"):
        found = tokenizer.convert_tokens_to_ids(word)
        if not isinstance(found, int) or found == tokenizer.unk_token_id or found < 0:
            return None
        ids.append(found)
    return ids[0], ids[1]


def finish_vector(raw: bytes, dimensions: int | None, normalize: bool) -> list[float]:
    """The worker's pooled float32 vector, cut to ``dimensions`` (Matryoshka) and scaled to
    unit length when ``normalize`` (after the cut, so a short vector is a unit one too)."""
    vector = np.frombuffer(raw, dtype="<f4")
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        norm = float(np.sqrt(np.dot(vector.astype(np.float64), vector.astype(np.float64))))
        vector = (vector.astype(np.float64) / max(norm, 1e-12)).astype(np.float32)
    return vector.tolist()


def yes_probability(raw: bytes) -> float:
    """P("yes") from the logits of ("yes", "no"): a two-way softmax."""
    yes, no = np.frombuffer(raw, dtype="<f4").astype(np.float64).tolist()
    return 1.0 / (1.0 + math.exp(no - yes))


def cosine(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.dot(x, y) / max(np.linalg.norm(x) * np.linalg.norm(y), 1e-12))


def yes_no_text(query: str, document: str, instruction: str | None) -> str:
    """The user turn of Qwen3-Reranker's prompt, between YES_NO_PREFIX and YES_NO_SUFFIX."""
    return (
        f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
        f"<Document>: {document}"
    )


class PooledRequestState(RequestState):
    """A prefill-only request's state: its chunks as any request's, plus the vector that came
    with its last one."""

    __slots__ = ("pooled",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pooled = b""

    def add_delta(
        self, delta: RequestDelta, cached_tokens: int | None, spec_accepted: int | None = None
    ) -> None:
        if delta.pooled:
            self.pooled = delta.pooled
        super().add_delta(delta, cached_tokens, spec_accepted)


async def last_chunk(state: RequestState) -> GenerationChunk:
    """Waits for the request's final chunk."""
    while True:
        chunk = await state.next_chunk()
        if chunk.finish_reason is not None:
            return chunk


async def gather_all(awaitables: list) -> list:
    """The results of ``awaitables`` run concurrently; the first failure cancels the rest (which
    aborts their requests) and is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

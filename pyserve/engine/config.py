"""EngineConfig: everything `pyserve run` and embedders can set, and the KV pool sizing."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pyserve.engine.state_dir import resolve_state_dir
from pyserve.model_files import ModelInfo
from pyserve.worker.dtypes import (  # torch-free
    KV_VALUE_BYTES,
    kv_scale_bytes,
    resolve_kv_cache_dtype,
)
from pyserve.worker.settings import WorkerSettings  # torch-free

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Default KV pool: 1 GiB of K/V. For SmolLM2-135M (30 layers × 3 KV heads × 64 dims) that is
# 23,301 tokens in float32 (46,080 bytes a token) or 46,603 in bfloat16.
DEFAULT_KV_CACHE_BYTES = 1 << 30
# (max_prefill_tokens, chunked_prefill_size) unless set: see EngineConfig.resolved_prefill_budget
CPU_PREFILL_BUDGET = (512, 512)
SPECULATIVE_ALGORITHMS = ("ngram", "standalone")
MAX_DRAFT_TOKENS = 64  # a verify entry of more drafts would cost like a prefill chunk
MAX_NGRAM_WINDOW = 64  # the core's longest n-gram (cpp/core/ngram_index.h)
GPU_PREFILL_BUDGET = (8192, 2048)


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None = the bundled SmolLM2 GGUF
    # llama.cpp's --mmproj file: the vision tower and projector of a GGUF model (pyserve/mmproj.py)
    mmproj: str | None = None
    # what the image tower computes in: auto (the model's dtype) | float32 | bfloat16 | float16
    vision_dtype: str = "auto"
    served_model_name: str | None = None  # what /v1/models reports; default from the model
    dtype: str = "auto"  # float32 | bfloat16 | float16; auto = float32 on CPU, bfloat16 else
    device: str = "cpu"
    # Linear layers: none | int8 | int4 (CPU kernels, pyserve/worker/quant.py; Triton ones on
    # CUDA) | auto: the precision a GGUF file holds (none for float checkpoints).
    # The worker resolves auto (it reads the file) and reports the result in WorkerReady.
    quantization: str = "auto"
    # K and V storage: float32 | bfloat16 | float16 | auto (float16 for a float32 model on the
    # CPU, the model's dtype otherwise: pyserve/worker/dtypes.py, resolve_kv_cache_dtype)
    kv_cache_dtype: str = "auto"
    # What int8/int4 layers round activations to: 16 bits (logits within ~0.001 of float32
    # over the same weights) or 8 (llama.cpp's Q8_1: faster matmuls from ~8 rows on,
    # logprobs off by up to ~1; benchmarks/RESULTS.md). No effect without quantization.
    activation_bits: int = 16
    # How the worker computes: auto or a backend's name (pyserve/worker/backends/__init__.py)
    backend: str = "auto"
    tp_size: int = 1  # tensor-parallel worker ranks (pyserve/worker/tensor_parallel.py)
    block_size: int = 16
    # KV pool size: kv_cache_tokens if given, else kv_cache_bytes / bytes of K and V a token.
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_running_requests: int = 256
    # Prompt tokens in one step, and of one request in one step; None: by device (below).
    max_prefill_tokens: int | None = None
    chunked_prefill_size: int | None = None
    schedule_policy: str = "fcfs"  # or "lpm", "priority" (requests' priority field)
    # "tenant": admission takes the waiting request of the tenant served the fewest tokens
    # (cpp/core/planner.h, "Tenant fairness"; the fcfs policy only); "none": the policy alone
    fairness: str = "none"
    # Under fairness "tenant": tokens a running request's tenant may be served beyond a waiting
    # one's before the running request is retracted to give it the slot (the hysteresis)
    fairness_quantum: int = 4096
    enable_radix_cache: bool = True
    max_model_len: int | None = None  # None = the model's context length
    tokenizer_workers: int = 2
    stream_interval: int = 1  # hand out a chunk every N tokens (the first one at once)
    torch_threads: int | None = None  # the worker's torch threads; None = torch's default
    seed: int | None = None  # the worker's sampling seed for requests that give none
    log_level: str = "info"
    ready_timeout: float = 900.0  # seconds for the worker to load the model
    shutdown_timeout: float = 10.0  # seconds for the ring to stop before children are killed
    # Seconds a step may go unanswered by the worker before /health answers 503 (and an error
    # is logged) until it completes; 0: never. Nothing is killed (see engine/step_watch.py).
    # A healthy step can be long: a 512-token prefill of a 7B model on a small CPU takes tens
    # of seconds, and an orchestrator's health probe may restart a server it sees unhealthy, so
    # the default leaves a wide margin; a stuck worker never answers, so 5 min still catches it.
    step_timeout: float = 300.0
    # seconds a generation request may take, queue and generation together (None: no limit);
    # a request's own timeout replaces it
    request_timeout: float | None = None
    # On a CUDA device: the KV pool takes what is left of this fraction of the device's memory
    # once the weights are loaded (SGLang's --mem-fraction-static); None: kv_cache_tokens/bytes.
    mem_fraction_static: float | None = None
    # The disk tier under the prefix cache (pyserve/worker/disk_tier.py): evicted KV blocks,
    # and at a clean stop all cached ones, are kept in block files under state_dir (None: the
    # user's cache directory, engine/state_dir.py) up to this many bytes, and loaded back for a
    # prompt that reuses them, after a restart too; 0: off (`pyserve run` turns it on).
    disk_cache_bytes: int = 0
    state_dir: str | None = None
    # How assistant output becomes tool calls: a pyserve.chat.tool_calls.PARSERS name, "harmony"
    # (gpt-oss), "auto" (the format the chat template writes, else "generic") or "none" (tools
    # are refused).
    tool_call_parser: str = "auto"
    # Splits <think>...</think> into reasoning_content: a REASONING_PARSERS name, "harmony", or
    # None (a harmony model's thought is split off whatever this says).
    reasoning_parser: str | None = None
    # Embeddings (pyserve/engine/embeddings.py): last | mean | cls, None: the model's default;
    # whether they are scaled to unit length; how /v1/rerank scores (auto | yes-no | cosine).
    pooling: str | None = None
    embedding_normalize: bool = True
    rerank_mode: str = "auto"
    # Speculative decoding (cpp/README.md, "The planner's own drafts"): "ngram" drafts from the
    # request's own prompt and output and from the sequences earlier requests ended with;
    # "standalone" drafts with a second, smaller model in the worker
    # (speculative_draft_model_path, the same vocabulary); either is verified in the batched
    # step; None: off. The draft count is a maximum (each request's adapts to its acceptance and
    # the measured step costs), and a step's decode entries and drafts stay within the budget.
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int = 8
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 4
    speculative_ngram_capacity: int = 131072  # tokens of ended sequences kept to draft from
    speculative_token_budget: int = 16

    def planner_speculation(self) -> dict:
        """The Planner's speculative-decoding options for these settings."""
        if self.speculative_algorithm is None:
            return {}
        if self.speculative_algorithm == "standalone":
            return dict(
                max_draft_tokens=self.speculative_num_draft_tokens,
                speculative_draft_model=True,
                speculative_token_budget=self.speculative_token_budget,
            )
        return dict(
            max_draft_tokens=self.speculative_num_draft_tokens,
            speculative_ngram=True,
            ngram_min_match=self.speculative_ngram_min_match_window_size,
            ngram_max_match=self.speculative_ngram_max_match_window_size,
            ngram_corpus_tokens=self.speculative_ngram_capacity,
            speculative_token_budget=self.speculative_token_budget,
            # a request's next entry runs behind its verify instead of waiting for the result
            speculative_chain=True,
        )

    def resolved_prefill_budget(self) -> tuple[int, int]:
        """(max_prefill_tokens, chunked_prefill_size), the unset ones from the device's defaults.

        A CPU prefills the default model at hundreds of tokens a second, so a step of 8192 prompt
        tokens would stall every running decode for seconds and hand all its first tokens out at
        the end. 512 a step keeps the matmuls large enough to run at full speed and lets requests
        start one after another: at 32 concurrent 256-token prompts both TTFT and output
        throughput improved (benchmarks/RESULTS.md, "Serving").
        """
        budget, chunk = CPU_PREFILL_BUDGET if self.device == "cpu" else GPU_PREFILL_BUDGET
        budget = self.max_prefill_tokens if self.max_prefill_tokens is not None else budget
        chunk = self.chunked_prefill_size if self.chunked_prefill_size is not None else chunk
        return budget, chunk

    def resolved_dtype(self) -> str:
        # auto is float32 on the CPU with or without quantization (the kernels compute in
        # float32: pyserve/worker/dtypes.py), so the KV pool is sized before the worker
        # knows what auto quantization resolves to, and the worker is told this dtype.
        if self.dtype == "auto":
            return "float32" if self.device == "cpu" else "bfloat16"
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be auto, {', '.join(DTYPE_BYTES)}; got {self.dtype!r}")
        return self.dtype

    def resolved_kv_cache_dtype(self) -> str:
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.device, self.resolved_dtype())

    def num_kv_blocks(self, info: ModelInfo) -> int:
        """Blocks in the KV pool for this model (at least one)."""
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_tokens is not None:
            tokens = self.kv_cache_tokens
        else:
            kv = self.resolved_kv_cache_dtype()
            # int8 counts its scales: 68 bytes a (token, head) at head_dim 64 (two float16 scales)
            # against float16's 128, so 1.88x float16's tokens in the same bytes
            scale_bytes = kv_scale_bytes(kv, info.head_dim)
            per_token = info.kv_bytes_per_token(KV_VALUE_BYTES[kv], scale_bytes)
            # the budget is a rank's: each holds K and V of its share of the kv heads
            tokens = self.kv_cache_bytes * self.tp_size // per_token
        return max(1, math.ceil(tokens / self.block_size))

    def worker_settings(self, model_path: str | None, num_blocks: int) -> WorkerSettings:
        """What the worker loads and how it runs it (checked before any process starts)."""
        return WorkerSettings(
            model=model_path,
            num_blocks=num_blocks,
            block_size=self.block_size,
            dtype=self.resolved_dtype(),
            kv_cache_dtype=self.resolved_kv_cache_dtype(),
            quantization=self.quantization,
            activation_bits=self.activation_bits,
            device=self.device,
            backend=self.backend,
            max_model_len=self.max_model_len,
            seed=self.seed,
            mem_fraction_static=self.mem_fraction_static,
            draft_model=self.speculative_draft_model_path,
            mmproj=self.mmproj,
            vision_dtype=self.vision_dtype,
            disk_cache_dir=str(self.disk_tier_dir()) if self.disk_cache_bytes > 0 else "",
            disk_cache_bytes=self.disk_cache_bytes,
        )

    def disk_tier_dir(self) -> Path:
        """The directory the disk tier keeps its block files under (one sub-directory per KV
        layout: the worker names it)."""
        return resolve_state_dir(self.state_dir) / "kv-cache"

    def validate(self) -> None:
        """Raises ValueError on settings that cannot work, before any process starts."""
        self.resolved_kv_cache_dtype()  # checks dtype too
        positive = ("block_size", "max_running_requests", "max_prefill_tokens")
        positive += ("chunked_prefill_size", "tokenizer_workers", "stream_interval", "tp_size")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.schedule_policy not in ("fcfs", "lpm", "priority"):
            raise ValueError(
                f"schedule_policy must be fcfs, lpm or priority, got {self.schedule_policy!r}"
            )
        if self.fairness not in ("none", "tenant"):
            raise ValueError(f"fairness must be none or tenant, got {self.fairness!r}")
        if self.fairness_quantum < 0:
            raise ValueError(f"fairness_quantum must be >= 0, got {self.fairness_quantum}")
        if self.fairness == "tenant" and self.schedule_policy != "fcfs":
            raise ValueError(
                "fairness tenant orders admission by itself: it needs schedule policy fcfs, "
                f"got {self.schedule_policy}"
            )
        from pyserve.chat.harmony import HARMONY
        from pyserve.chat.reasoning import REASONING_PARSERS
        from pyserve.chat.tool_calls import PARSERS

        if self.tool_call_parser not in ("auto", "none", *PARSERS, HARMONY):
            names = ", ".join(("auto", "none", *PARSERS, HARMONY))
            raise ValueError(
                f"tool_call_parser must be one of {names}; got {self.tool_call_parser!r}"
            )
        reasoning_parsers = (*REASONING_PARSERS, HARMONY)
        if self.reasoning_parser is not None and self.reasoning_parser not in reasoning_parsers:
            names = ", ".join(reasoning_parsers)
            raise ValueError(
                f"reasoning_parser must be one of {names}; got {self.reasoning_parser!r}"
            )
        if self.pooling is not None and self.pooling not in ("last", "mean", "cls"):
            raise ValueError(f"pooling must be last, mean or cls; got {self.pooling!r}")
        if self.rerank_mode not in ("auto", "yes-no", "cosine"):
            raise ValueError(
                f"rerank_mode must be auto, yes-no or cosine; got {self.rerank_mode!r}"
            )
        self._validate_speculation()
        if self.request_timeout is not None and not self.request_timeout > 0:  # also NaN
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if not self.step_timeout >= 0:  # also NaN
            raise ValueError(f"step_timeout must be >= 0 (0: never), got {self.step_timeout}")
        # what the worker checks too (quantization, activation bits, backend): checked here first
        self.worker_settings(self.model, 1).validate()
        if self.disk_cache_bytes < 0:
            raise ValueError(f"disk_cache_bytes must be >= 0, got {self.disk_cache_bytes}")
        if self.disk_cache_bytes > 0 and not self.enable_radix_cache:
            raise ValueError(
                "the disk cache holds the prefix cache's blocks: it needs the radix cache"
            )
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")

    def _validate_speculation(self) -> None:
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            raise ValueError(
                f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}; "
                f"got {self.speculative_algorithm!r}"
            )
        standalone = self.speculative_algorithm == "standalone"
        if standalone and not self.speculative_draft_model_path:
            raise ValueError(
                "speculative_algorithm standalone needs speculative_draft_model_path: a smaller "
                "model with the same vocabulary"
            )
        if self.speculative_draft_model_path and not standalone:
            raise ValueError(
                "speculative_draft_model_path is for speculative_algorithm standalone; got "
                f"{self.speculative_algorithm!r}"
            )
        if self.speculative_draft_model_path and self.tp_size > 1:
            raise ValueError("a speculative draft model does not run with tp_size > 1")
        if not 1 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"speculative_num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], "
                f"got {self.speculative_num_draft_tokens}"
            )
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        if not 1 <= low <= high <= MAX_NGRAM_WINDOW:
            raise ValueError(
                "speculative n-gram match windows must satisfy 1 <= min <= max <= "
                f"{MAX_NGRAM_WINDOW}; got {low} and {high}"
            )
        if self.speculative_ngram_capacity < 0:
            raise ValueError(
                f"speculative_ngram_capacity must be >= 0, got {self.speculative_ngram_capacity}"
            )
        if self.speculative_token_budget < 1:
            raise ValueError(
                f"speculative_token_budget must be >= 1, got {self.speculative_token_budget}"
            )

"""ModelRunner: loads a model, its backend and its paged KV cache, and turns a ForwardBatch into
logits."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from pyserve.worker.backends import select_backend
from pyserve.worker.backends.base import Backend, ForwardOutput, model_forward
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.dtypes import default_dtype, kv_scale_bytes, resolve_quantization
from pyserve.worker.image_encoder import ImageEncoder, VisionModel
from pyserve.worker.kv_cache import blocks_for_memory
from pyserve.worker.loading import ModelLoadError, open_checkpoint
from pyserve.worker.loading.progress import LoadProgress
from pyserve.worker.loading.shards import shard_tensors
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.models.decoder import CausalLM
from pyserve.worker.models.moe import SparseMoE
from pyserve.worker.models.weights import load_weights
from pyserve.worker.settings import WorkerSettings
from pyserve.worker.tensor_parallel import TensorParallel, shard_config
from pyserve.worker.weight_packing import Packing

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = {**DTYPES, "int8": torch.int8}  # int8: quantized, with scales (kv_cache.py)
log = logging.getLogger("pyserve.worker")


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of weights a decode step reads whatever its batch: every module's weights in
    the form its forward reads (a module holding a ``packed`` form: that form and its bias, not
    a float copy kept beside it for other batch sizes), each storage counted once (a tied output
    projection is its embedding's), without the token embeddings (one row a token: an
    ``*Embedding`` module, or a tensor whose name says ``embed``). A mixture's experts count by
    the share a token runs, k of E (the average: a batch's tokens may share experts)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            idle = 1.0 - module.top_k / len(module.experts)
            total -= round(decode_weight_bytes(module.experts) * idle)

    def add(t: object) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes

    for module in model.modules():
        if "Embedding" in type(module).__name__:
            continue
        packed = getattr(module, "packed", None)
        if packed is None:
            named = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
            for name, t in named:
                if "embed" not in name:
                    add(t)
            continue
        for part in getattr(packed, "segments", (packed,)):  # a SegmentedWeight: each segment
            for t in (part, *getattr(part, "__dict__", {}).values()):
                add(t)
        add(getattr(module, "bias", None))
    return total


class ModelRunner:
    """One model on one device, with a KV cache of ``settings.num_blocks`` blocks of
    ``settings.block_size`` tokens (WorkerSettings says what each setting means).

    ``dtype`` auto: ``pyserve.worker.dtypes.default_dtype``. ``quantization``: none, int8 or int4
    linear layers (the backend's quantized layers), or auto: the precision a GGUF file holds, on the
    CPU. ``activation_bits``: 16 (default) or 8, what the quantized layers round activations to
    (8: llama.cpp's Q8_1 numerics; the output projection keeps 16). ``kv_cache_dtype``: what K
    and V are stored in; None: the model's dtype. Attention computes in the model's dtype.

    Block ids in ForwardBatch.block_tables index this cache directly (they come from the core's
    BlockAllocator, sized with the same ``num_blocks``).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        tp: TensorParallel | None = None,
        **backend_options: object,
    ):
        """``tp``: this runner is one rank of a tensor-parallel group, and holds its share of
        the model (``self.config`` stays the whole model's: the vocabulary the sampler sees)."""
        settings.validate()
        self.tp = tp
        self.settings = settings
        started = time.perf_counter()
        checkpoint = open_checkpoint(settings.model)
        device = settings.device
        self.quantization = resolve_quantization(
            settings.quantization, device, checkpoint.quantization_hint
        )
        dtype = settings.dtype
        if dtype == "auto":
            dtype = default_dtype(device, self.quantization)
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.dtype_name = dtype
        self.kv_cache_dtype_name = settings.kv_cache_dtype or dtype
        self.family = checkpoint.family
        limit = checkpoint.config.context_length  # sliding windows are real windows
        self.max_model_len = min(limit, settings.max_model_len) if settings.max_model_len else limit
        self.config: ModelConfig = checkpoint.config.served(self.max_model_len)
        # what this process computes: the whole model, or one rank's share of it
        model_config, tensors = self.config, checkpoint.tensors
        if tp is not None:
            tp.set_vocab_size(self.config.vocab_size)
            model_config = shard_config(self.config, tp.size)
            tensors = shard_tensors(tensors, self.config, self.family, tp.rank, tp.size)
            self.device = tp.device
        self.block_size = settings.block_size
        self.num_blocks = settings.num_blocks
        self.backend: Backend = select_backend(
            settings.backend, model_config, self.device, **backend_options
        )
        self.model = CausalLM(
            model_config,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            tp=tp,
        )
        packing = None
        if self.quantization != "none":
            native = settings.quantization == "auto"  # each tensor at the precision it has
            packing = Packing(
                "native" if native else self.quantization,
                self.backend.quantized_layers(self.quantization),
                activation_bits=settings.activation_bits,
                dtype=self.dtype,
            )
        what = checkpoint.path.rsplit("/", 1)[-1]
        if tp is not None:
            what += f" (rank {tp.rank} of {tp.size})"
        progress = LoadProgress(what, len(tensors), sum(t.nbytes for _, t in tensors))
        packed = load_weights(
            self.model,
            self.family,
            tensors,
            checkpoint.path,
            norms_include_offset=checkpoint.norms_include_offset,
            packing=packing,
            progress=progress,
        )
        self.model.eval()
        # a vision model's tower and image facts (None: text only), loaded beside the text model
        self.vision: VisionModel | None = None
        vision = settings.vision_dtype
        self.vision_dtype = self.dtype if vision == "auto" else DTYPES[vision]
        if settings.mmproj is not None:
            self._load_mmproj(checkpoint.path, settings.mmproj)
        else:
            self._load_vision(checkpoint.path, checkpoint.tensors)
        self.quantized_linears = sum(packed.values())
        # projections packed at each precision, e.g. {"int4": 144, "int8": 25} ("mxfp4": MXFP4's
        # own form)
        self.packed_precisions = dict(sorted(packed.items()))
        self.packed_linears = self.model.pack_weights() if self.device.type == "cpu" else 0
        kv_dtype = KV_DTYPES[self.kv_cache_dtype_name]
        if settings.mem_fraction_static is not None:
            self.num_blocks = self._blocks_for_memory(settings.mem_fraction_static, kv_dtype)
        self.kv_cache = self.backend.allocate_kv_cache(
            self.num_blocks, settings.block_size, kv_dtype
        )
        self.backend.prepare_model(self.model)
        info = self.backend.info()
        precisions = ", ".join(f"{n} {bits}" for bits, n in self.packed_precisions.items())
        log.info(
            "%s (%s): backend %s (%s); projections: %s",
            self.config.architecture,
            ", ".join(self.config.features()) or "plain",
            info.name,
            info.reason,
            precisions or self.dtype_name,
        )
        self.load_seconds = time.perf_counter() - started

    def _blocks_for_memory(self, fraction: float, kv_dtype: torch.dtype) -> int:
        config = self.model.config
        scale_bytes = kv_scale_bytes(self.kv_cache_dtype_name, config.head_dim)
        # this rank's heads
        per_token = config.kv_bytes_per_token(kv_dtype.itemsize, scale_bytes)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # one block spare: the Triton backend's decode graphs pad into a scratch block
        blocks = blocks_for_memory(total, free, fraction, per_token * self.block_size) - 1
        if self.tp is not None:
            # the core allocates one pool for every rank: the size each of them can hold
            blocks = self.tp.min_int(blocks)
        log.info(
            "KV pool: %d blocks of %d tokens from mem_fraction_static=%.2f (%.1f of %.1f GiB free)",
            blocks, self.block_size, fraction, free / 2**30, total / 2**30,
        )  # fmt: skip
        return max(1, blocks)

    def _load_vision(self, path: str, tensors: list) -> None:
        """The vision tower of a Hugging Face directory whose config has one; a tower of a
        family without one here serves the model as text only, saying so once."""
        if not os.path.isdir(path):
            return
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path)
        if getattr(hf, "vision_config", None) is None:
            return
        from pyserve.worker.vision import load_vision_weights, vision_tower_for

        tower = vision_tower_for(hf, dtype=self.vision_dtype, device=self.device)
        if tower is None:
            log.warning(
                "%s: its vision tower (%s) is not supported: text only", path, hf.model_type
            )
            return
        load_vision_weights(tower, tensors, path)
        token = getattr(hf, "image_token_id", None)
        if token is None:
            token = getattr(hf, "image_token_index", None)
        if token is None:
            raise ModelLoadError(f"{path}: a vision model without image_token_id")
        mrope = any(layer.rope.mrope_section for layer in self.config.layers)
        self.vision = VisionModel(
            ImageEncoder(tower, device=self.device, dtype=self.vision_dtype),
            int(token),
            # Gemma 3: an image's positions attend to each other both ways in prefill (as
            # transformers' token_type_ids mask does)
            bidirectional=hf.model_type == "gemma3",
            # Qwen2.5-VL: rope positions laid out on each image's merged patch grid
            mrope_merge=int(hf.vision_config.spatial_merge_size) if mrope else None,
        )

    def _load_mmproj(self, path: str, mmproj_path: str) -> None:
        """The vision tower of llama.cpp's ``--mmproj`` file, for the GGUF text model at
        ``path``; ModelLoadError naming both files where they do not fit."""
        from pyserve.mmproj import MmprojError, check_pairing, read_mmproj
        from pyserve.worker.vision import load_vision_weights, vision_tower_for
        from pyserve.worker.vision.mmproj import mmproj_tensors, tower_config

        source = f"{mmproj_path} (the --mmproj of {path})"
        try:
            if os.path.isdir(path):
                raise MmprojError(f"--mmproj {mmproj_path} is for a GGUF model, not {path}")
            mmproj = read_mmproj(mmproj_path)
            hidden = self.config.hidden_size
            token = check_pairing(mmproj, path, hidden)
            if mmproj.family == "qwen2_5_vl" and not any(
                layer.rope.mrope_section for layer in self.config.layers
            ):
                raise MmprojError(
                    f"--mmproj {mmproj_path} does not fit --model {path}: a Qwen2.5-VL "
                    "projector needs the text model's multimodal rope (a qwen2vl GGUF)"
                )
            tower = vision_tower_for(
                tower_config(mmproj, hidden), dtype=self.vision_dtype, device=self.device
            )
            assert tower is not None  # read_mmproj admits our families only
            load_vision_weights(tower, mmproj_tensors(mmproj, source), source)
        except MmprojError as e:
            raise ModelLoadError(str(e)) from None
        self.vision = VisionModel(
            ImageEncoder(tower, device=self.device, dtype=self.vision_dtype),
            token,
            bidirectional=mmproj.family == "gemma3",
            # rope positions laid out on each image's merged patch grid
            mrope_merge=mmproj.scale_factor if mmproj.family == "qwen2_5_vl" else None,
        )

    def executor_options(self) -> dict:
        """What a StepExecutor over this runner needs to know of its vocabulary and images."""
        return {"vocab_size": self.config.vocab_size, "vision": self.vision}

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.nbytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (decode_weight_bytes)."""
        return decode_weight_bytes(self.model)

    @property
    def decoder_stack(self) -> object | None:
        """The whole-stack fast path, where the backend built one."""
        return getattr(self.backend, "stack", None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [S, vocab] for the sampling entries (batch.sample_index), in order."""
        if batch.hidden_index is not None:  # logits only: forward_hidden returns those rows
            batch = dataclasses.replace(batch, hidden_index=None)
        return self._step(batch)  # type: ignore[return-value]

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits, and the final-norm hidden states of ``batch.hidden_index``."""
        assert batch.hidden_index is not None
        return self._step(batch)  # type: ignore[return-value]

    def _step(self, batch: ForwardBatch) -> ForwardOutput:
        # the one choice a step: the backend's fast path where it has one for this batch (a
        # captured graph, every layer in one call), else the model's own layer loop
        fast = self.backend.fast_path(self.model, batch)
        return fast() if fast is not None else model_forward(self.model, self.backend, batch)


__all__ = ["DTYPES", "ModelLoadError", "ModelRunner"]

"""ModelRunner: loads a model and its paged KV cache, and turns a ForwardBatch into logits."""

from __future__ import annotations

import time

import torch

from pyserve.worker.attention import create_attention_backend
from pyserve.worker.batch import ForwardBatch
from pyserve.worker.cpu_decoder import CpuDecoderStack
from pyserve.worker.dtypes import ACTIVATION_BITS, default_dtype, resolve_quantization
from pyserve.worker.kv_cache import PagedKVCache
from pyserve.worker.loading import ModelLoadError, open_checkpoint
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.models.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """One model on one device, with a KV cache of ``num_blocks`` blocks of ``block_size`` tokens.

    ``dtype``: float32, bfloat16, float16, or auto (``pyserve.worker.dtypes.default_dtype``).
    ``quantization``: none, int8 or int4 linear layers (``pyserve.worker.quant``), or auto: the
    precision a GGUF file holds, on the CPU (``pyserve.worker.dtypes.resolve_quantization``).
    ``activation_bits``: 16 (default) or 8, what the quantized layers round activations to (8:
    llama.cpp's Q8_1 numerics, ~1.6x faster matmuls from ~8 rows on; the output projection
    keeps 16).
    ``kv_cache_dtype``: what K and V are stored in; None: the model's dtype (the engine passes
    what ``resolve_kv_cache_dtype`` chose). Attention computes in the model's dtype either way.

    Block ids in ForwardBatch.block_tables index this cache directly (they come from the core's
    BlockAllocator, sized with the same ``num_blocks``).
    """

    def __init__(
        self,
        model: str | None,
        *,
        dtype: str = "float32",
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        max_model_len: int | None = None,
        quantization: str = "none",
        kv_cache_dtype: str | None = None,
        activation_bits: int = 16,
    ):
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (auto, {', '.join(DTYPES)})")
        if activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits must be 8 or 16, not {activation_bits}")
        if kv_cache_dtype is not None and kv_cache_dtype not in DTYPES:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} is not supported ({', '.join(DTYPES)})"
            )
        resolve_quantization(quantization, device, None)  # bad settings fail before loading
        started = time.perf_counter()
        checkpoint = open_checkpoint(model)
        self.quantization = resolve_quantization(quantization, device, checkpoint.quantization_hint)
        if dtype == "auto":
            dtype = default_dtype(device, self.quantization)
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.dtype_name = dtype
        self.kv_cache_dtype_name = kv_cache_dtype or dtype  # None: K and V in the model's dtype
        self.config: ModelConfig = checkpoint.config
        limit = self.config.max_model_len
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model = LlamaForCausalLM(self.config, dtype=self.dtype, device=self.device)
        self.model.load_weights(checkpoint.tensors(), checkpoint.path)
        self.model.eval()
        self.quantized_linears = 0
        if self.quantization != "none":
            from pyserve.worker.quant import DEFAULT_ACTIVATION_BITS, quantize_model_linears

            # before packing: it needs the plain [out, in] weights, and packs its own
            # the output projection decides the tokens and runs on few rows (the sampled ones):
            # it keeps int16 activations whatever the layers use
            replaced = quantize_model_linears(
                self.model,
                self.quantization,
                activation_bits=activation_bits,
                head_activation_bits=DEFAULT_ACTIVATION_BITS,
            )
            self.quantized_linears = len(replaced)
        self.packed_linears = self.model.pack_weights() if self.device.type == "cpu" else 0
        self.kv_cache = PagedKVCache(
            num_layers=self.config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=DTYPES[self.kv_cache_dtype_name],
            device=self.device,
        )
        self.attention = create_attention_backend(
            self.device,
            self.kv_cache,
            num_heads=self.config.num_heads,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
        )
        # the decoder layers in one C++ call where every piece runs on the kernels (cpu_decoder.py)
        self.model.decoder_stack = CpuDecoderStack.build(self.model, self.kv_cache, self.attention)
        self.load_seconds = time.perf_counter() - started

    @property
    def decoder_stack(self) -> CpuDecoderStack | None:
        """The C++ decoder layers the model runs, or None (its modules)."""
        return self.model.decoder_stack

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.nbytes

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [S, vocab] for the sampling entries (batch.sample_index), in order."""
        metadata = self.attention.prepare(batch)
        return self.model(
            batch.input_ids.to(self.device),
            batch.positions.to(self.device),
            batch.sample_index.to(self.device),
            self.attention,
            metadata,
        )


__all__ = ["DTYPES", "ModelLoadError", "ModelRunner"]

"""MXFP4 expert tensors of Hugging Face checkpoints (gpt-oss as OpenAI publishes it), read as
GGML's MXFP4 blocks.

Such a checkpoint stores each layer's experts as ``experts.gate_up_proj_blocks`` [experts,
outputs, groups, 16] (two 4-bit e2m1 codes a byte, the even element in the low nibble) with
``experts.gate_up_proj_scales`` [experts, outputs, groups] (each group of 32 inputs scaled by
2^(scale − 127)), and ``down_proj`` alike; the values are transformers' FP4 table. GGML's MXFP4
block holds the same group as the scale byte followed by 16 bytes whose low nibbles are the
first 16 codes and high nibbles the last 16, with the table doubled and the exponent one less:
the same numbers. So each expert's rows become GGML blocks byte for byte, and the loader packs
or decodes them as it does a GGUF file's MXFP4 tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from pyserve.worker.loading.base import ModelLoadError, StoredTensor

BLOCK = 32  # weights a group
GGML_BLOCK_BYTES = 17


def ggml_blocks(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint8 [rows, groups·17]: GGML MXFP4 rows from transformers' packed codes [rows, groups,
    16] and scales [rows, groups]."""
    rows, groups, _ = codes.shape
    elements = np.empty((rows, groups, BLOCK), np.uint8)
    elements[..., 0::2] = codes & 0x0F
    elements[..., 1::2] = codes >> 4
    out = np.empty((rows, groups, GGML_BLOCK_BYTES), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = elements[..., :16] | (elements[..., 16:] << 4)
    return out.reshape(rows, groups * GGML_BLOCK_BYTES)


class MXFP4ExpertSlice(StoredTensor):
    """One expert's outputs ``start``, ``start + step``, ... (``count`` of them) of a packed
    expert tensor, as GGML MXFP4 rows [count, inputs]."""

    type_name = "MXFP4"

    def __init__(
        self,
        file: str,
        blocks_name: str,
        scales_name: str,
        shape: tuple[int, ...],  # the blocks' [experts, outputs, groups, 16]
        expert: int,
        start: int,
        step: int,
        count: int,
    ):
        self.file, self.name = file, f"{blocks_name}[{expert}]"
        self._names = (blocks_name, scales_name)
        self.expert, self.start, self.step = expert, start, step
        groups = shape[2]
        self.shape = (count, groups * BLOCK)
        self.nbytes = count * groups * GGML_BLOCK_BYTES

    @property
    def quantized(self) -> bool:
        return True

    @property
    def native_bits(self) -> int | None:
        return 4

    def blocks(self) -> np.ndarray:
        from safetensors import safe_open

        stop = self.start + self.step * self.shape[0]
        try:
            with safe_open(self.file, framework="pt") as f:
                codes, scales = (
                    f.get_slice(name)[self.expert : self.expert + 1][0] for name in self._names
                )
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise ModelLoadError(
                f"{self.file}: cannot read tensor {self._names[0]!r} (corrupt or truncated: {e})"
            ) from None
        codes = codes[self.start : stop : self.step].numpy()
        scales = scales[self.start : stop : self.step].numpy()
        return ggml_blocks(codes, scales)

    def values(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType, dequantize

        values = dequantize(self.blocks(), GGMLQuantizationType.MXFP4)
        return torch.from_numpy(values).reshape(self.shape)

"""Hugging Face model directories: config.json plus safetensors (one file, or shards + index)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from pyserve.model_files import ModelFilesError, ModelSource, read_model_info
from pyserve.worker.loading.base import Checkpoint, ModelLoadError, StoredTensor
from pyserve.worker.loading.mxfp4 import MXFP4ExpertSlice
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.models.layout import FusedExperts
from pyserve.worker.models.registry import Family, UnsupportedArchitecture, family_for_hf
from pyserve.worker.rope import check_rope

INDEX_FILE = "model.safetensors.index.json"


def open_hf_checkpoint(source: ModelSource) -> Checkpoint:
    directory = Path(source.path)
    family, config = read_hf_config(source)
    files = safetensors_files(directory)
    tensors = unfused_experts([item for file in files for item in _list_tensors(file)], family)
    return Checkpoint(
        path=str(directory),
        config=config,
        family=family,
        tensors=tensors,
        # MXFP4 experts (gpt-oss as published): served packed, each at its own precision (the
        # float projections at 8 bits), as a GGUF with 4-bit experts is
        quantization_hint="int4" if any(t.quantized for _, t in tensors) else None,
    )


def read_hf_config(source: ModelSource) -> tuple[Family, ModelConfig]:
    """The family and the description of a Hugging Face directory's model, read through
    transformers' own config classes (their defaults, layer types and rope parameters)."""
    path = Path(source.path) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read it ({e})") from None
    model_type = raw.get("text_config", {}).get("model_type") or raw.get("model_type")
    try:
        family = family_for_hf(model_type)
    except UnsupportedArchitecture as e:
        raise ModelLoadError(f"{path}: {e}") from None
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(source.path)).get_text_config()
        info = read_model_info(source)
        config = family.config_from_hf(hf, source.name, info.eos_token_ids, info.bos_token_id)
        for layer in config.layers:
            check_rope(layer.rope)
        return family, config
    except (AttributeError, KeyError, TypeError, ValueError, ModelFilesError) as e:
        raise ModelLoadError(f"{path}: missing or invalid field ({e})") from None


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's files: the shards named by the index, or every *.safetensors."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: cannot read the shard index ({e!r})") from None
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        hint = ""
        if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
            hint = " (pickle checkpoints .bin/.pt are not loaded: convert them to safetensors)"
        raise ModelLoadError(f"{directory}: no *.safetensors weights{hint}")
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file}: missing (listed in {INDEX_FILE})")
    return files


class SafetensorsTensor(StoredTensor):
    """A tensor of a safetensors file (or rows [start, stop) of one), read through safetensors'
    own lazy loading when asked."""

    def __init__(
        self,
        file: Path | str,
        name: str,
        shape: tuple[int, ...],
        dtype: str,
        nbytes: int,
        rows: tuple[int, int] | None = None,
    ):
        self.file, self.name, self.shape = str(file), name, shape
        self.type_name, self.nbytes, self.rows = dtype, nbytes, rows

    def values(self) -> torch.Tensor:
        from safetensors import safe_open

        # Opened per tensor: the file's memory map (whose pages count in the process's memory
        # while it is mapped) goes when the tensor is read, so it never holds the whole file.
        try:
            with safe_open(self.file, framework="pt") as f:
                if self.rows is None:
                    return f.get_tensor(self.name)
                start, stop = self.rows
                return f.get_slice(self.name)[start:stop].contiguous()
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise ModelLoadError(
                f"{self.file}: cannot read tensor {self.name!r} (corrupt or truncated: {e})"
            ) from None

    def pieces(self, rows: int) -> Iterator[StoredTensor]:
        if len(self.shape) != 2 or self.shape[0] <= rows or self.rows is not None:
            yield self
            return
        n = self.shape[0]
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            shape = (stop - start, *self.shape[1:])
            nbytes = self.nbytes * (stop - start) // n
            yield SafetensorsTensor(
                self.file, self.name, shape, self.type_name, nbytes, (start, stop)
            )


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}


def _list_tensors(file: Path) -> list[tuple[str, StoredTensor]]:
    """The file's tensors from its header (nothing else is read), checked against its size."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            listed = []
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                part = f.get_slice(name)
                dtype, shape = part.get_dtype(), tuple(int(n) for n in part.get_shape())
                nbytes = math.prod(shape) * _DTYPE_BYTES.get(dtype, 1)
                listed.append((name, SafetensorsTensor(file, name, shape, dtype, nbytes)))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({e})") from None
    return listed


# a layer's fused experts: "<prefix>.experts.gate_up_proj", "..._bias", "<prefix>.experts.down_proj"
_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)(_bias)?")


def unfused_experts(
    tensors: list[tuple[str, StoredTensor]], family: Family
) -> list[tuple[str, StoredTensor]]:
    """``tensors`` with each fused 3-D expert tensor (``Family.hf_fused_experts``) replaced by
    its per-expert parts, named as per-expert checkpoints name them ("...experts.3.up_proj.
    weight"); each part reads only its expert's slice."""
    fused = family.hf_fused_experts
    if fused is None:
        return tensors
    gate, up, down = family.hf_expert_names
    by_name = dict(tensors)
    out: list[tuple[str, StoredTensor]] = []
    for name, tensor in tensors:
        packed = _MXFP4_EXPERTS.fullmatch(name)
        if packed is not None:
            out += _mxfp4_experts(packed, tensor, by_name, fused, (gate, up, down))
            continue
        if name.endswith("_scales") and _MXFP4_EXPERTS.fullmatch(name[: -len("scales")] + "blocks"):
            continue  # read with its blocks
        match = _FUSED_EXPERTS.fullmatch(name)
        if match is None or not isinstance(tensor, SafetensorsTensor):
            out.append((name, tensor))
            continue
        prefix, proj, bias = match.groups()
        kind = "bias" if bias else "weight"
        for expert in range(tensor.shape[0]):
            if proj == "down_proj":
                parts = [(down, 0, 1, None)]
            else:
                outputs = tensor.shape[-1] if (fused.transposed or bias) else tensor.shape[1]
                width = outputs // 2
                parts = (
                    [(gate, 0, 2, width), (up, 1, 2, width)]
                    if fused.interleaved
                    else [(gate, 0, 1, width), (up, width, 1, width)]
                )
            for part, start, step, count in parts:
                piece = ExpertSlice(tensor, expert, fused, start, step, count)
                out.append((f"{prefix}.{expert}.{part}.{kind}", piece))
    return out


# the same, as MXFP4 codes and scales (gpt-oss as published: loading/mxfp4.py)
_MXFP4_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)_blocks")


def _mxfp4_experts(
    match: re.Match,
    blocks: StoredTensor,
    by_name: dict[str, StoredTensor],
    fused: FusedExperts,
    names: tuple[str, str, str],
) -> list[tuple[str, StoredTensor]]:
    """Each expert's parts of an MXFP4 expert tensor (its rows are the outputs, [out, in] as a
    projection's, whatever ``fused.transposed`` says of the float form)."""
    prefix, proj = match.groups()
    scales_name = f"{prefix}.{proj}_scales"
    scales = by_name.get(scales_name)
    shape = blocks.shape
    if scales is None or len(shape) != 4 or tuple(scales.shape) != tuple(shape[:3]):
        raise ModelLoadError(
            f"{blocks.file}: {blocks.name!r} {list(shape)} needs {scales_name!r} of shape "
            f"{list(shape[:3])}"
        )
    gate, up, down = names
    outputs = shape[1]
    if proj == "down_proj":
        parts = [(down, 0, 1, outputs)]
    elif fused.interleaved:
        parts = [(gate, 0, 2, outputs // 2), (up, 1, 2, outputs // 2)]
    else:
        parts = [(gate, 0, 1, outputs // 2), (up, outputs // 2, 1, outputs // 2)]
    return [
        (
            f"{prefix}.{expert}.{part}.weight",
            MXFP4ExpertSlice(
                blocks.file, blocks.name, scales_name, shape, expert, start, step, count
            ),
        )
        for expert in range(shape[0])
        for part, start, step, count in parts
    ]


class ExpertSlice(StoredTensor):
    """One expert's outputs of a fused expert tensor ([out, in] or [out]), read alone: outputs
    ``start``, ``start + step``, ... (``count`` of them; None: all)."""

    def __init__(
        self,
        source: SafetensorsTensor,
        expert: int,
        fused: FusedExperts,
        start: int,
        step: int,
        count: int | None,
    ):
        self.source, self.expert, self.start, self.step = source, expert, start, step
        self.transpose = fused.transposed and len(source.shape) == 3
        per_expert = source.shape[1:]
        if self.transpose:
            per_expert = per_expert[::-1]
        outputs = per_expert[0] if count is None else count
        self.shape = (outputs, *per_expert[1:])
        self.file, self.type_name = source.file, source.type_name
        self.name = f"{source.name}[{expert}]"
        self.nbytes = source.nbytes // source.shape[0] * outputs // per_expert[0]

    def values(self) -> torch.Tensor:
        from safetensors import safe_open

        try:
            with safe_open(self.source.file, framework="pt") as f:
                t = f.get_slice(self.source.name)[self.expert : self.expert + 1][0]
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise ModelLoadError(
                f"{self.file}: cannot read tensor {self.source.name!r} (corrupt or truncated: {e})"
            ) from None
        if self.transpose:
            t = t.T
        stop = self.start + self.step * self.shape[0]
        return t[self.start : stop : self.step].contiguous()

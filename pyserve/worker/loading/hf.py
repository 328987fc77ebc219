"""Hugging Face model directories: config.json plus safetensors (one file, or shards + index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pyserve.model_files import ModelFilesError, ModelSource, read_model_info
from pyserve.worker.loading.base import Checkpoint, ModelLoadError
from pyserve.worker.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

INDEX_FILE = "model.safetensors.index.json"


def open_hf_checkpoint(source: ModelSource) -> Checkpoint:
    directory = Path(source.path)
    config = read_hf_config(source)
    files = safetensors_files(directory)
    return Checkpoint(path=str(directory), config=config, tensors=lambda: _iter_tensors(files))


def read_hf_config(source: ModelSource) -> ModelConfig:
    path = Path(source.path) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read it ({e})") from None
    cfg = raw.get("text_config", raw)
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{path}: mlp_bias is not supported")
    try:
        info = read_model_info(source)
        heads = int(cfg["num_attention_heads"])
        rope_theta, rope_scaling = _rope_settings(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen2 carries a window size it does not use unless asked
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch != "qwen2" and attention_bias,
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=info.eos_token_ids,
            bos_token_id=info.bos_token_id,
            name=source.name,
        )
    except (KeyError, TypeError, ValueError, ModelFilesError) as e:
        raise ModelLoadError(f"{path}: missing or invalid field ({e!r})") from None


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """rope_theta and scaling, from transformers 5 ``rope_parameters`` or the older fields."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params = dict(params)
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope type {rope_type!r} (supported: default, linear, llama3)")
    params["rope_type"] = rope_type
    return theta, (None if rope_type == "default" else params)


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


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({e})") from None

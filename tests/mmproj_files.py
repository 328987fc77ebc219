"""Tiny vision models as llama.cpp users download them: a text GGUF and an ``--mmproj`` projector
GGUF, both written by llama.cpp's own ``convert_hf_to_gguf.py`` (the one benchmarks/compare.py
builds llama-server from) from a ``vision_models.build_tiny_vlm`` checkpoint, whose
``references.json`` (transformers on the HF weights) the served answers are compared with.

The converter takes what released checkpoints hold, so the HF directory it reads is shaped as
those are (the copy under ``release/``; the references stay those of the original):

- SmolVLM: ``text_config.architectures`` names ``VLlama3ForCausalLM``, which routes the text
  model to llama.cpp's Llama converter;
- Gemma 3: the SigLIP tensors under ``vision_tower.vision_model.`` (Google's names;
  transformers 5 saves them without ``vision_model.``), and unused tokens that fill the
  vocabulary up to the embedding's rows, as Gemma's tokenizer has them (the converter cuts the
  token embedding to the tokenizer's length, which would leave it shorter than the output
  projection and the GGUF's vocabulary); released Gemma 3's attention scale (head_dim) and local
  layers (five of six: both of two), for which the GGUF has no keys; and an input projection
  that is not zeros, so that the image reaches the text model;
- Qwen2.5-VL: a vision depth of 3 (the converter's tensor map numbers the merger's ``mlp.2`` as
  a block, so it needs more than two), the released model's 112-pixel attention window (the
  mmproj has no key for it: llama.cpp assumes 112) and its image-size limits (likewise).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from llama_cpp_source import required_converter
from vision_models import build_tiny_vlm

# per family: what build_tiny_vlm takes beside the cases
CONVERTIBLE = {
    "idefics3": {},
    # released Gemma 3's attention scale and layer pattern (the GGUF has no key for either:
    # llama.cpp scales by head_dim and makes five of six layers local)
    "gemma3": {
        "text": {
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "sliding_attention"],
        },
    },
    "qwen2_5_vl": {
        "vision": {"depth": 3, "window_size": 112, "fullatt_block_indexes": [1]},
        # Qwen2.5-VL's released limits, 4 to 16384 merged 8x8-pixel patches here
        "image_processor": {"min_pixels": 4 * 64, "max_pixels": 16384 * 64},
    },
}


def converted_vlm(base: Path, family: str, cases: list[dict], max_new_tokens: int) -> Path:
    """``base/family`` holding the HF model (``hf/``, with references.json), ``model.gguf`` and
    ``mmproj.gguf`` (float32); built once per ``base`` and reused."""
    out = base / family
    if (out / "mmproj.gguf").is_file():
        return out
    hf = build_tiny_vlm(
        out / "hf",
        family=family,
        seed=0,
        cases=cases,
        max_new_tokens=max_new_tokens,
        **CONVERTIBLE[family],
    )
    convert_vlm(hf, out, family, "f32")
    return out


def convert_vlm(hf: Path, out: Path, family: str, outtype: str, timeout: float = 300) -> None:
    """``out/model.gguf`` and ``out/mmproj.gguf`` from the HF model ``hf`` by llama.cpp's
    converter (``outtype`` f32 or f16), through a copy shaped as released checkpoints are."""
    release = _as_released(hf, out / "release", family)
    source = required_converter()
    for target, extra in ((out / "model.gguf", []), (out / "mmproj.gguf", ["--mmproj"])):
        done = subprocess.run(
            [sys.executable, str(source / "convert_hf_to_gguf.py"), str(release),
             "--outfile", str(target), "--outtype", outtype, *extra],
            env={**os.environ, "PYTHONPATH": str(source / "gguf-py")},
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{family} {target.name}: {done.stderr[-2000:]}"
    shutil.rmtree(release)


def _as_released(hf: Path, out: Path, family: str) -> Path:
    """A copy of ``hf`` with the names released checkpoints of ``family`` use."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(hf, out)
    if family == "idefics3":
        config = json.loads((out / "config.json").read_text())
        config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
        (out / "config.json").write_text(json.dumps(config))
    if family == "gemma3":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(out / "model.safetensors")
        renamed = {
            _google_name(name): value for name, value in tensors.items()
        }  # numpy: no torch in the test process
        save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
        _fill_vocabulary(out / "tokenizer.json", json.loads((out / "config.json").read_text()))
    return out


def _fill_vocabulary(tokenizer_file: Path, config: dict) -> None:
    tokenizer = json.loads(tokenizer_file.read_text())
    size = config["text_config"]["vocab_size"]
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]
    for index, token_id in enumerate(range(max(ids) + 1, size)):
        tokenizer["added_tokens"].append(
            {"id": token_id, "content": f"<unused{index}>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip
    tokenizer_file.write_text(json.dumps(tokenizer))


def _google_name(name: str) -> str:
    for prefix in ("model.vision_tower.", "vision_tower."):
        if name.startswith(prefix) and not name.startswith(prefix + "vision_model."):
            return prefix + "vision_model." + name[len(prefix) :]
    return name


def rewritten_gguf(
    source: Path, target: Path, *, drop: str | None = None, fields: dict | None = None
) -> Path:
    """A copy of the GGUF ``source`` without tensor ``drop`` and with ``fields`` (key -> str,
    int or float) set: the broken files the start-up checks are tried on."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(target, arch)
    changes = dict(fields or {})
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = changes.pop(key, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub)
    for key, value in changes.items():
        kind = {str: GGUFValueType.STRING, int: GGUFValueType.UINT32}.get(
            type(value), GGUFValueType.FLOAT32
        )
        writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        if tensor.name != drop:
            shape = [int(n) for n in reversed(tensor.shape)]
            writer.add_tensor(tensor.name, tensor.data.reshape(shape), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target

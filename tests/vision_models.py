"""Tiny random-weight vision-language models for the tests, saved as their checkpoints are.

``build_tiny_vlm`` saves, with SmolLM2's tokenizer plus the family's added tokens, its image
processor and processor settings:

- ``idefics3``: SmolVLM's architecture (a SigLIP tower, pixel shuffle, a Llama), SmolVLM's tokens
  (``<image>``, ``<fake_token_around_image>``, ``<global-img>``, ``<row_i_col_j>``,
  ``<end_of_utterance>``) and chat template (``templates/smolvlm.jinja``);
- ``gemma3``: a SigLIP tower with Gemma 3's pooling projector and a Gemma 3 text model (a local
  and a global layer), Gemma's image tokens (named in the tokenizer config as Google's are) and
  chat template (``templates/gemma3.jinja``).

Built in a subprocess (this file run as a script), as ``tiny_models.py`` builds its models: the
test processes stay torch-free. It records transformers' greedy outputs for each case (its own
processor, float32), with the top logprobs at every position.

An image is given as ``[height, width, seed]``: seeded random RGB pixels (``random_picture``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tiny_models import LOGIT_SCALE, SMOLLM2_VOCAB

TEMPLATES = Path(__file__).parent / "templates"
IDEFICS3_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]
GEMMA3_TOKENS = [
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "<start_of_turn>",
    "<end_of_turn>",
]
GEMMA3_NAMED_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
QWEN2_5_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TINY_VLM_VOCAB = SMOLLM2_VOCAB + 128  # room for the added tokens, as SmolVLM's 49280
# the language model's and the vision tower's tiny shapes (a large init range: distinct logits)
TEXT_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,
}
VISION_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "initializer_range": 0.2,
}
TOP_LOGPROBS = 5
QUESTION = "What is in this picture?"
PICTURE = [100, 150, 1]  # height, width, seed
# the end-to-end tests' conversations: one picture, then two pictures in one message
IMAGE_CASES = [
    {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
        ],
        "images": [PICTURE],
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image"},
                    {"type": "text", "text": "and"},
                    {"type": "image"},
                ],
            }
        ],
        "images": [[40, 50, 2], [64, 64, 3]],
    },
]


def random_picture(height: int, width: int, seed: int, *, alter_pixel: bool = False):
    """Seeded random RGB pixels as a PIL image (one pixel changed where ``alter_pixel``)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    if alter_pixel:
        pixels[0, 0, 0] ^= 1
    return Image.fromarray(pixels)


def png_base64(height: int, width: int, seed: int, alter_pixel: bool = False) -> str:
    """``random_picture`` as base64 PNG bytes."""
    import base64
    import io

    out = io.BytesIO()
    random_picture(height, width, seed, alter_pixel=alter_pixel).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def data_url(height: int, width: int, seed: int, alter_pixel: bool = False) -> str:
    """``random_picture`` as the data: URL of a PNG (what clients send)."""
    return "data:image/png;base64," + png_base64(height, width, seed, alter_pixel)


def build_tiny_vlm(
    directory: Path,
    *,
    family: str,
    seed: int,
    cases: Sequence[dict] = (),
    max_new_tokens: int = 0,
    sliding_window: int = 4096,
    text: dict | None = None,
    vision: dict | None = None,
    image_processor: dict | None = None,
) -> Path:
    """Saves the ``family`` model (``idefics3``, ``gemma3`` or ``qwen2_5_vl``) in ``directory``
    and writes ``references.json``: for each case (``{"messages": [...], "images": [[h, w, seed,
    alter_pixel?], ...]}``, messages in the OpenAI form whose image parts are
    ``{"type": "image"}``), HF's prompt ids, greedy output of ``max_new_tokens`` tokens and top
    logprobs at every position. ``sliding_window``: Gemma 3's local layers' window. ``text``
    (Gemma 3), ``vision`` and ``image_processor``: settings that replace the family's tiny
    text config's, vision config's and image processor's (a shape llama.cpp's converter takes,
    limits as its runtime reads them)."""
    spec = {
        "directory": str(directory),
        "family": family,
        "seed": seed,
        "cases": list(cases),
        "max_new_tokens": max_new_tokens,
        "sliding_window": sliding_window,
        "text": text or {},
        "vision": vision or {},
        "image_processor": image_processor or {},
    }
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
        check=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    return directory


def _smollm_tokenizer(out: Path, added: Sequence[str]):
    """SmolLM2's tokenizer with ``added`` special tokens, its files copied into ``out``."""
    import shutil

    from tokenizers import AddedToken

    from pyserve.model_files import load_tokenizer, resolve_model, tokenizer_dir

    source = resolve_model(None)
    for f in tokenizer_dir(source).iterdir():
        shutil.copy(f, out / f.name)
    tok = load_tokenizer(source)
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in added], special_tokens=True
    )
    return tok


def gemma3_tokenizer(out: Path):
    """SmolLM2's tokenizer with Gemma 3's image tokens, named in its config as Google's
    tokenizer names them (``boi_token``, ...), and Gemma 3's chat template, saved in ``out``."""
    from transformers import AutoTokenizer

    tok = _smollm_tokenizer(out, GEMMA3_TOKENS)
    tok.chat_template = (TEMPLATES / "gemma3.jinja").read_text()
    tok.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["extra_special_tokens"] = GEMMA3_NAMED_TOKENS
    config_file.write_text(json.dumps(tokenizer_config))
    return AutoTokenizer.from_pretrained(out)


def idefics3_tokenizer(out: Path):
    """SmolLM2's tokenizer with SmolVLM's added tokens and chat template."""
    tok = _smollm_tokenizer(out, IDEFICS3_TOKENS)
    tok.chat_template = (TEMPLATES / "smolvlm.jinja").read_text()
    return tok


def _idefics3(out: Path, spec: dict):
    """(model, processor) of a tiny Idefics3 with SmolVLM's tokens and template."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    tok = idefics3_tokenizer(out)
    torch.manual_seed(spec["seed"])
    text = LlamaConfig(vocab_size=TINY_VLM_VOCAB, **TEXT_SHAPE, max_position_embeddings=4096)
    vision = Idefics3VisionConfig(
        **{**VISION_SHAPE, "image_size": 64, "patch_size": 8, **spec["vision"]}
    )
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    model = Idefics3ForConditionalGeneration(config).eval()
    image_processor = Idefics3ImageProcessorPil(
        **{"max_image_size": {"longest_edge": 64}, "size": {"longest_edge": 128}}
        | spec["image_processor"]
    )
    seq_len = (64 // 8) ** 2 // 4  # patches per tile / scale_factor²
    return model, Idefics3Processor(image_processor, tokenizer=tok, image_seq_len=seq_len)


def _gemma3(out: Path, spec: dict):
    """(model, processor) of a tiny Gemma 3 with its image tokens and template."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    tok = gemma3_tokenizer(out)
    torch.manual_seed(spec["seed"])
    text = Gemma3TextConfig(
        vocab_size=TINY_VLM_VOCAB,
        **TEXT_SHAPE,
        head_dim=16,
        max_position_embeddings=4096,
        sliding_window=spec["sliding_window"],
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=1,  # sharp attention: the image's two-way attention shows
        tie_word_embeddings=False,
    )
    for key, value in spec["text"].items():
        setattr(text, key, value)
    vision = SiglipVisionConfig(
        **{**VISION_SHAPE, "image_size": 32, "patch_size": 4, **spec["vision"]}
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=16,
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        tie_word_embeddings=False,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        # transformers initializes the input projection to zeros, which would hide the image
        # from the text model; seeded values that float16 holds exactly (llama.cpp's converter
        # stores it in F16)
        weight = model.model.multi_modal_projector.mm_input_projection_weight
        weight.copy_((torch.randn_like(weight) * 0.2).half().float())
    image_processor = Gemma3ImageProcessorPil(
        **{"size": {"height": 32, "width": 32}} | spec["image_processor"]
    )
    return model, Gemma3Processor(image_processor, tokenizer=tok, image_seq_length=16)


class _QwenInputs:
    """Qwen2.5-VL's processor for images, from its image processor and the template's
    placeholder expansion: transformers' own processor needs torchvision (its video half)."""

    def __init__(self, image_processor, tokenizer) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer

    def __call__(self, text: str, images: list | None, **encode):
        inputs = {}
        if images:
            inputs = dict(self.image_processor(images[0], return_tensors="pt"))
            merged = self.image_processor.merge_size**2
            pieces = text.split("<|image_pad|>")
            counts = [int(grid.prod()) // merged for grid in inputs["image_grid_thw"]]
            text = pieces[0] + "".join(
                "<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:], strict=True)
            )
        encoded = self.tokenizer(text, **encode)
        image_token = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        encoded["mm_token_type_ids"] = (encoded["input_ids"] == image_token).int()
        return {**encoded, **inputs}

    def save_pretrained(self, out: Path) -> None:
        self.image_processor.save_pretrained(out)


def _qwen2_5_vl(out: Path, spec: dict):
    """(model, processor) of a tiny Qwen2.5-VL with its vision tokens and template."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tok = _smollm_tokenizer(out, QWEN2_5_VL_TOKENS)
    tok.chat_template = (TEMPLATES / "qwen2_5_vl.jinja").read_text()
    torch.manual_seed(spec["seed"])
    text = {
        **TEXT_SHAPE,
        "vocab_size": TINY_VLM_VOCAB,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "tie_word_embeddings": False,
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 4,
        "out_hidden_size": TEXT_SHAPE["hidden_size"],
        "patch_size": 4,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "window_size": 16,
        "fullatt_block_indexes": [1],
        "initializer_range": 0.2,
        **spec["vision"],
    }
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN2_5_VL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    image_processor = Qwen2VLImageProcessorPil(
        **{
            "patch_size": 4,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "min_pixels": 8 * 8,
            "max_pixels": 48 * 48,
        }
        | spec["image_processor"]
    )
    return model, _QwenInputs(image_processor, tok)


def _build_here(spec: dict) -> None:
    import torch

    torch.set_num_threads(2)
    out = Path(spec["directory"])
    out.mkdir(parents=True, exist_ok=True)
    builders = {"idefics3": _idefics3, "gemma3": _gemma3, "qwen2_5_vl": _qwen2_5_vl}
    model, processor = builders[spec["family"]](out, spec)
    tok = processor.tokenizer
    with torch.no_grad():  # spread the logits: random init ties every argmax
        embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if lm_head is embed:
            embed.mul_(LOGIT_SCALE**0.5)
        else:
            lm_head.mul_(LOGIT_SCALE)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    refs = []
    max_new = spec["max_new_tokens"]
    with torch.no_grad():
        for case in spec["cases"] if max_new else []:
            rendered = tok.apply_chat_template(
                case["messages"], tokenize=False, add_generation_prompt=True
            )
            images = [
                random_picture(h, w, s, alter_pixel=bool(a)) for h, w, s, *a in case["images"]
            ]
            inputs = processor(
                text=rendered,
                images=[images] if images else None,
                add_special_tokens=False,
                return_tensors="pt",
            )
            gen = model.generate(
                **inputs,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
            prompt = inputs["input_ids"][0].tolist()
            logprobs = torch.stack(gen.logits)[:, 0].float().log_softmax(-1)
            top = logprobs.topk(TOP_LOGPROBS)
            refs.append(
                {
                    "prompt": prompt,
                    "output": gen.sequences[0, len(prompt) :].tolist(),
                    "top_ids": top.indices.tolist(),
                    "top_logprobs": top.values.tolist(),
                }
            )
    (out / "references.json").write_text(json.dumps(refs))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _build_here(json.loads(sys.argv[1]))

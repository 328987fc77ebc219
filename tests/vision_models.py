"""Tiny random-weight vision-language models for the tests, saved as their checkpoints are.

``build_tiny_idefics3``: Idefics3 (SmolVLM's architecture: a SigLIP tower, pixel shuffle, a
Llama) with SmolLM2's tokenizer plus SmolVLM's added tokens (``<image>``,
``<fake_token_around_image>``, ``<global-img>``, ``<row_i_col_j>``, ``<end_of_utterance>``), its
image processor and processor settings, and SmolVLM's chat template (``templates/smolvlm.jinja``).
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
IDEFICS3_VOCAB = SMOLLM2_VOCAB + 128  # room for the added tokens, as SmolVLM's 49280
TOP_LOGPROBS = 5


def random_picture(height: int, width: int, seed: int, *, alter_pixel: bool = False):
    """Seeded random RGB pixels as a PIL image (one pixel changed where ``alter_pixel``)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    if alter_pixel:
        pixels[0, 0, 0] ^= 1
    return Image.fromarray(pixels)


def build_tiny_idefics3(
    directory: Path, *, seed: int, cases: Sequence[dict] = (), max_new_tokens: int = 0
) -> Path:
    """Saves the model in ``directory`` and writes ``references.json``: for each case
    (``{"messages": [...], "images": [[h, w, seed, alter_pixel?], ...]}``, messages in the
    OpenAI form whose image parts are ``{"type": "image"}``), HF's prompt ids, greedy output of
    ``max_new_tokens`` tokens and top logprobs at every position."""
    spec = {
        "directory": str(directory),
        "seed": seed,
        "cases": list(cases),
        "max_new_tokens": max_new_tokens,
    }
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
        check=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    return directory


def _build_here(spec: dict) -> None:
    import shutil

    import torch
    from tokenizers import AddedToken
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    from pyserve.model_files import load_tokenizer, resolve_model, tokenizer_dir

    torch.set_num_threads(2)
    out = Path(spec["directory"])
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model(None)
    for f in tokenizer_dir(source).iterdir():
        shutil.copy(f, out / f.name)
    tok = load_tokenizer(source)
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in IDEFICS3_TOKENS],
        special_tokens=True,
    )
    tok.chat_template = (TEMPLATES / "smolvlm.jinja").read_text()
    image_token_id = tok.convert_tokens_to_ids("<image>")
    torch.manual_seed(spec["seed"])
    text = LlamaConfig(
        vocab_size=IDEFICS3_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    vision = Idefics3VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=64,
        patch_size=8,
        initializer_range=0.2,
    )
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        scale_factor=2,
        image_token_id=image_token_id,
        tie_word_embeddings=False,
    )
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.save_pretrained(out)
    image_processor = Idefics3ImageProcessorPil(
        max_image_size={"longest_edge": 64}, size={"longest_edge": 128}
    )
    seq_len = (64 // 8) ** 2 // 4  # patches per tile / scale_factor²
    processor = Idefics3Processor(image_processor, tokenizer=tok, image_seq_len=seq_len)
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

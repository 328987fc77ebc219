"""Tiny random-weight Llama models for the tests and the benchmarks.

Two flavours share one architecture (2 layers, hidden 64, 4 heads, 2 KV heads):

- ``random_llama``: in-process, any vocabulary (the worker tests use 512 tokens);
- ``build_tiny_smollm``: SmolLM2's 49152-token vocabulary with its tokenizer files copied next
  to the weights, so chat templates and text prompts work. It is built in a subprocess (this
  file run as a script), because torch must stay out of the processes that import it: the HTTP
  tests' and the engine tests' own process, like a server's main process, stay torch-free. It
  also records Hugging Face greedy outputs with the top-2 logprob gap at every position, to
  tell real bugs from near-ties.

Random init gives near-uniform logits, where every argmax is a near-tie; a larger init range
and a scaled-up output projection make the top tokens stand apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SMOLLM2_VOCAB = 49152
LOGIT_SCALE = 8.0
ARCHITECTURE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.2,
}


# transformers' config and model classes by family (random_model's ``family``)
FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM"),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
}


def random_llama(vocab_size: int, max_position_embeddings: int, seed: int, **overrides: Any):
    """A transformers LlamaForCausalLM (eval mode) with seeded random weights."""
    return random_model("llama", vocab_size, max_position_embeddings, seed, **overrides)


def random_model(
    family: str, vocab_size: int, max_position_embeddings: int, seed: int, **overrides: Any
):
    """A transformers causal LM of ``family`` (eval mode) with seeded random weights, in the
    tiny shape above (and ``overrides``)."""
    import torch
    import transformers

    config_name, model_name = FAMILY_CLASSES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        **{**ARCHITECTURE, **overrides},
    )
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        if config.tie_word_embeddings:
            model.model.embed_tokens.weight.mul_(LOGIT_SCALE**0.5)
        else:
            model.lm_head.weight.mul_(LOGIT_SCALE)
    return model


def build_tiny_smollm(
    directory: Path,
    *,
    seed: int,
    max_position_embeddings: int,
    texts: Sequence[str] = (),
    max_new_tokens: int = 0,
    vocab_size: int = SMOLLM2_VOCAB,
    family: str = "llama",
    overrides: dict | None = None,
    added_tokens: Sequence[tuple[str, bool]] = (),
) -> Path:
    """Saves the SmolLM2-vocabulary model in ``directory`` (from a subprocess) and writes
    ``references.json``: for each text, its prompt ids, HF's greedy output of
    ``max_new_tokens`` tokens, the top logprob and the top-2 gap at every position.

    A ``vocab_size`` below SmolLM2's keeps only its first ids (still decoded by its tokenizer):
    the output projection then costs next to nothing, which the overhead benchmark wants.
    ``family`` (FAMILY_CLASSES) and ``overrides`` choose another architecture of the same size.
    ``added_tokens``: (text, special) pairs added to the tokenizer after SmolLM2's vocabulary, as
    real tokenizers add theirs (Qwen's ``<tool_call>`` is added and not special); the
    ``vocab_size`` must leave room for them.
    """
    spec = {
        "vocab_size": vocab_size,
        "directory": str(directory),
        "seed": seed,
        "max_position_embeddings": max_position_embeddings,
        "texts": list(texts),
        "max_new_tokens": max_new_tokens,
        "family": family,
        "overrides": overrides or {},
        "added_tokens": [list(t) for t in added_tokens],
    }
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
        check=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    return directory


def _build_tiny_smollm_here(spec: dict) -> None:
    import shutil

    import torch

    from pyserve.model_files import load_tokenizer, resolve_model, tokenizer_dir

    torch.set_num_threads(2)
    out = Path(spec["directory"])
    model = random_model(
        spec["family"],
        spec["vocab_size"],
        spec["max_position_embeddings"],
        spec["seed"],
        **spec["overrides"],
    )
    model.save_pretrained(out)
    source = resolve_model(None)
    for f in tokenizer_dir(source).iterdir():
        shutil.copy(f, out / f.name)
    tok = load_tokenizer(source)
    if spec["added_tokens"]:
        from tokenizers import AddedToken

        for text, special in spec["added_tokens"]:
            tok.add_tokens(
                [AddedToken(text, special=special, normalized=False)], special_tokens=special
            )
        assert len(tok) <= spec["vocab_size"], "the model's vocabulary must hold the added tokens"
        tok.save_pretrained(out)
    refs = []
    max_new = spec["max_new_tokens"]
    with torch.no_grad():
        for text in spec["texts"] if max_new else []:
            prompt = tok.encode(text)
            gen = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
            logprobs = torch.stack(gen.logits)[:, 0].float().log_softmax(-1)
            top2 = logprobs.topk(2).values
            refs.append(
                {
                    "text": text,
                    "prompt": prompt,
                    "output": gen.sequences[0, len(prompt) :].tolist(),
                    "logprobs": top2[:, 0].tolist(),
                    "gaps": (top2[:, 0] - top2[:, 1]).tolist(),
                }
            )
    (out / "references.json").write_text(json.dumps(refs))


if __name__ == "__main__":
    _build_tiny_smollm_here(json.loads(sys.argv[1]))

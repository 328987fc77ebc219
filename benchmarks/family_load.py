"""Every family on the CPU defaults, side by side: offline_load.py's concurrency-32 load over a
random-weight model of each family, all of one size (~0.5B parameters), against a Llama of the
same shape run in the same process.

Each family's model is built from transformers' own config class with the family's features on
(windows as long as the family's real models keep them), saved once as bfloat16 safetensors under
``--cache`` and served with int4 weights (``--quantization``), int16 activations and float16
K/V, the server's CPU defaults for a Q4 file. Per family it prints output tok/s, the matmul
GFLOP one output token costs (2 × the weights its projections read), tok/s per GFLOP and that
figure over the Llama's, what the backend ran (the decoder stack, or why not) and where the
forward time went.

    .venv/bin/python benchmarks/family_load.py                      # every family, 1 run each
    .venv/bin/python benchmarks/family_load.py --families llama,qwen3 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_worker.py: before torch loads

import torch
from offline_load import load_engine, load_prompts, run_load

from pyserve.worker.offline import OfflineEngine

HERE = Path(__file__).resolve().parent
# ~0.5B parameters: Qwen2.5-0.5B's blocks (24 × hidden 896, 4864 wide MLP, 14 query heads and 2
# KV heads of 64) with a 32k vocabulary for every family, so that the output projection costs
# them all the same
SHAPE = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"query_pre_attn_scalar": 64, "sliding_window": 4096},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"query_pre_attn_scalar": 64, "sliding_window": 512},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}


def build(family: str, cache: Path) -> Path:
    """The family's random-weight model, saved once (bf16 safetensors) under ``cache``."""
    import transformers

    directory = cache / family
    if (directory / "config.json").is_file():
        return directory
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model
    gc.collect()
    return directory


def matmul_gflop_per_token(engine: OfflineEngine) -> float:
    """2 × the weights one token's projections multiply by, in GFLOP (attention left out: the
    same for every family at this shape)."""
    cfg = engine.executor.runner.config
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    return 2 * (cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--cache", type=Path, default=HERE / "out" / "family-models")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    families = args.families.split(",")
    if "llama" not in families:
        families.insert(0, "llama")  # the baseline
    results = {}
    for family in families:
        directory = build(family, args.cache)
        tokens_each = args.prompt_len + args.output_len
        engine = load_engine(
            str(directory), args.concurrency, tokens_each, quantization=args.quantization
        )
        info = engine.executor.runner.backend.info()
        prompts = load_prompts(engine, args.requests, args.prompt_len)
        runs = run_load(engine, prompts, args.output_len, args.repeats, quiet=True)
        tok_s = sorted(r["output_tokens_per_s"] for r in runs)[len(runs) // 2]
        gflop = matmul_gflop_per_token(engine)
        results[family] = {
            "output_tokens_per_s": tok_s,
            "gflop_per_token": gflop,
            "tokens_per_s_per_gflop": tok_s / gflop,
            "backend": info.name,
            "kernels": info.kernels,
            "steps": runs[len(runs) // 2]["steps"],
        }
        del engine
        gc.collect()
    base = results["llama"]["tokens_per_s_per_gflop"]
    print(f"load: {args.requests} requests × {args.prompt_len} prompt + {args.output_len} output "
          f"tokens, {args.concurrency} at once, {args.quantization} weights; load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| family | output tok/s | GFLOP/token | tok/s per GFLOP | vs llama | decoder stack |")
    print("|---|---|---|---|---|---|")
    for family, r in results.items():
        stack = r["kernels"].get("decoder_stack", r["backend"])
        print(
            f"| {family} | {r['output_tokens_per_s']:.1f} | {r['gflop_per_token']:.2f} | "
            f"{r['tokens_per_s_per_gflop']:.1f} | {r['tokens_per_s_per_gflop'] / base:.2f} | "
            f"{stack} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None, "cache": None},
                                         "results": results}, default=str))  # fmt: skip


if __name__ == "__main__":
    main()

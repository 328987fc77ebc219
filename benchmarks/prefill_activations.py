"""Which activations prefill can use: int8 prefill's drift on the default model, and TTFT.

Drift (``--drift``): Hugging Face transformers' Llama loaded from the default model's GGUF in
float32 generates greedily from bench_kernels.py's 8 chat prompts (48 tokens each, one prompt at a
time, so a prompt's forward is its prefill and every later one a one-row decode); the same model
with its linears replaced by the kernel's (``quantize_model_linears(..., "int4")``: the GGUF's
Q4_1 layers bit for bit, the 8-bit output projection) generates again with

- int16 activations everywhere (the CPU default),
- int8 activations in prefill (forwards of more than one row) and int16 in decode,
- int8 activations everywhere (``--activation-bits 8``),

and the greedy tokens are compared with float32's: prompts whose 48 tokens are all equal, and
tokens equal before each prompt's first difference. The first token comes from the prefill's
last row, so the log-probability change of float32's first token is reported as well.

TTFT (``--ttft``): one prompt of ``--prompt-tokens`` random token ids through ``OfflineEngine``
(the server's defaults: ``quantization="auto"``, the decoder stack, one 2048-token prefill chunk)
for one new token, with int16 activations, int8 on the AVX-512 VNNI path and int8 on AMX tiles
(where they run), alternating, best and median of ``--rounds``; on the default model and on each
``--model`` given (e.g. benchmarks/out/kquant-models/0.5b/model-Q4_K_M.gguf).

    .venv/bin/python benchmarks/prefill_activations.py --drift
    .venv/bin/python benchmarks/prefill_activations.py --ttft --model \\
        benchmarks/out/kquant-models/0.5b/model-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_kernels.py: a shared VM

import torch
from bandwidth import cpu_model
from bench_kernels import CHAT_PROMPTS, default_hf_model

from pyserve.worker import quant
from pyserve.worker.backends.cpu import quant_linear


def drift(new_tokens: int) -> str:
    import copy

    tokenizer, model = default_hf_model()
    prompts = []
    for question in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(torch.tensor([tokenizer.encode(text, add_special_tokens=False)]))

    def greedy(m) -> list[tuple[list[int], torch.Tensor]]:
        runs = []
        with torch.inference_mode():
            for prompt in prompts:
                out = m.generate(
                    prompt,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
                tokens = out.sequences[0, prompt.shape[1] :].tolist()
                runs.append((tokens, out.logits[0][0].float().log_softmax(-1)))
        return runs

    reference = greedy(model)
    quantized = copy.deepcopy(model)
    quant_linear.quantize_model_linears(quantized, "int4", max_kernel_rows=1 << 30)
    layers = [m for m in quantized.modules() if isinstance(m, quant_linear.QuantLinear)]

    rows = []
    for name, prefill_bits, decode_bits in [
        ("int16 everywhere (the default)", 16, 16),
        ("int8 prefill, int16 decode", 8, 16),
        ("int8 everywhere (`--activation-bits 8`)", 8, 8),
    ]:
        original = quant_linear.QuantLinear.forward

        def forward(self, x, _p=prefill_bits, _d=decode_bits, _f=original):
            self.activation_bits = _p if x.numel() // self.in_features > 1 else _d
            return _f(self, x)

        quant_linear.QuantLinear.forward = forward
        try:
            runs = greedy(quantized)
        finally:
            quant_linear.QuantLinear.forward = original
            for layer in layers:
                layer.activation_bits = 16
        whole, before, first = 0, 0, []
        for (want, want_lp), (got, got_lp) in zip(reference, runs, strict=True):
            pairs = enumerate(zip(want, got, strict=True))
            same = next((i for i, (a, b) in pairs if a != b), len(want))
            whole += same == len(want)
            before += same
            top = want[0]
            first.append(abs(float(got_lp[top] - want_lp[top])))
        rows.append(
            f"| {name} | {whole} / {len(prompts)} | {before} / {len(prompts) * new_tokens} | "
            f"{statistics.mean(first):.4f} / {max(first):.4f} |"
        )
    header = (
        "| activations | prompts with all tokens equal | tokens equal before the first "
        "difference | abs Δ logprob of fp32's first token, mean / max |\n|---|---|---|---|"
    )
    return header + "\n" + "\n".join(rows)


def gops(rows: list[int], rounds: int) -> str:
    """GOPS (2·M·N·K a second) of one decoder layer's four matmuls at M rows: int16 activations,
    int8 on the VNNI loops, int8 on AMX tiles; contenders interleaved, best of ``rounds``."""
    kernels = quant.kernels()
    gen = torch.Generator().manual_seed(0)
    layer = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # the default model's
    variants = [("int16", 16, False), ("int8 VNNI", 8, False)]
    if not kernels.amx_status():
        variants.append(("int8 AMX", 8, True))
    lines = [
        "| weights | M | " + " | ".join(f"{v[0]} GOPS" for v in variants) + " | AMX / VNNI int8 |",
        "|---|---|" + "---|" * len(variants) + "---|",
    ]
    for bits in (4, 8):
        weights = [quant.quantize_weight(torch.randn(n, k, generator=gen) * 0.05, bits)
                   for n, k in layer]  # fmt: skip
        for m in rows:
            xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
            outs = [torch.empty(m, w.n) for w in weights]
            best = {name: float("inf") for name, _, _ in variants}
            for round_ in range(rounds + 1):
                for name, activation_bits, amx in variants:
                    if not kernels.amx_status():
                        kernels.set_amx(amx)
                    start = time.perf_counter()
                    for w, out in zip(weights, outs, strict=True):
                        quant_linear.quantized_matmul(
                            xs[w.k], w, out=out, activation_bits=activation_bits
                        )
                    if round_:
                        best[name] = min(best[name], time.perf_counter() - start)
            ops = 2 * m * sum(n * k for n, k in layer)
            figures = {name: ops / t / 1e9 for name, t in best.items()}
            ratio = (
                f"{figures['int8 AMX'] / figures['int8 VNNI']:.2f}x"
                if "int8 AMX" in figures
                else "—"
            )
            lines.append(
                f"| int{bits} | {m} | "
                + " | ".join(f"{figures[name]:.0f}" for name, _, _ in variants)
                + f" | {ratio} |"
            )
    if not kernels.amx_status():
        kernels.set_amx(True)
    return "\n".join(lines)


def ttft(models: list[str | None], prompt_tokens: int, rounds: int) -> str:
    from pyserve.wire.main_to_worker import SamplingParams
    from pyserve.worker.offline import OfflineEngine

    kernels = quant.kernels()
    variants = [("int16", 16, False), ("int8 VNNI", 8, False)]
    if not kernels.amx_status():
        variants.append(("int8 AMX", 8, True))
    lines = [
        "| model | activations | TTFT best ms | median ms | prompt tok/s at best |",
        "|---|---|---|---|---|",
    ]
    for model in models:
        engines = {
            bits: OfflineEngine(
                model,
                quantization="auto",
                activation_bits=bits,
                max_model_len=prompt_tokens + 16,
                num_blocks=(prompt_tokens + 64) // 16 + 8,
                enable_radix_cache=False,
            )
            for bits in (16, 8)
        }
        vocab = engines[16].runner.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, vocab - 100, (prompt_tokens,), generator=gen).tolist()
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for round_ in range(rounds + 1):  # the first round warms up
            for name, bits, amx in variants:
                if kernels.amx_status() == "":
                    kernels.set_amx(amx)
                start = time.perf_counter()
                engines[bits].generate([prompt], params)
                if round_:
                    times[name].append(time.perf_counter() - start)
        if kernels.amx_status() == "":
            kernels.set_amx(True)
        label = Path(model).name if model else "default (SmolLM2-135M Q4_1)"
        for name, _, _ in variants:
            best, median = min(times[name]), statistics.median(times[name])
            lines.append(
                f"| {label} | {name} | {best * 1e3:.0f} | {median * 1e3:.0f} | "
                f"{prompt_tokens / best:.0f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drift", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--gops", action="store_true", help="the matmuls alone at --rows")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--ttft", action="store_true")
    parser.add_argument("--model", action="append", default=[], help="more models for --ttft")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = quant.kernels()
    kernels.set_num_threads(args.threads)
    print(
        f"{cpu_model()}, nproc {os.cpu_count()}, kernel ISA {kernels.isa()}, AMX "
        f"{'available' if not kernels.amx_status() else 'unavailable: ' + kernels.amx_status()}, "
        f"threads {args.threads}, load average {os.getloadavg()[0]:.1f}"
    )
    if args.drift:
        print(drift(args.new_tokens))
    if args.gops:
        print(gops(args.rows, args.rounds))
    if args.ttft:
        print(ttft([None, *args.model], args.prompt_tokens, args.rounds))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

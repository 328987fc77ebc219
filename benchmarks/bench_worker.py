"""Worker throughput, offline (no HTTP, no core): our ModelRunner vs transformers vs plain matmul.

For each dtype, on the default model (SmolLM2-135M Q4_1 GGUF, dequantized) unless --model:

- decode tokens/s at each batch size: B random prompts of --prompt-len tokens are prefilled
  (not timed), then --decode-steps greedy decode steps are timed one by one (ForwardBatch
  building, forward, argmax: what the worker does per step, minus the wire).
- prefill tokens/s for one --prefill-len prompt.
- HF transformers ``generate`` on the same GGUF at the same batch and dtype, its decode rate from
  the gaps between its tokens (a stopping criterion timestamps each), so its prefill is not
  counted. Both decode rates use the median step: the machine may be shared.
- the ceiling: the model's matmuls alone (every projection of every layer plus the vocabulary
  projection, M = batch rows, same dtype), on random weights, run the way the runner runs them.

    .venv/bin/python benchmarks/bench_worker.py --quick          # a short run
    .venv/bin/python benchmarks/bench_worker.py --dtype bfloat16 # full run, one dtype
    .venv/bin/python benchmarks/bench_worker.py --quantization none,int4 --dtype float32

With --quantization int4/int8 our linear layers run on pyserve._kernels (HF generate and the
ceiling stay in the float dtype: they are the same reference for every quantization).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a shared machine a spinning pool waits for
# a descheduled peer at every parallel region (steps took ~1 s). Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from pyserve.worker.batch import ForwardBatch
from pyserve.worker.linear import Linear
from pyserve.worker.model_runner import DTYPES, ModelRunner
from pyserve.worker.models.config import ModelConfig
from pyserve.worker.settings import WorkerSettings

BLOCK_SIZE = 16
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]  # --clock cpu: CPU seconds of this process (for a shared machine)


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call: the median of 5 rounds of ``repeats`` calls, like the decode steps."""
    fn()
    rounds = []
    for _ in range(5):
        start = clock()
        for _ in range(repeats):
            fn()
        rounds.append((clock() - start) / repeats)
    return statistics.median(rounds)


# ---------------------------------------------------------------------------- the ceiling


def matmul_ceiling(
    config: ModelConfig, rows: int, dtype: torch.dtype, repeats: int, vocab_rows: int | None = None
) -> float:
    """Tokens/s if a forward were nothing but its matmuls, on random weights of the model's
    shapes: every layer has its own matrices, so they stream from memory as the model's do.

    Each projection runs as ``pyserve.worker.linear.Linear`` runs it for this dtype (prepacked
    for oneDNN where the runner packs, else ``F.linear``), so the ceiling is the fastest matmul
    the runner itself could get. ``vocab_rows``: rows that need logits (all of them when
    decoding, one for a prefill).
    """
    hidden, inter = config.hidden_size, config.intermediate_size

    def projection(inputs: int, outputs: int) -> Linear:
        proj = Linear(inputs, outputs, bias=False, dtype=dtype, device="cpu")
        proj.weight.data.normal_()
        proj.pack()
        return proj

    layers = [
        (
            projection(hidden, config.q_size + 2 * config.kv_size),
            projection(config.q_size, hidden),
            projection(hidden, 2 * inter),
            projection(inter, hidden),
        )
        for _ in range(config.num_layers)
    ]
    vocab = projection(hidden, config.vocab_size)
    x = torch.randn(rows, hidden, dtype=dtype)
    attn_out = torch.randn(rows, config.q_size, dtype=dtype)
    act = torch.randn(rows, inter, dtype=dtype)
    last = x[: rows if vocab_rows is None else vocab_rows]

    def forward() -> None:
        for qkv, o_proj, gate_up, down in layers:
            qkv(x)
            o_proj(attn_out)
            gate_up(x)
            down(act)
        vocab(last)

    return rows / timed(forward, repeats)


# ---------------------------------------------------------------------------- ours


class PagedBatch:
    """B sequences with private block tables, stepped together."""

    def __init__(self, runner: ModelRunner, prompts: torch.Tensor):
        self.runner = runner
        batch, length = prompts.shape
        self.prompts = prompts
        self.blocks_each = runner.num_blocks // batch
        self.tables = [
            list(range(i * self.blocks_each, (i + 1) * self.blocks_each)) for i in range(batch)
        ]
        self.length = length

    def prefill(self) -> torch.Tensor:
        batch, length = self.prompts.shape
        fb = ForwardBatch(
            input_ids=self.prompts.flatten(),
            positions=torch.arange(length).repeat(batch),
            start_pos=[0] * batch,
            num_tokens=[length] * batch,
            block_tables=self.tables,
            sample_index=torch.arange(batch) * length + length - 1,
        )
        self.last = self.runner.forward(fb).argmax(-1)
        self.length = length
        return self.last

    def decode(self) -> None:
        batch = len(self.tables)
        pos = self.length
        fb = ForwardBatch(
            input_ids=self.last,
            positions=torch.full((batch,), pos),
            start_pos=[pos] * batch,
            num_tokens=[1] * batch,
            block_tables=self.tables,
            sample_index=torch.arange(batch),
        )
        self.last = self.runner.forward(fb).argmax(-1)
        self.length += 1


def ours_decode(runner: ModelRunner, prompts: torch.Tensor, steps: int) -> float:
    """Tokens/s from the median decode step (robust to a shared machine's hiccups)."""
    seqs = PagedBatch(runner, prompts)
    seqs.prefill()
    seqs.decode()  # warm-up
    durations = []
    for _ in range(steps):
        start = clock()
        seqs.decode()
        durations.append(clock() - start)
    return prompts.shape[0] / statistics.median(durations)


def ours_prefill(runner: ModelRunner, prompt: torch.Tensor, repeats: int) -> float:
    seqs = PagedBatch(runner, prompt[None])
    return prompt.numel() / timed(seqs.prefill, repeats)


# ---------------------------------------------------------------------------- transformers


def load_hf(model: str | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from pyserve.model_files import resolve_model

    source = resolve_model(model)
    if source.kind == "gguf":
        path = Path(source.path)
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    hf.generation_config.eos_token_id = None  # always generate the full length
    return hf.eval()


class StepClock:
    """A stopping criterion that never stops: it timestamps each generated token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.stamps.append(clock())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def hf_decode(hf, prompts: torch.Tensor, steps: int) -> float:
    """Tokens/s from the median gap between HF generate's tokens (its prefill excluded)."""
    from transformers import StoppingCriteriaList

    clock = StepClock()
    with torch.inference_mode():
        out = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=steps + 2,
            min_new_tokens=steps + 2,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    assert out.shape[1] == prompts.shape[1] + steps + 2
    gaps = [b - a for a, b in zip(clock.stamps[1:], clock.stamps[2:], strict=False)]
    return prompts.shape[0] / statistics.median(gaps)


def hf_prefill(hf, prompt: torch.Tensor, repeats: int) -> float:
    def run() -> None:
        with torch.inference_mode():
            hf(prompt[None], logits_to_keep=1)  # like generate: last position's logits only

    return prompt.numel() / timed(run, repeats)


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--dtype", default="both", choices=[*DTYPES, "both"])
    parser.add_argument(
        "--quantization",
        default="none",
        help="comma-separated: none, int8, int4, auto (the runner's linear layers)",
    )
    parser.add_argument(
        "--activation-bits",
        default="16",
        help="comma-separated: 16, 8 (what quantized layers round activations to; "
        "8 runs only with int8/int4)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=list(DTYPES),
        help="K/V storage (default: the model's dtype; the server's auto is float16 for a "
        "float32 model on the CPU)",
    )
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=64, help="context before decoding")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="cpu: time by this process's CPU seconds, with --threads 1 a fair measure on a "
        "machine that other jobs share (waiting for a core is not counted)",
    )
    parser.add_argument("--quick", action="store_true", help="few steps: a smoke run")
    parser.add_argument("--skip-hf", action="store_true", help="ours and the ceiling only")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.decode_steps = min(args.decode_steps, 8)
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    quantizations = args.quantization.split(",")
    repeats = 2 if args.quick else 5
    gen = torch.Generator().manual_seed(0)
    results = []
    references: dict[tuple[str, str], tuple[float, float]] = {}  # HF tok/s, ceiling tok/s
    hf_loaded: list = [None, None]  # dtype name, the HF model: one loaded at a time
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, load average {os.getloadavg()[0]:.1f}"
    )
    activation_bits = [int(b) for b in args.activation_bits.split(",")]
    for dtype_name, quantization, bits in itertools.product(dtypes, quantizations, activation_bits):
        if bits != 16 and quantization == "none":
            continue
        dtype = DTYPES[dtype_name]
        tokens_each = args.prompt_len + args.decode_steps + 2
        need = max(batches) * -(-max(tokens_each, args.prefill_len) // BLOCK_SIZE)
        runner = ModelRunner(
            WorkerSettings(
                model=args.model,
                dtype=dtype_name,
                num_blocks=need,
                block_size=BLOCK_SIZE,
                quantization=quantization,
                activation_bits=bits,
                kv_cache_dtype=args.kv_cache_dtype,
            )
        )
        config = runner.config
        kv = runner.kv_cache_dtype_name
        print(
            f"\n== {dtype_name}, quantization {runner.quantization}, activations {bits}-bit, "
            f"K/V {kv} "
            f"({config.name}, load {runner.load_seconds:.1f}s) =="
        )
        print(f"{'':>14} {'ours tok/s':>11} {'HF tok/s':>9} {'×HF':>6} {'ceiling':>9} {'%ceil':>6}")
        rows = [(f"decode b={b}", b) for b in batches] + [(f"prefill {args.prefill_len}", 0)]
        for label, batch in rows:
            # HF and the ceiling do not depend on our quantization: measured once per dtype
            reference = references.get((dtype_name, label))
            if reference is None and not args.skip_hf and hf_loaded[0] != dtype_name:
                hf_loaded[:] = [dtype_name, load_hf(args.model, dtype)]
            hf = None if args.skip_hf else hf_loaded[1]
            if batch:
                prompts = torch.randint(
                    100, config.vocab_size, (batch, args.prompt_len), generator=gen
                )
                ours = ours_decode(runner, prompts, args.decode_steps)
                if reference is None:
                    theirs = hf_decode(hf, prompts, args.decode_steps) if hf else float("nan")
                    ceiling = matmul_ceiling(config, batch, dtype, repeats)
            else:
                prompt = torch.randint(100, config.vocab_size, (args.prefill_len,), generator=gen)
                ours = ours_prefill(runner, prompt, repeats)
                if reference is None:
                    theirs = hf_prefill(hf, prompt, repeats) if hf else float("nan")
                    ceiling = matmul_ceiling(config, args.prefill_len, dtype, repeats, vocab_rows=1)
            if reference is None:
                references[dtype_name, label] = theirs, ceiling
            theirs, ceiling = references[dtype_name, label]
            print(
                f"{label:>14} {ours:11.0f} {theirs:9.0f} {ours / theirs:6.2f} "
                f"{ceiling:9.0f} {100 * ours / ceiling:5.0f}%"
            )
            results.append(
                {
                    "dtype": dtype_name,
                    "quantization": runner.quantization,
                    "activation_bits": bits,
                    "kv_cache_dtype": kv,
                    "case": label,
                    "ours": ours,
                    "hf": theirs,
                    "ceiling": ceiling,
                }
            )
        del runner
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""One unattended run of the Triton GPU backend's checks, for a GPU machine lent for minutes.

Each section group runs in a child process of its own, so that a CUDA fault or a hang in one
cannot take the rest down; a child past its share of the budget is stopped and recorded so.

1. environment: torch, triton, transformers and CUDA versions, the GPU and its memory.
2. bandwidth: a large device-to-device copy, GB/s = 2 x bytes / time: the roofline's divisor.
3. parity: the default model (SmolLM2-135M GGUF) against Hugging Face greedy on the same device.
   float32 (quantization none, float32 K/V) must give HF's tokens; bfloat16 reports the share of
   tokens before the first divergence. Backend triton, and torch beside it, and the triton
   backend on the file's own 4-/8-bit blocks (quantization auto: the same weights exactly).
   Where the model's file is missing, a random-weight model of its shape (the summary says so).
4. decode: a random-weight Llama-3-8B-shaped bf16 model (safetensors written once) through
   OfflineEngine with backend triton at several batch sizes: tok/s over the decode-only steps
   against the roofline of the measured bandwidth (weights + K/V read per step).
5. ttft: 2k-token prompts on that model, alone and several at once.
   quant_matmul: the 8-/4-bit Triton matmul on that model's projections against bf16 torch.
6. serving: ``pyserve run --backend triton`` against ``transformers serve`` at concurrency 32.
   serving_quantized: pyserve on the default GGUF's own 4-/8-bit blocks (quantization auto).

DIR/results.json is rewritten after every group (a kill keeps what ran), DIR/summary.txt has a
line per section, DIR/logs and DIR/servers the children's and servers' output.

    python benchmarks/gpu_check.py --out DIR              # full sizes, within --budget-s
    python benchmarks/gpu_check.py --out DIR --quick      # 4 of the 8B shape's layers, fewer runs
    python benchmarks/gpu_check.py --out DIR --cpu-smoke  # every path on a CPU, tiny shapes
    python benchmarks/gpu_check.py --out DIR --only parity,serving  # some sections

On the lent GPU machine (no package index; at most 64 MiB a call), benchmarks/gpu_bundle.py
prepares the wheels and the default model here and benchmarks/gpu_device.sh runs this script
there in two calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# Triton reads this when it is first imported (torch may import it), so before anything else.
if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))  # compare.py, serving.py

# fmt: off
LLAMA3_8B = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001,
)
# the default model's shape, for parity where its file is missing (random weights)
SMOLLM2_135M = LLAMA3_8B | dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2,
)
TINY_LLAMA = LLAMA3_8B | dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, max_position_embeddings=512, bos_token_id=1,
    eos_token_id=2,
)
# fmt: on
TARGETS = {1: 0.70, 64: 0.50, 128: 0.50}  # share of the roofline, by batch
SERVING_TARGET = 5.0  # pyserve / transformers serve, output tok/s
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
]
NEAR_TIE = 1e-3  # HF's top-2 logprob gap under which a greedy divergence is rounding
# Section groups and their most seconds; a group's sections share one process (and the 8B model).
GROUPS = [
    (("environment",), 60),
    (("bandwidth",), 60),
    (("parity",), 240),
    (("decode", "ttft"), 360),
    (("quant_matmul",), 90),
    (("serving",), 300),
    (("serving_quantized",), 120),
]


@dataclass(frozen=True)
class Sizes:
    copy_mib: int
    parity: tuple[int, int]  # prompts, new tokens
    llama: dict
    batches: tuple[int, ...]
    prompt_len: int
    output_len: int
    ttft: tuple[int, int]  # prompt length, concurrent prompts
    serve: tuple[int, int, int, int]  # prompts, concurrency, input and output length
    budget_s: float
    device: str = "cuda"


def sizes_for(args: argparse.Namespace) -> Sizes:
    if args.cpu_smoke:
        return Sizes(64, (1, 4), TINY_LLAMA, (1, 2), 8, 4, (32, 2), (2, 2, 8, 4), 1800, "cpu")
    serve = (64, 32, 256, 128)
    if args.quick:
        llama = LLAMA3_8B | {"num_hidden_layers": 4}
        return Sizes(2048, (3, 24), llama, (1, 32, 128), 128, 128, (2048, 8), serve, 300)
    return Sizes(4096, (4, 48), LLAMA3_8B, (1, 32, 64, 128), 128, 128, (2048, 8), serve, 480)


@dataclass
class Ctx:
    args: argparse.Namespace
    sizes: Sizes
    out: Path
    engine: object = None  # the 8B-shaped OfflineEngine, shared by decode and ttft
    model_dir: Path | None = None
    notes: list[str] = field(default_factory=list)


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}


# ------------------------------------------------------------------------------- 1, 2


def environment(ctx: Ctx) -> dict:
    import importlib.metadata as metadata

    import torch

    info: dict = {"python": platform.python_version(), "torch_cuda": torch.version.cuda}
    for package in ("torch", "triton", "transformers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            info[package] = "not installed"
            info[package] = metadata.version(package)
    info |= {"triton_interpret": os.environ.get("TRITON_INTERPRET"), "cpus": os.cpu_count()}
    gpu = "no CUDA"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        gpu = f"{props.name}, {total / 2**30:.0f} GiB"
        info |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}"}
        info |= {"sms": props.multi_processor_count, "memory_gib": [free / 2**30, total / 2**30]}
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.memory,power.limit"
        argv = ["nvidia-smi", query, "--format=csv,noheader"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        info["nvidia_smi"] = done.stdout.strip() or done.stderr.strip()
    info["summary"] = (
        f"{gpu}; torch {info['torch']} (CUDA {info['torch_cuda']}), triton {info['triton']}, "
        f"transformers {info['transformers']}"
    )
    return info


def bandwidth(ctx: Ctx) -> dict:
    import torch

    device, n = ctx.sizes.device, ctx.sizes.copy_mib << 20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch and allocation stay out of the timing
    seconds = []
    for _ in range(20 if device == "cuda" else 5):
        _sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        seconds.append(time.perf_counter() - started)
    rates = [2 * n / s / 1e9 for s in seconds]
    best, median = max(rates), statistics.median(rates)
    line = f"{device} copy of {n >> 20} MiB: {best:.0f} GB/s best, {median:.0f} median"
    return {"bytes": n, "gb_per_s_best": best, "gb_per_s_median": median, "summary": line}


# ------------------------------------------------------------------------------- 3 parity


def parity_prompts(count: int, vocab: int) -> tuple[list[list[int]], str]:
    try:
        from pyserve.model_files import load_tokenizer, resolve_model

        tok = load_tokenizer(resolve_model(None))
        return [tok.encode(t) for t in TEXTS[:count]], "texts"
    except Exception as e:  # the comparison matters more than natural text
        rng = random.Random(0)
        ids = [[rng.randrange(3, vocab) for _ in range(8)] for _ in range(count)]
        return ids, f"random ids ({type(e).__name__})"


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], object]:
    """HF greedy tokens and log-softmax per step for one prompt (no padding, EOS no stop)."""
    import torch
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    config = GenerationConfig(
        max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    logprobs = torch.stack(out.logits)[:, 0].float().log_softmax(-1).cpu()
    return out.sequences[0, len(prompt) :].tolist(), logprobs


def agreement(ours: list[int], theirs: list[int], logprobs) -> dict:
    pairs = enumerate(zip(ours, theirs, strict=False))
    same = next((i for i, (a, b) in pairs if a != b), len(theirs))
    row: dict = {"matching_prefix": same, "tokens": len(theirs), "fraction": same / len(theirs)}
    if same < len(theirs):
        top2 = logprobs[same].topk(2).values
        row["hf_top2_gap"] = float(top2[0] - top2[1])
        row["near_tie"] = row["hf_top2_gap"] < NEAR_TIE
    return row


def parity_model(ctx: Ctx) -> tuple[str, object, str]:
    """(what OfflineEngine loads, HF's float32 model of the same weights, a description): the
    default model, or where its file is missing a random-weight model of its shape."""
    import torch
    from transformers import AutoModelForCausalLM

    from pyserve.model_files import ModelFilesError, default_model_path

    eager = dict(dtype=torch.float32, attn_implementation="eager")  # every step in float32
    try:
        gguf = Path(default_model_path())
    except ModelFilesError as e:
        directory = Path(ctx.args.scratch or make_scratch(ctx.sizes)) / "smollm2-shaped"
        directory.mkdir(parents=True, exist_ok=True)
        shape = TINY_LLAMA if ctx.args.cpu_smoke else SMOLLM2_135M
        write_random_llama(shape, ctx.sizes.device, directory, decisive=True)
        hf = AutoModelForCausalLM.from_pretrained(str(directory), **eager)
        return str(directory), hf, f"random weights in the default model's shape ({e})"
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **eager)
    return None, hf, str(gguf)


def parity(ctx: Ctx) -> dict:
    import torch

    from pyserve.wire.main_to_worker import SamplingParams
    from pyserve.worker.offline import OfflineEngine

    # TF32 would make HF's float32 reference something other than float32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    (count, steps), device = ctx.sizes.parity, ctx.sizes.device
    model, hf, described = parity_model(ctx)
    prompts, source = parity_prompts(count, hf.config.vocab_size)
    hf = hf.to(device)
    params = SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True)
    result: dict = {"model": described, "prompts": source, "prompt_lens": list(map(len, prompts))}
    lines = []
    for dtype in ("float32", "bfloat16"):
        hf = hf.to(getattr(torch, dtype)).eval()
        refs = [hf_greedy(hf, p, steps) for p in prompts]
        # the default GGUF's own Q4_1/Q8_0 blocks on the 8-/4-bit Triton kernels too: the same
        # weights exactly, so float32 must give HF's tokens as well (too slow interpreted:
        # tests/test_triton_quant.py checks it on a tiny file)
        quantized = model is None and not ctx.args.cpu_smoke
        cases = [("triton", "none"), ("torch", "none")] + [("triton", "auto")] * quantized
        for backend, quantization in cases:
            case = f"{dtype} {backend}" + (
                " int4/int8 (the file's)" if quantization == "auto" else ""
            )
            opts = dict(quantization=quantization, kv_cache_dtype=dtype, num_blocks=256)
            try:
                engine = OfflineEngine(model, dtype=dtype, device=device, backend=backend, **opts)
                outs = engine.generate(prompts, params)
                del engine
            except Exception as e:  # one backend failing must not hide the other's result
                result[case] = _error(e)
                lines.append(f"{case} ERROR {type(e).__name__}")
                continue
            finally:
                _free()
            rows = [agreement(o.token_ids, t, lp) for o, (t, lp) in zip(outs, refs, strict=True)]
            mean = statistics.mean(r["fraction"] for r in rows)
            identical = sum(r["fraction"] == 1.0 for r in rows)
            result[case] = {"per_prompt": rows, "mean_fraction": mean, "identical": identical}
            if dtype == "float32":
                ties = sum(bool(r.get("near_tie")) for r in rows)
                lines.append(f"{case} {identical}/{len(rows)} identical ({ties} near-tie splits)")
            else:
                per = "/".join(f"{r['fraction']:.2f}" for r in rows)
                lines.append(f"{case} agreement {mean:.2f} ({per})")
    result["float32_triton_identical"] = result["float32 triton"].get("identical") == count
    if ctx.args.cpu_smoke:  # triton-lang/triton#11584: the interpreter multiplies bf16 bits
        lines.append("bf16 triton is not meaningful in the interpreter (no bf16 tl.dot)")
    on = "" if model is None else " (random weights: the default model's file is missing)"
    result["summary"] = f"{steps} tokens x {len(prompts)} prompts{on}: " + "; ".join(lines)
    return result


# ------------------------------------------------------------------------------- 4, 5


def write_random_llama(fields: dict, device: str, directory: Path, decisive: bool = False) -> int:
    """A random-weight bf16 Llama as safetensors shards, drawn on ``device``; returns bytes.
    ``decisive``: weights of std 1/sqrt(fan-in) (embeddings 0.5) instead of 0.02, so that the
    logits are not near-uniform and greedy parity is not decided by rounding."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**fields, dtype="bfloat16", architectures=["LlamaForCausalLM"])
    with torch.device("meta"):  # names and shapes, no memory
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    config.save_pretrained(directory)
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict = {}
    total = shard_bytes = index = 0
    for i, (name, shape) in enumerate(shapes.items()):
        tensor = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            std = 0.02
            if decisive:
                std = 0.5 if "embed_tokens" in name or "lm_head" in name else shape[-1] ** -0.5
            tensor.normal_(0.0, std, generator=gen)
        shard[name] = tensor.cpu()
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= 4 << 30 or i == len(shapes) - 1:
            save_file(shard, str(directory / f"model-{index:05d}.safetensors"))
            total, shard, shard_bytes, index = total + shard_bytes, {}, 0, index + 1
    return total


def weight_bytes(c: dict) -> int:
    """bf16 bytes of the weights each decode step reads (all but the embedding table)."""
    h = c["hidden_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
    return 2 * (c["num_hidden_layers"] * per_layer + h + c["vocab_size"] * h)


def kv_bytes(c: dict, rows: float, context: float) -> float:
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return rows * context * c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2


def make_scratch(s: Sizes) -> str:
    """A directory for the model: RAM-backed /dev/shm where it has room (no disk writes,
    reloads from memory), else the temporary directory."""
    need = 1.3 * (weight_bytes(s.llama) + 2 * s.llama["vocab_size"] * s.llama["hidden_size"])
    root = None
    with contextlib.suppress(OSError):
        root = "/dev/shm" if shutil.disk_usage("/dev/shm").free > need else None
    return tempfile.mkdtemp(prefix="gpu-check-", dir=root)


def big_engine(ctx: Ctx, backend: str = "triton"):
    from pyserve.worker.offline import OfflineEngine

    s = ctx.sizes
    if ctx.model_dir is None:
        ctx.model_dir = Path(ctx.args.scratch or make_scratch(s)) / "llama"
        ctx.model_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        written = write_random_llama(s.llama, s.device, ctx.model_dir)
        took = time.perf_counter() - started
        ctx.notes.append(f"wrote {written / 1e9:.1f} GB to {ctx.model_dir} in {took:.0f} s")
    blocks = max(
        max(s.batches) * -(-(s.prompt_len + s.output_len + 2) // 16),
        s.ttft[1] * -(-(s.ttft[0] + 2) // 16),
    )
    started = time.perf_counter()
    engine = OfflineEngine(
        str(ctx.model_dir), dtype="bfloat16", device=s.device, quantization="none",
        backend=backend, num_blocks=blocks + 64, max_running_requests=max(256, *s.batches),
    )  # fmt: skip
    ctx.notes.append(f"{backend} engine loaded in {time.perf_counter() - started:.0f} s")
    return engine


@contextlib.contextmanager
def step_times(engine):
    """(start, end, prompt tokens, decode rows, tokens reported) of every step, from the
    executor's execute, which returns once the step's tokens are on the host."""
    import numpy as np

    steps: list[tuple[float, float, int, int, int]] = []
    executor = engine.executor
    execute = executor.execute

    def timed(step):
        started = time.perf_counter()
        result = execute(step)
        decode = np.frombuffer(step.is_decode, dtype=np.uint8).astype(bool)
        prompt = int(np.frombuffer(step.num_tokens, dtype="<i4")[~decode].sum())
        end = time.perf_counter()
        steps.append((started, end, prompt, int(decode.sum()), len(result.rids) // 8))
        return result

    executor.execute = timed
    try:
        yield steps
    finally:
        del executor.execute  # the class's method again


def random_prompts(rng: random.Random, vocab: int, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def decode_batch(engine, ctx: Ctx, batch: int, bw_gbs: float) -> dict:
    from pyserve.wire.main_to_worker import SamplingParams

    s, c, rng = ctx.sizes, ctx.sizes.llama, random.Random(batch)
    params = SamplingParams(max_new_tokens=s.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(random_prompts(rng, c["vocab_size"], batch, s.prompt_len), params)  # compiles
    with step_times(engine) as steps:
        started = time.perf_counter()
        engine.generate(random_prompts(rng, c["vocab_size"], batch, s.prompt_len), params)
        wall = time.perf_counter() - started
    pure = [st for st in steps if st[2] == 0 and st[3] > 0]
    window, tokens = pure[-1][1] - pure[0][0], sum(st[4] for st in pure)
    rows = tokens / len(pure)  # below batch where prefill chunks staggered the starts
    step_bytes = weight_bytes(c) + kv_bytes(c, rows, s.prompt_len + s.output_len / 2)
    roofline = rows / (step_bytes / (bw_gbs * 1e9))
    measured = tokens / window
    return {
        "batch": batch, "decode_steps": len(pure), "decode_tokens": tokens, "decode_s": window,
        "decode_tok_per_s": measured, "ms_per_step": 1000 * window / len(pure),
        "mean_rows": rows, "wall_s": wall, "step_bytes": step_bytes,
        "ttft_s": next(st[1] for st in steps if st[4]) - started,
        "roofline_tok_per_s": roofline, "fraction": measured / roofline,
        "target": TARGETS.get(batch),
    }  # fmt: skip


def decode(ctx: Ctx) -> dict:
    s = ctx.sizes
    bw = ctx.args.bandwidth_gbs or bandwidth(ctx)["gb_per_s_best"]
    result: dict = {"bandwidth_gb_per_s": bw, "weight_bytes": weight_bytes(s.llama)}
    lines = []
    # torch beside triton on the CPU (and when asked): what the kernels buy
    backends = ["triton", "torch"] if ctx.args.cpu_smoke or ctx.args.torch_decode else ["triton"]
    for backend in backends:
        engine = big_engine(ctx, backend)
        if backend == "triton":
            ctx.engine = engine  # ttft's
        runs = result[backend] = []
        for batch in s.batches:
            try:
                runs.append(decode_batch(engine, ctx, batch, bw))
            except Exception as e:
                runs.append({"batch": batch} | _error(e))
                lines.append(f"{backend} b={batch} ERROR {type(e).__name__}: {e}")
                continue
            r = runs[-1]
            target = f" (target {r['target']:.0%})" if r["target"] else ""
            lines.append(
                f"{backend} b={batch}: {r['decode_tok_per_s']:.1f} tok/s, "
                f"{r['ms_per_step']:.2f} ms/step, {r['fraction']:.1%} of roofline{target}"
            )
        del engine
    _free()
    result["notes"] = ctx.notes
    shape = f"{s.llama['num_hidden_layers']} layers x {s.llama['hidden_size']}"
    result["summary"] = f"{shape}, {bw:.0f} GB/s: " + "; ".join(lines)
    return result


def ttft(ctx: Ctx) -> dict:
    from pyserve.wire.main_to_worker import SamplingParams

    (length, n), rng = ctx.sizes.ttft, random.Random(7)
    engine = ctx.engine = ctx.engine or big_engine(ctx)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = ctx.sizes.llama["vocab_size"]
    engine.generate(random_prompts(rng, vocab, 1, length), params)  # warm-up
    alone = []
    for _ in range(3):
        started = time.perf_counter()
        engine.generate(random_prompts(rng, vocab, 1, length), params)
        alone.append(time.perf_counter() - started)
    engine.generate(random_prompts(rng, vocab, n, length), params)  # warm-up, larger steps
    with step_times(engine) as steps:
        started = time.perf_counter()
        engine.generate(random_prompts(rng, vocab, n, length), params)
    firsts = [end - started for _, end, _, _, count in steps for _ in range(count)]
    result = {
        "prompt_len": length, "batch1_ms": [1000 * t for t in alone],
        "batch1_median_ms": 1000 * statistics.median(alone), "concurrent": n,
        "concurrent_ms": [1000 * t for t in firsts],
        "concurrent_mean_ms": 1000 * statistics.mean(firsts),
        "concurrent_max_ms": 1000 * max(firsts),
    }  # fmt: skip
    result["summary"] = (
        f"{length}-token prompts: alone {result['batch1_median_ms']:.0f} ms; {n} at once "
        f"mean {result['concurrent_mean_ms']:.0f} ms, last {result['concurrent_max_ms']:.0f} ms"
    )
    return result


# ------------------------------------------------------------------------------- 6 quantized


def _median_seconds(fn, device: str, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def quant_matmul_check(ctx: Ctx) -> dict:
    """The 8-/4-bit Triton matmul on the 8B shape's projections (random integers and scales
    drawn on the device) against torch's bf16 matmul: GB/s of weight bytes read, at 1-64 rows."""
    import torch
    import torch.nn.functional as F

    from pyserve.worker.backends.triton.quant_matmul import quant_matmul

    device, c = ctx.sizes.device, ctx.sizes.llama
    bw = ctx.args.bandwidth_gbs or bandwidth(ctx)["gb_per_s_best"]
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    shapes = {"qkv": (h, h + 2 * kv), "o": (h, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    repeats = 20 if device == "cuda" else 2
    rows_list = (1, 16, 64) if device == "cuda" else (1, 16)
    gen = torch.Generator(device=device).manual_seed(0)
    runs, lines = [], []
    for name, (k, n) in shapes.items():
        groups = k // 32
        # quant_matmul's layout: outputs contiguous (u [k·bits/8, n], d and m [groups, n])
        d = (torch.rand(groups, n, device=device, generator=gen) * 0.01).half()
        m = (-d.float() * 8).half()
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        for bits in (4, 8):
            u = torch.randint(0, 256, (k * bits // 8, n), device=device, generator=gen)
            u = u.to(torch.uint8)
            weight_bytes = u.numel() + 4 * n * groups
            for rows in rows_list:
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=gen)
                ours = _median_seconds(
                    lambda x=x, u=u, bits=bits, d=d, m=m, n=n: quant_matmul(
                        x, u, d, m, bits=bits, group=32, n=n
                    ),
                    device,
                    repeats,
                )
                theirs = _median_seconds(lambda x=x, w=dense: F.linear(x, w), device, repeats)
                row = {
                    "shape": name, "k": k, "n": n, "bits": bits, "rows": rows,
                    "us": ours * 1e6, "gb_per_s": weight_bytes / ours / 1e9,
                    "fraction_of_bandwidth": weight_bytes / ours / 1e9 / bw,
                    "bf16_us": theirs * 1e6, "bf16_gb_per_s": 2 * n * k / theirs / 1e9,
                    "speedup_vs_bf16": theirs / ours,
                }  # fmt: skip
                runs.append(row)
        del dense
    _free()
    for bits in (4, 8):
        for rows in rows_list:
            picked = [r for r in runs if r["bits"] == bits and r["rows"] == rows]
            us = sum(r["us"] for r in picked)
            bf16 = sum(r["bf16_us"] for r in picked)
            share = statistics.mean(r["fraction_of_bandwidth"] for r in picked)
            lines.append(
                f"int{bits} x{rows}: a layer's 4 projections {us:.0f} us ({share:.0%} of "
                f"bandwidth) vs bf16 {bf16:.0f} us: {bf16 / us:.2f}x"
            )
    return {"bandwidth_gb_per_s": bw, "runs": runs, "summary": "; ".join(lines)}


# ------------------------------------------------------------------------------- 6 serving


def serve_load(ctx: Ctx, spec, prompts: list, warm: list, timeout: float) -> dict:
    import compare
    import serving

    _, concurrency, _, output_len = ctx.sizes.serve
    spec.start_timeout = min(spec.start_timeout, timeout)
    with compare.running(spec, ctx.out / "servers") as server:
        argv = ["--base-url", server.base_url, "--model", spec.model, "--timeout", str(timeout)]
        argv += ["--output-len", str(output_len), "--extra-body", json.dumps(spec.extra_body)]
        ns = serving.parse_args([*argv, "--ignore-eos" if spec.ignore_eos else "--no-ignore-eos"])
        status, body = compare._get(server.base_url + "/server_info")
        info = json.loads(body) if status == 200 and spec.kind == "pyserve" else {}
        if warm:
            asyncio.run(serving.run_load(ns, warm, len(warm), None))
        load = serving.run_load(ns, prompts, concurrency, None)
        results, wall = asyncio.run(asyncio.wait_for(load, 4 * timeout))
    row = serving.summarize(results, wall, concurrency, output_len)
    return row | {"argv": spec.argv, "backend": info.get("backend"), "dtype": info.get("dtype")}


def _pyserve_load(ctx: Ctx, quantization: str, label: str) -> tuple[dict, str, tuple]:
    """pyserve on the default model with the Triton backend at concurrency c: (its row, a
    summary line that calls it ``label``, the prompts and warm-up prompts for a peer)."""
    import compare
    import serving

    (count, concurrency, input_len, _), smoke = ctx.sizes.serve, ctx.args.cpu_smoke
    dtype = "float32" if smoke else "bfloat16"
    extra = ["--device", ctx.sizes.device, "--backend", "triton", "--dtype", dtype]
    extra += ["--quantization", quantization, "--kv-cache-dtype", dtype]
    tok = serving._tokenizer(None)
    prompts = serving.random_dataset(tok, count, input_len, seed=1)
    warm = [] if smoke else serving.random_dataset(tok, 2, input_len, seed=2)
    timeout = 600.0 if smoke else 120.0
    spec = compare.pyserve_spec(f"pyserve quantization {quantization}", extra)
    ours = serve_load(ctx, spec, prompts, warm, timeout)
    backend = (ours.get("backend") or {}).get("name")
    line = f"{label} {ours['output_tok_per_s']:.1f} output tok/s at c={concurrency} (backend "
    line += f"{backend}, {ours['completed']} ok, {ours['failed']} failed)"
    return ours, line, (prompts, warm, timeout, dtype)


def serving_quantized(ctx: Ctx) -> dict:
    """What ``pyserve run --device cuda`` serves by default: the GGUF's own 4-/8-bit blocks on
    the quantized Triton kernel (a group of its own, so that its time cannot cost the
    comparison above)."""
    if ctx.args.cpu_smoke:  # the 49152-row output projection alone takes minutes interpreted
        why = "skipped in Triton's interpreter (tests/test_triton_quant.py checks the kernel)"
        return {"skipped": why, "summary": why}
    ours, line, _ = _pyserve_load(ctx, "auto", "pyserve int4/int8")
    return {"pyserve": ours, "summary": line}


def serving_check(ctx: Ctx) -> dict:
    import compare

    from pyserve.model_files import default_model_path

    concurrency = ctx.sizes.serve[1]
    result: dict = {"concurrency": concurrency}
    ours, line, (prompts, warm, timeout, dtype) = _pyserve_load(ctx, "none", "pyserve")
    result["pyserve"] = ours
    binary = compare.VENV_BIN / "transformers"
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    missing += [] if binary.exists() else [str(binary)]
    if missing:
        why = f"transformers serve is not installed (no {', '.join(missing)})"
        result["transformers"] = {"skipped": f"{why}: pip install 'transformers[serving]'"}
        result["summary"] = f"{line}; {why}: no ratio"
        return result
    spec = compare.transformers_spec(compare.hf_dir_for(default_model_path()), dtype)
    spec.argv[spec.argv.index("--device") + 1] = ctx.sizes.device  # compare.py runs it on CPU
    peer = result["transformers"] = serve_load(ctx, spec, prompts, warm, timeout)
    ratio = result["ratio"] = ours["output_tok_per_s"] / max(peer["output_tok_per_s"], 1e-9)
    met = "met" if ratio >= SERVING_TARGET else "NOT met"
    result["summary"] = (
        f"{line}; transformers serve {peer['output_tok_per_s']:.1f}: {ratio:.2f}x "
        f"(target {SERVING_TARGET:.0f}x {met})"
    )
    return result


SECTIONS = {
    "environment": environment,
    "bandwidth": bandwidth,
    "parity": parity,
    "decode": decode,
    "ttft": ttft,
    "quant_matmul": quant_matmul_check,
    "serving": serving_check,
    "serving_quantized": serving_quantized,
}


# ------------------------------------------------------------------------------- driver


def run_group(args: argparse.Namespace) -> None:
    """In the child: the group's sections, each caught, the results written after each."""
    import compare

    compare._unwind_on_signals()  # a SIGTERM unwinds: servers stop, the model's files go
    ctx = Ctx(args, sizes_for(args), Path(args.out))
    names = args.section.split(",")
    path, done = ctx.out / "parts" / f"{names[0]}.json", {}
    try:
        for name in names:
            started = time.perf_counter()
            try:
                done[name] = SECTIONS[name](ctx) | {"status": "ok"}
            except Exception as e:
                err = _error(e)
                line = err["error"].splitlines()[0][:300]
                done[name] = err | {"status": "error", "summary": f"ERROR {line}"}
            done[name]["seconds"] = time.perf_counter() - started
            path.write_text(json.dumps(done, indent=1, default=str))
            print(f"[{name}] {done[name]['summary']}", flush=True)
    finally:
        if ctx.model_dir is not None:
            shutil.rmtree(ctx.model_dir, ignore_errors=True)


def run_child(
    args: argparse.Namespace, names: tuple[str, ...], limit: float, bw: float | None, scratch: str
) -> dict:
    out = Path(args.out)
    argv = [sys.executable, __file__, "--out", str(out), "--section", ",".join(names)]
    argv += ["--scratch", scratch]
    argv += ["--quick"] * args.quick + ["--cpu-smoke"] * args.cpu_smoke
    argv += ["--torch-decode"] * args.torch_decode + (["--bandwidth-gbs", str(bw)] if bw else [])
    log = out / "logs" / f"{names[0]}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        code: object = None
        try:
            code = proc.wait(limit)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            proc.send_signal(signal.SIGTERM)  # the child stops the servers it started
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if isinstance(e, KeyboardInterrupt):
                raise
            code = f"a stop after {limit:.0f} s (its share of the budget)"
    part = out / "parts" / f"{names[0]}.json"
    got = json.loads(part.read_text()) if part.exists() else {}
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    for name in names:
        if name not in got:
            why = f"no result: the child ended with {code}"
            got[name] = {"status": "error", "error": why, "log_tail": tail, "summary": why}
    return got


def orchestrate(args: argparse.Namespace) -> int:
    sizes, out = sizes_for(args), Path(args.out)
    budget = args.budget_s or sizes.budget_s
    for sub in ("parts", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    mode = "cpu-smoke" if args.cpu_smoke else "quick" if args.quick else "full"
    results: dict = {"mode": mode, "budget_s": budget, "sizes": vars(sizes), "sections": {}}

    def stop(signum, frame):  # a SIGTERM reaches the running child too
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    started, scratch = time.monotonic(), make_scratch(sizes)
    try:
        run_groups(args, results, budget, started, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"done in {results['elapsed_s']:.0f} s: {out / 'results.json'}, {out / 'summary.txt'}")
    return 0 if all(r["status"] == "ok" for r in results["sections"].values()) else 1


def run_groups(
    args: argparse.Namespace, results: dict, budget: float, started: float, scratch: str
) -> None:
    out, mode = Path(args.out), results["mode"]
    for group, cap in GROUPS:
        names = tuple(n for n in group if n in args.only)
        if not names:
            continue
        left = budget - (time.monotonic() - started)
        if left < min(cap, 30):
            got = {
                n: {"status": "skipped", "summary": "skipped: out of time budget"} for n in names
            }
        else:
            bw = results["sections"].get("bandwidth", {}).get("gb_per_s_best")
            got = run_child(args, names, min(cap, left), bw, scratch)
        results["sections"].update(got)
        results["elapsed_s"] = time.monotonic() - started
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        lines = [f"gpu_check {mode}: {results['elapsed_s']:.0f} s of a {budget:.0f} s budget"]
        lines += [f"{n}: {r['summary']}" for n, r in results["sections"].items()]
        (out / "summary.txt").write_text("\n".join(lines) + "\n")
        for name in names:
            print(f"{name}: {got[name]['summary']}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for results.json and summary.txt")
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, interpreted")
    p.add_argument("--torch-decode", action="store_true", help="decode with backend torch too")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for all the sections")
    p.add_argument("--only", default=None, help="these sections (comma-separated) alone")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child's group
    p.add_argument("--scratch", default=None, help=argparse.SUPPRESS)  # the model's directory
    p.add_argument("--bandwidth-gbs", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.only = args.only.split(",") if args.only else list(SECTIONS)
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}: {', '.join(SECTIONS)}")
    if args.section:
        run_group(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())

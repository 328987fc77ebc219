"""The default model's linear layers at small batch: our quantized kernel against torch's matmul.

One "token step" runs every linear layer of SmolLM2-135M once, as a decode step does: per layer
qkv 960×576, o 576×576, gate+up 3072×576, down 576×1536 (30 layers), then the tied lm_head
49152×576, each on M rows. The weights are random (speed does not depend on their values). In
the same run, round-robin so that a busy machine slows every contender alike, it times:

- torch ``F.linear`` with float32, bfloat16 and float16 weights stored [out, in];
- torch's own weight-only int8 CPU kernel (``torch._weight_int8pack_mm``, per-row scales);
- ``pyserve._kernels`` int8 (all layers 8-bit) and int4 (4-bit layers, 8-bit lm_head): groups of
  32 inputs with fp16 scales, activations quantized per row on the fly.

It reports the best and the median time of a step over the rounds and the bandwidth the best
implies (weight bytes / time), next to the machine's own copy bandwidth.

With ``--accuracy`` it also measures how far quantized logits are from float32 on the real
default model: Hugging Face transformers' Llama (loaded from the GGUF, float32) generates
greedily from a few chat prompts, then the same token sequences run teacher-forced through the
model before and after ``quantize_model_linears``: top-1 agreement, the log-probability change of
float32's top token, and how often fp32's top-2 gap was small where they disagree.

    .venv/bin/python benchmarks/bench_kernels.py                  # timing (minutes when busy)
    .venv/bin/python benchmarks/bench_kernels.py --accuracy       # + logits on the default model
    .venv/bin/python benchmarks/bench_kernels.py --accuracy --write-results   # update RESULTS.md
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# Before torch loads its OpenMP runtime: on a shared VM whose cores are oversubscribed, OpenMP's
# default spin-wait made every 2-thread torch op wait for a time slice (a decode step of ~1 s
# instead of ~25 ms); passive waiting keeps the torch contenders meaningful. Export
# OMP_WAIT_POLICY=ACTIVE to measure the other way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

from pyserve.worker import quant
from pyserve.worker.backends.cpu import quant_linear

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Kernels"
NOTES = "### Notes"

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
HEAD_SHAPE = (VOCAB, HIDDEN)
TORCH_CONTENDERS = ["fp32", "bf16", "fp16", "torch-int8"]
KERNEL_CONTENDERS = ["int8", "int4", "int8-a8", "int4-a8"]
# the accuracy check's chat prompts (prefill_activations.py takes them too)
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of copper.",
    "How do vaccines work?",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Hamlet.",
]


def model_shapes(layers: int) -> list[tuple[int, int]]:
    return LAYER_SHAPES * layers + [HEAD_SHAPE]


class Contender:
    """One way to run every matmul of a token step; ``run(M)`` does a whole step."""

    def __init__(
        self,
        name: str,
        weights: list,
        call,
        dtype: torch.dtype,
        nbytes: int,
        widths: tuple[int, ...] = (HIDDEN, INTERMEDIATE),  # the layers' input sizes
    ):
        self.name, self.weights, self.call, self.dtype, self.nbytes = (
            name,
            weights,
            call,
            dtype,
            nbytes,
        )
        self.widths = widths
        self.inputs: dict[int, dict[int, torch.Tensor]] = {}

    def run(self, rows: int) -> None:
        xs = self.inputs.setdefault(
            rows, {k: torch.randn(rows, k).to(self.dtype) for k in self.widths}
        )
        for w in self.weights:
            self.call(xs, w)


def build_contenders(layers: int, which: list[str]) -> list[Contender]:
    gen = torch.Generator().manual_seed(0)
    shapes = model_shapes(layers)
    fp32 = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    out = []

    def dense(name: str, dtype: torch.dtype) -> Contender:
        ws = [w.to(dtype) for w in fp32]
        return Contender(
            name,
            ws,
            lambda xs, w: F.linear(xs[w.shape[1]], w),
            dtype,
            sum(w.nbytes for w in ws),
        )

    if "fp32" in which:
        out.append(dense("torch fp32", torch.float32))
    if "bf16" in which:
        out.append(dense("torch bf16", torch.bfloat16))
    if "fp16" in which:
        out.append(dense("torch fp16", torch.float16))
    if "torch-int8" in which:
        packed = []
        for w in fp32:
            scale = w.abs().amax(1) / 127
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            packed.append((q, scale))
        out.append(
            Contender(
                "torch int8 weight-only",
                packed,
                lambda xs, p: torch._weight_int8pack_mm(xs[p[0].shape[1]], p[0], p[1]),
                torch.float32,
                sum(q.nbytes + s.nbytes for q, s in packed),
            )
        )
    packed: dict[int, list] = {}
    for name in KERNEL_CONTENDERS:
        if name not in which:
            continue
        bits = 8 if name.startswith("int8") else 4
        activation_bits = 8 if name.endswith("-a8") else 16
        if bits not in packed:
            packed[bits] = [quant.quantize_weight(w, bits) for w in fp32[:-1]]
            # the lm_head stays 8-bit in both modes
            packed[bits].append(quant.quantize_weight(fp32[-1], 8))
        ws = packed[bits]
        out.append(
            Contender(
                f"kernel {name[:4]} (int{activation_bits} activations)",
                ws,
                lambda xs, p, a=activation_bits: quant_linear.quantized_matmul(
                    xs[p.k], p, activation_bits=a
                ),
                torch.float32,
                sum(p.nbytes for p in ws),
            )
        )
    return out


# ---------------------------------------------------------------- K-quant files' own layouts

# The 0.5b Q4_K_M file of benchmarks/kquant_files.py: 24 Llama layers, hidden 1024, k and v 256
# rows, intermediate 2816; Q4_K but for v and down in the 12 layers llama.cpp's use_more_bits
# picks (the first and last eighth, every third between), which are Q6_K.
KQ_HIDDEN, KQ_KV, KQ_INTERMEDIATE, KQ_LAYERS = 1024, 256, 2816, 24


def more_bits(layer: int, layers: int) -> bool:
    eighth = layers // 8
    return layer < eighth or layer >= 7 * eighth or (layer - eighth) % 3 == 2


def random_packed(n: int, k: int, bits: int, gen: torch.Generator) -> quant.PackedWeight:
    """Random integers and small scales in the kernel's layout (speed does not depend on them)."""
    tiles, groups = -(-n // quant.TILE_ROWS), k // quant.GROUP
    data = torch.randint(0, 256, (tiles, groups, quant.GROUP * quant.TILE_ROWS * bits // 8),
                         dtype=torch.uint8, generator=gen)  # fmt: skip
    scales = (torch.rand(tiles, groups, 2, quant.TILE_ROWS, generator=gen) * 1e-3).half()
    return quant.PackedWeight(data, scales, n, k, bits, quant.GROUP)


def with_super_scales(w: quant.PackedWeight, gen: torch.Generator) -> quant.PackedWeight:
    """A 4-bit weight's integers with Q4_K's super-block scales (random D, −Dmin, sc, mn)."""
    if w.bits != 4:
        return w
    tiles, groups = w.data.shape[:2]
    halves = (torch.rand(tiles, groups // quant.SUPER_GROUPS, 32, generator=gen) * 1e-4).half()
    sc_mn = torch.randint(0, 64, (tiles, groups // quant.SUPER_GROUPS, 256), generator=gen)
    scales = torch.cat([halves.view(torch.uint8), sc_mn.to(torch.uint8)], dim=-1).contiguous()
    return quant.PackedWeight(w.data, scales, w.n, w.k, 4, quant.GROUP, super_scales=True)


def k_quant_contenders() -> list[Contender]:
    """One decode step's layer matmuls (no output projection) of the 0.5b Q4_K_M file's shapes:
    "widened", the fused qkv of a layer whose v is Q6_K packed all at 8 bits (as before), and
    "segments", its q and k kept at 4 bits beside the 8-bit v, both with fp16 scales per group
    for Q4_K; "+ Q4_K super-block scales": the segments with Q4_K's own scales (4.625 bits a
    weight). The integers are the same tensors in all three (4 bits for Q4_K, 8 for Q6_K)."""
    gen = torch.Generator().manual_seed(0)
    shared, widened, segmented = [], [], []
    qk_rows = KQ_HIDDEN + KQ_KV
    for i in range(KQ_LAYERS):
        wide = 8 if more_bits(i, KQ_LAYERS) else 4
        o = random_packed(KQ_HIDDEN, KQ_HIDDEN, 4, gen)
        gate_up = random_packed(2 * KQ_INTERMEDIATE, KQ_HIDDEN, 4, gen)
        down = random_packed(KQ_HIDDEN, KQ_INTERMEDIATE, wide, gen)
        shared.append((o, gate_up, down))
        widened.append(random_packed(qk_rows + KQ_KV, KQ_HIDDEN, wide, gen))
        if wide == 4:
            segmented.append(widened[-1])
        else:
            qk = random_packed(qk_rows, KQ_HIDDEN, 4, gen)
            v = random_packed(KQ_KV, KQ_HIDDEN, 8, gen)
            segmented.append(quant.SegmentedWeight((qk, v)))

    def own_scales(w):
        if isinstance(w, quant.SegmentedWeight):
            return quant.SegmentedWeight(tuple(with_super_scales(s, gen) for s in w.segments))
        return with_super_scales(w, gen)

    def steps(qkvs: list) -> list[tuple]:
        return [(qkv, *rest) for qkv, rest in zip(qkvs, shared, strict=True)]

    own = [tuple(own_scales(w) for w in weights) for weights in steps(segmented)]
    out = []
    for name, step in (
        ("widened (qkv at its widest part)", steps(widened)),
        ("segments", steps(segmented)),
        ("segments + Q4_K super-block scales", own),
    ):
        layers = []
        for weights in step:
            layers += [quant_linear.QuantLinear.from_packed(w, None) for w in weights]
        nbytes = sum(layer.packed.nbytes for layer in layers)
        out.append(
            Contender(
                name,
                layers,
                lambda xs, layer: layer(xs[layer.in_features]),
                torch.float32,
                nbytes,
                widths=(KQ_HIDDEN, KQ_INTERMEDIATE),
            )
        )
    return out


def k_quant_table(contenders: list[Contender], rows: list[int], times: dict) -> str:
    weights = sum(layer.out_features * layer.in_features for layer in contenders[0].weights)
    lines = [
        "| M | layout | MB a step | bits a weight | best ms/step | median ms/step | GB/s at best "
        "| vs widened |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in rows:
        base = min(times[(contenders[0].name, m)])
        for c in contenders:
            best, median = min(times[(c.name, m)]), statistics.median(times[(c.name, m)])
            lines.append(
                f"| {m} | {c.name} | {c.nbytes / 1e6:.1f} | {8 * c.nbytes / weights:.3f} | "
                f"{best * 1e3:.2f} | {median * 1e3:.2f} | {c.nbytes / best / 1e9:.1f} | "
                f"{base / best:.2f}× |"
            )
    return "\n".join(lines)


def copy_bandwidth() -> float:
    """GB/s of a 256 MiB tensor copy (bytes read + written), best of 5."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def time_contenders(contenders: list[Contender], rows: list[int], rounds: int) -> dict:
    times = {(c.name, m): [] for c in contenders for m in rows}
    for c in contenders:  # warm-up: first-touch page faults, the kernel's thread pool
        for m in rows:
            c.run(m)
    for _ in range(rounds):
        for m in rows:
            for c in contenders:
                start = time.perf_counter()
                c.run(m)
                times[(c.name, m)].append(time.perf_counter() - start)
    return times


def timing_table(contenders: list[Contender], rows: list[int], times: dict) -> str:
    lines = [
        "| M | contender | weights MB | best ms/step | median ms/step | GB/s at best | vs fp32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in rows:
        base = min(times[(contenders[0].name, m)])
        for c in contenders:
            best, median = min(times[(c.name, m)]), statistics.median(times[(c.name, m)])
            lines.append(
                f"| {m} | {c.name} | {c.nbytes / 1e6:.0f} | {best * 1e3:.2f} | "
                f"{median * 1e3:.2f} | {c.nbytes / best / 1e9:.1f} | {base / best:.2f}× |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- accuracy


def default_hf_model():
    """The default model's tokenizer, and transformers' float32 model of its GGUF."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion progress bar
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from pyserve.model_files import load_tokenizer, resolve_model

    transformers_logging.disable_progress_bar()
    source = resolve_model(None)
    path = Path(source.path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return load_tokenizer(source), model


def measure_accuracy(variants: list[tuple[str, int]], prompts: int, new_tokens: int) -> str:
    """Teacher-forced logits of the default model, float32 against each quantization mode."""
    import importlib.util

    tokenizer, model = default_hf_model()
    assert importlib.util.find_spec("pyserve._kernels") is not None
    questions = CHAT_PROMPTS[:prompts]
    sequences = []
    with torch.inference_mode():
        for q in questions:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompt = torch.tensor([ids])
            out = model.generate(
                prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
            sequences.append((len(ids), out))

    def logits_of(m) -> list[torch.Tensor]:
        with torch.inference_mode():
            # the positions that decode steps sample from: the prompt's last and every new token
            return [m(seq).logits[0, start - 1 : -1].float() for start, seq in sequences]

    reference = logits_of(model)
    rows = []
    for mode, activation_bits in variants:
        quantized = copy.deepcopy(model)
        # every row through the kernel: its per-row result does not depend on the batch size
        replaced = quant_linear.quantize_model_linears(
            quantized, mode, activation_bits=activation_bits, max_kernel_rows=1 << 30
        )
        got = logits_of(quantized)
        ref, new = torch.cat(reference), torch.cat(got)
        ref_lp, new_lp = ref.log_softmax(-1), new.log_softmax(-1)
        top = ref.argmax(-1, keepdim=True)
        agree = new.argmax(-1) == top[:, 0]
        drop = (new_lp.gather(1, top) - ref_lp.gather(1, top)).abs()[:, 0]
        top2 = ref_lp.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        kl = (ref_lp.exp() * (ref_lp - new_lp)).sum(-1)
        disagree_gaps = gap[~agree]
        rows.append(
            f"| {mode} | int{activation_bits} | {len(replaced)} | {len(ref)} | "
            f"{agree.float().mean() * 100:.1f}% | "
            f"{drop.mean():.4f} / {drop.max():.3f} | {kl.mean():.5f} / {kl.max():.4f} | "
            + (f"{disagree_gaps.max():.3f}" if len(disagree_gaps) else "—")
            + " |"
        )
    header = (
        "| weights | activations | linears replaced | positions | top-1 agreement with fp32 | "
        "abs Δ logprob of fp32's top token, mean / max | KL(fp32‖quantized), mean / max | "
        "largest fp32 top-2 gap where top-1 differs |\n|---|---|---|---|---|---|---|---|"
    )
    return header + "\n" + "\n".join(rows)


# ---------------------------------------------------------------------------------- output


def write_results(section: str, path: Path) -> None:
    """Replaces the '## Kernels' section of RESULTS.md (creating the file if needed), keeping
    its hand-written '### Notes' subsection, if any, at the end."""
    header = "# Benchmark results\n\nOne section per benchmark; each says how it was run.\n"
    text = path.read_text() if path.exists() else header
    out, notes, skipping, in_notes = [], [], False, False
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            skipping, in_notes = line.strip() == SECTION, False
        elif skipping and line.startswith("### "):
            in_notes = line.strip() == NOTES
        if not skipping:
            out.append(line)
        elif in_notes:
            notes.append(line)
    section = (
        section.rstrip("\n") + "\n" + ("\n" + "".join(notes).rstrip("\n") + "\n" if notes else "")
    )
    path.write_text("".join(out).rstrip("\n") + "\n\n" + section)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8], help="batch sizes M")
    parser.add_argument("--rounds", type=int, default=15, help="0: accuracy only")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[2], help="torch's and the kernel's, each"
    )
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument(
        "--contenders",
        nargs="+",
        default=[c for c in TORCH_CONTENDERS + KERNEL_CONTENDERS if c != "torch-int8"],
        choices=TORCH_CONTENDERS + KERNEL_CONTENDERS,
        help="int8/int4: the kernel with int16 activations (the default); -a8: int8 "
        "activations; torch-int8 (slow: 5-20x slower than fp32 here) only when named",
    )
    parser.add_argument("--accuracy", action="store_true", help="logits vs fp32, default model")
    parser.add_argument("--accuracy-prompts", type=int, default=8)
    parser.add_argument("--accuracy-tokens", type=int, default=48)
    parser.add_argument("--write-results", action="store_true", help="update RESULTS.md")
    parser.add_argument(
        "--k-quant",
        action="store_true",
        help="only the K-quant layouts on the 0.5b Q4_K_M file's layer shapes (printed, not "
        "written to RESULTS.md)",
    )
    args = parser.parse_args()

    kernels = quant.kernels()
    if args.k_quant:
        return k_quant_main(args)
    load_before = os.getloadavg()[0]
    bandwidth = copy_bandwidth()
    tables = []
    contenders = build_contenders(args.layers, args.contenders) if args.rounds > 0 else []
    for threads in args.threads if args.rounds > 0 else []:
        torch.set_num_threads(threads)
        kernels.set_num_threads(threads)
        times = time_contenders(contenders, args.rows, args.rounds)
        tables.append(
            f"{threads} thread{'s' if threads > 1 else ''}:\n\n"
            + timing_table(contenders, args.rows, times)
        )
    table = "\n\n".join(tables) or "(timing skipped: --rounds 0)"
    torch.set_num_threads(max(args.threads))
    kernels.set_num_threads(max(args.threads))
    load_after = os.getloadavg()[0]
    context = (
        f"Machine: {platform.processor() or platform.machine()}, nproc {os.cpu_count()}; "
        f"kernel ISA `{kernels.isa()}` (supported here: "
        f"{', '.join(kernels.supported_isas())}); torch {torch.__version__}, "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}.  \n"
        f"Load average before/after: {load_before:.1f} / {load_after:.1f}; "
        f"copy bandwidth (256 MiB tensor copy, read + write): {bandwidth:.1f} GB/s.  \n"
        f"{args.rounds} rounds, contenders interleaved; a step = {len(model_shapes(args.layers))} "
        "matmuls."
    )
    print(context + "\n\n" + table)
    accuracy = ""
    if args.accuracy:
        variants = [("int8", 16), ("int4", 16), ("int8", 8), ("int4", 8)]
        accuracy = measure_accuracy(variants, args.accuracy_prompts, args.accuracy_tokens)
        print("\n" + accuracy)
    if args.write_results:
        command = "`.venv/bin/python benchmarks/bench_kernels.py " + " ".join(sys.argv[1:]) + "`"
        section = (
            f"{SECTION}\n\nCommand: {command}  \nDate: "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  \n"
            f"{context}\n\n### Time of one decode step's linear layers\n\n{table}\n"
        )
        if accuracy:
            section += (
                "\n### Logits against float32 on the default model\n\n"
                f"Teacher-forced on fp32 greedy continuations of {args.accuracy_prompts} chat "
                f"prompts × {args.accuracy_tokens} tokens.\n\n{accuracy}\n"
            )
        write_results(section, ROOT / "benchmarks" / "RESULTS.md")
    return 0


def q4_k_streamed(rounds: int, threads: int, copies: int = 64) -> str:
    """Q4_K's two layouts at M = 1 on weights that do not fit the caches: ``copies`` distinct
    4096 × 4096 matrices (~650 MB in all, past this VM's 480 MB L3), one pass a round."""
    gen = torch.Generator().manual_seed(1)
    plain = [random_packed(4096, 4096, 4, gen) for _ in range(copies)]
    layouts = {
        "fp16 d, m per group": plain,
        "super-block scales": [with_super_scales(w, gen) for w in plain],
    }
    layers = {
        name: [quant_linear.QuantLinear.from_packed(w, None) for w in ws]
        for name, ws in layouts.items()
    }
    x = torch.randn(1, 4096)
    times: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(rounds + 1):  # the first round warms up
        for name, ls in layers.items():
            start = time.perf_counter()
            for layer in ls:
                layer(x)
            times[name].append(time.perf_counter() - start)
    lines = [
        "| threads | Q4_K layout | MB | bits a weight | best ms | median ms | GB/s at best "
        "| GB/s at median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, ls in layers.items():
        nbytes = sum(layer.packed.nbytes for layer in ls)
        best, median = min(times[name][1:]), statistics.median(times[name][1:])
        bits = 8 * nbytes / (copies * 4096 * 4096)
        lines.append(
            f"| {threads} | {name} | {nbytes / 1e6:.0f} | {bits:.3f} | {best * 1e3:.1f} | "
            f"{median * 1e3:.1f} | {nbytes / best / 1e9:.1f} | {nbytes / median / 1e9:.1f} |"
        )
    return "\n".join(lines)


def k_quant_main(args) -> int:
    kernels = quant.kernels()
    load_before = os.getloadavg()[0]
    streamed = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        kernels.set_num_threads(threads)
        streamed.append(q4_k_streamed(args.rounds, threads))
    print(
        "Q4_K at M = 1 from memory:\n\n"
        + "\n".join([streamed[0], *(t.split("\n", 2)[2] for t in streamed[1:])])
        + "\n"
    )
    contenders = k_quant_contenders()
    for threads in args.threads:
        torch.set_num_threads(threads)
        kernels.set_num_threads(threads)
        times = time_contenders(contenders, args.rows, args.rounds)
        print(f"{threads} thread{'s' if threads > 1 else ''}:\n")
        print(k_quant_table(contenders, args.rows, times) + "\n")
    print(
        f"kernel ISA `{kernels.isa()}`; load average before/after: {load_before:.1f} / "
        f"{os.getloadavg()[0]:.1f}; {args.rounds} rounds, layouts interleaved; a step = "
        f"{len(contenders[0].weights)} matmuls"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

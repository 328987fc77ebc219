"""How close decode runs to the memory roofline: pyserve and llama.cpp's server on the same GGUF
files, beside what this machine's bandwidth allows.

A decode token at batch 1 reads every weight once, plus the K/V of its context; no server can
produce tokens faster than ``bandwidth / bytes a token``. Per model file:

- **bytes a token**: the weights as the server holds them — pyserve's ``weight_bytes`` from
  /server_info (its packed projections as loaded; the token embeddings aside, one row a token),
  llama.cpp's the GGUF's tensor bytes (``token_embd`` aside unless it is also the output
  projection) — plus K/V at the mean context of the c=1 decode (layers × 2 × KV heads × head
  dim × 2 bytes, float16 in both);
- **bandwidth**: ``benchmarks/bandwidth.py``'s read-only figure on 2 threads (the servers run 2
  threads), measured at the start of the run (or ``--bandwidth-json``);
- **the loads** (one server at a time, each started here on a free port and stopped after;
  fresh prompts of the default tokenizer for every phase): c=1 with ``--c1-prompts`` prompts of
  ``--input-len`` tokens and ``--c1-output-len`` output tokens (ITL p50, TTFT p50); the TTFT of
  ``--long-prompts`` prompts of ``--long-len`` tokens, one at a time with 1 output token
  (llama-server started for it with one slot of 4096 tokens: compare.py's 32 slots of 32768
  give a slot 1024); c=32 with ``--c32-prompts`` prompts and ``--c32-output-len`` output tokens
  (output tok/s). llama-server otherwise runs with compare.py's flags.
- **the fraction**: roofline ITL (bytes / bandwidth) over the measured ITL p50 — 1.0 would be
  every byte at the probe's speed.

    .venv/bin/python benchmarks/roofline.py --models path/to/model-Q4_K_M.gguf
    .venv/bin/python benchmarks/roofline.py --sizes 0.5b 1.5b 3b --json benchmarks/out/roofline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bandwidth  # noqa: E402
import compare  # noqa: E402
import serving  # noqa: E402
from kquant_files import gguf_path  # noqa: E402

KQUANT_DIR = BENCH_DIR / "out" / "kquant-models"
KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------- the file


def gguf_facts(path: str) -> dict:
    """Layers, KV heads, head dim and the tensor bytes of a GGUF file (llama.cpp's bytes a
    token: all tensors, the token embeddings only where they are the output projection too, a
    mixture's experts by the share a token runs)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())

    def field(key: str):
        f = reader.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else None

    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    by_name = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(by_name.values())
    embd = by_name.get("token_embd.weight", 0)
    tied = "output.weight" not in by_name
    # a mixture of experts reads top_k of its experts a token: the stacked expert tensors count
    # by that share (the average over tokens; a batch's tokens may share experts)
    experts, used = field("expert_count"), field("expert_used_count")
    share = int(used) / int(experts) if experts else 1.0
    inactive = sum(n for name, n in by_name.items() if "_exps." in name) * (1.0 - share)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {
        "path": path,
        "file_bytes": os.path.getsize(path),
        "architecture": arch,
        "layers": int(field("block_count")),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": int(field("attention.head_count_kv") or heads),
        "head_dim": int(field("attention.key_length") or hidden // heads),
        "tensor_bytes": total,
        "token_embd_bytes": embd,
        "tied": tied,
        "decode_tensor_bytes": round((total if tied else total - embd) - inactive),
        "experts": f"{used} of {experts}" if experts else None,
        "tensor_types": types,
    }


def kv_bytes(facts: dict, context: float, dtype_bytes: int = 2) -> float:
    """K and V a decode token reads at ``context`` tokens."""
    return facts["layers"] * 2 * facts["kv_heads"] * facts["head_dim"] * dtype_bytes * context


# ----------------------------------------------------------------------------- the loads


def _load_ns(spec: compare.ServerSpec, base_url: str, output_len: int) -> argparse.Namespace:
    ns = serving.parse_args(
        [
            "--base-url",
            base_url,
            "--model",
            spec.model,
            "--output-len",
            str(output_len),
            "--extra-body",
            json.dumps(spec.extra_body),
            "--label",
            spec.name,
            "--ignore-eos" if spec.ignore_eos else "--no-ignore-eos",
        ]
    )
    return ns


async def _phase(spec, base_url, prompts, concurrency: int, output_len: int) -> dict:
    ns = _load_ns(spec, base_url, output_len)
    results, wall = await serving.run_load(ns, prompts, concurrency, None)
    summary = serving.summarize(results, wall, concurrency, output_len)
    summary["mean_input_len"] = statistics.mean(r.input_len for r in results if r.ok)
    if summary["failed"]:
        print(f"[{spec.name}] {summary['failed']} failed: {summary['errors']}")
    return summary


def build_prompts(tok, args: argparse.Namespace) -> dict[str, list]:
    """Fresh prompts per phase (no server answers a measured prompt from a cache)."""
    return {
        "warmup": serving.random_dataset(tok, 2, 64, seed=100),
        "c1": serving.random_dataset(tok, args.c1_prompts, args.input_len, seed=101),
        "long": serving.random_dataset(tok, args.long_prompts, args.long_len, seed=102),
        "c32": serving.random_dataset(tok, args.c32_prompts, args.input_len, seed=103),
    }


def run_server(spec, out_dir: Path, prompts: dict, args, phases: tuple[str, ...]) -> dict:
    got: dict = {}
    with compare.running(spec, out_dir) as server:
        if spec.kind == "pyserve":
            status, body = compare._get(server.base_url + "/server_info")
            info = json.loads(body) if status == 200 else {}
            got["weight_bytes"] = info.get("weight_bytes")
            got["kv_cache_dtype"] = (info.get("kv_cache") or {}).get("dtype")
            got["quantization"] = info.get("quantization")
            got["backend"] = info.get("backend")
            got["load_seconds"] = info.get("load_seconds")
        asyncio.run(_phase(spec, server.base_url, prompts["warmup"], 2, 8))
        if "c1" in phases:
            got["c1"] = asyncio.run(
                _phase(spec, server.base_url, prompts["c1"], 1, args.c1_output_len)
            )
            _report(spec.name, "c=1", got["c1"])
        if "long" in phases:
            got["long"] = asyncio.run(_phase(spec, server.base_url, prompts["long"], 1, 1))
            _report(spec.name, f"{args.long_len}-token prompt", got["long"])
        if "c32" in phases:
            got["c32"] = asyncio.run(
                _phase(spec, server.base_url, prompts["c32"], 32, args.c32_output_len)
            )
            _report(spec.name, "c=32", got["c32"])
    return got


def _report(name: str, what: str, s: dict) -> None:
    print(
        f"[{name}] {what}: {s['completed']} done, out {s['output_tok_per_s']:.1f} tok/s, "
        f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, ITL p50 {s['itl_p50_ms']:.1f} ms, "
        f"prompt {s['mean_input_len']:.0f} tokens, load average {os.getloadavg()[0]:.2f}"
    )


def measure_model(path: str, args, tok, out_dir: Path, gbs: float) -> dict:
    facts = gguf_facts(path)
    prompts = build_prompts(tok, args)
    row: dict = {"model": Path(path).parent.name or path, "facts": facts, "servers": {}}
    phases = tuple(p for p in ("c1", "long", "c32") if p not in args.skip)
    started = time.time()
    row["loadavg_before"] = os.getloadavg()
    spec = compare.pyserve_spec("pyserve", args.pyserve_args.split(), path)
    row["servers"]["pyserve"] = run_server(spec, out_dir, prompts, args, phases)
    binary = compare.find_llama_server(args.llama_server) if "llamacpp" in args.peers else None
    if binary:
        llama: dict = {}
        if "long" in phases:  # one slot of 4096 tokens: a 2,048-token prompt fits
            argv = [binary, "-m", path, "--host", "127.0.0.1", "--port", "{port}"]
            argv += ["-np", "1", "-c", "4096", "-t", "2"]
            one = compare.ServerSpec("llama.cpp-1slot", "llama.cpp", argv, Path(path).name)
            llama.update(run_server(one, out_dir, prompts, args, ("long",)))
        rest = tuple(p for p in phases if p != "long")
        if rest:
            llama.update(
                run_server(compare.llamacpp_spec(binary, path), out_dir, prompts, args, rest)
            )
        row["servers"]["llama.cpp"] = llama
    row["loadavg_after"] = os.getloadavg()
    row["seconds"] = round(time.time() - started)
    roofline(row, gbs)
    return row


def roofline(row: dict, gbs: float) -> None:
    """Bytes a token, roofline ITL and the fraction of it each server reached at c=1."""
    facts = row["facts"]
    for name, got in row["servers"].items():
        weights = got.get("weight_bytes") if name == "pyserve" else facts["decode_tensor_bytes"]
        c1 = got.get("c1")
        if not weights or not c1:
            continue
        context = c1["mean_input_len"] + c1["mean_output_len"] / 2
        dtype_bytes = KV_BYTES.get(got.get("kv_cache_dtype") or "float16", 2)
        kv = kv_bytes(facts, context, dtype_bytes)
        token_bytes = weights + kv
        roof_ms = token_bytes / (gbs * 1e9) * 1e3
        got["roofline"] = {
            "weight_bytes": weights,
            "kv_bytes": round(kv),
            "context": round(context),
            "bytes_per_token": round(token_bytes),
            "gbs": gbs,
            "roofline_itl_ms": round(roof_ms, 2),
            "roofline_tok_s": round(1e3 / roof_ms, 2),
            "fraction": round(roof_ms / c1["itl_p50_ms"], 3),
            "effective_gbs": round(token_bytes / (c1["itl_p50_ms"] / 1e3) / 1e9, 2),
        }


# ----------------------------------------------------------------------------- output


def table(rows: list[dict], bw: dict) -> str:
    lines = [
        f"Bandwidth (2 threads, read): {bw['read_gbs'].get('2')} GB/s "
        f"(triad {bw['triad_gbs'].get('2')}; 1 thread read {bw['read_gbs'].get('1')}, "
        f"triad {bw['triad_gbs'].get('1')}), arrays of {bw['array_mib']} MiB.",
        "",
        "| model | server | weights MB | KV MB at context | MB a token | roofline ITL ms "
        "| c=1 ITL p50 ms | fraction of roofline | c=1 TTFT p50 ms | long-prompt TTFT ms "
        "| c=32 out tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for name, got in row["servers"].items():
            r = got.get("roofline") or {}
            c1, c32, long = got.get("c1") or {}, got.get("c32") or {}, got.get("long") or {}

            def f(x, fmt="{:.1f}"):
                return fmt.format(x) if isinstance(x, (int, float)) else "—"

            kv = f"{f(r.get('kv_bytes', 0) / 1e6)} at {r.get('context', '—')}" if r else "—"
            lines.append(
                f"| {row['model']} | {name} | {f((r.get('weight_bytes') or 0) / 1e6, '{:.0f}')} "
                f"| {kv} | {f((r.get('bytes_per_token') or 0) / 1e6, '{:.0f}')} "
                f"| {f(r.get('roofline_itl_ms'))} | {f(c1.get('itl_p50_ms'))} "
                f"| {f(r.get('fraction'), '{:.2f}')} | {f(c1.get('ttft_p50_ms'), '{:.0f}')} "
                f"| {f(long.get('ttft_p50_ms'), '{:.0f}')} "
                f"({f(long.get('mean_input_len'), '{:.0f}')} tok) "
                f"| {f(c32.get('output_tok_per_s'))} |"
            )
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        ours, peer = row["servers"].get("pyserve", {}), row["servers"].get("llama.cpp", {})

        def ratio(phase: str, key: str, ours=ours, peer=peer) -> str:
            a, b = (ours.get(phase) or {}).get(key), (peer.get(phase) or {}).get(key)
            return f"{a / b:.2f}x" if a and b else "—"

        lines.append(
            f"{row['model']}: pyserve / llama.cpp: c=1 ITL p50 {ratio('c1', 'itl_p50_ms')}, "
            f"c=1 TTFT p50 {ratio('c1', 'ttft_p50_ms')}, "
            f"long-prompt TTFT {ratio('long', 'ttft_p50_ms')}, "
            f"c=32 out tok/s {ratio('c32', 'output_tok_per_s')} "
            f"(load average {row['loadavg_before'][0]:.2f} before, "
            f"{row['loadavg_after'][0]:.2f} after, {row['seconds']} s)"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=[], help="GGUF files")
    p.add_argument(
        "--sizes",
        nargs="*",
        default=[],
        help="kquant_files.py sizes (their Q4_K_M or MXFP4_MOE files)",
    )
    p.add_argument("--peers", nargs="*", default=["llamacpp"], choices=["llamacpp"])
    p.add_argument("--llama-server", default=None)
    p.add_argument("--pyserve-args", default="", help="flags for every pyserve run")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--c1-prompts", type=int, default=4)
    p.add_argument("--c1-output-len", type=int, default=64)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--long-prompts", type=int, default=2)
    p.add_argument("--c32-prompts", type=int, default=32)
    p.add_argument("--c32-output-len", type=int, default=64)
    p.add_argument("--skip", nargs="*", default=[], choices=["c1", "long", "c32"])
    p.add_argument("--bandwidth-json", type=Path, help="bandwidth.py --json output to use")
    p.add_argument("--bandwidth-repeats", type=int, default=10)
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="default: OUT_DIR/roofline.json")
    args = p.parse_args(argv)
    args.models += [str(gguf_path(s, KQUANT_DIR)) for s in args.sizes]
    if not args.models:
        p.error("give --models or --sizes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    compare._unwind_on_signals()
    sys.stdout.reconfigure(line_buffering=True)
    out_dir = args.out_dir or BENCH_DIR / "out" / time.strftime("roofline-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "-C", str(BENCH_DIR), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if args.bandwidth_json:
        bw = json.loads(args.bandwidth_json.read_text())
    else:
        bw = bandwidth.probe([1, 2], args.bandwidth_repeats)
        bandwidth.print_probe(bw)
    gbs = float(bw["read_gbs"]["2"])
    tok = serving._tokenizer(None)
    rows = []
    try:
        for path in args.models:
            print(f"\n== {path}")
            rows.append(measure_model(path, args, tok, out_dir, gbs))
            print(table(rows[-1:], bw))
    finally:
        compare.stop_all()
    result = {
        "argv": sys.argv[1:],
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": bandwidth.machine(),
        "bandwidth": bw,
        "rows": rows,
    }
    print()
    print(bandwidth.describe(result["machine"]))
    print(table(rows, bw))
    print(ratios(rows))
    path = args.json or out_dir / "roofline.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(compare.finite(result), indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

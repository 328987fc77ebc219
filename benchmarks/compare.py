"""Side by side: pyserve against llama.cpp's server and `transformers serve` on the same model.

One server at a time on 127.0.0.1 (a free port each), started here, waited for until ready, driven
with the same loads through ``benchmarks/serving.py`` (fresh prompts for every phase) and stopped
again (its whole process tree, also on Ctrl-C, SIGTERM or an error). Then a table of every run
with the real output lengths, the ratios pyserve / peer for output tok/s, TTFT p50 and ITL p50 at
each concurrency, issue 5's targets as met / NOT met, a JSON file per server, ``summary.json``
and a PNG plot.

- pyserve with its defaults, and once more per ``--pyserve-args`` string; each run is labelled
  with the dtype and weight quantization it reports in /server_info.
- llama.cpp's server on the same GGUF file (``--llama-server PATH``; otherwise one built earlier in
  the cache, otherwise built there from the llama-cpp-python sdist; skipped if that fails).
- ``transformers serve --continuous-batching`` on a Hugging Face directory made once (cached)
  from the same GGUF weights, at each dtype the pyserve runs computed in (or
  ``--transformers-dtype``); each pyserve run is compared with the one at its own dtype.
- The machine's ceiling in the same run: bf16 and fp32 matmuls over the model's shapes, turned
  into the output tok/s no server could beat on this workload (``bench_worker.matmul_ceiling``).
- The prefix-cache load: the first pyserve configuration with and without
  ``--disable-radix-cache`` on the shared-prefix dataset; TTFT p50 ratio and the hit rate it
  reports (/metrics) against the theoretical one.
- ``--profile-seconds N``: after the first pyserve run's loads, a py-spy recording of its worker
  (and main process) during one more load at the top concurrency, as the hottest frames.

Needs the bench extra (``pip install --no-build-isolation -e '.[test,bench]'``). Run it alone on
a quiet machine: every figure is wall-clock on shared cores.

    .venv/bin/python benchmarks/compare.py --quick                 # smoke run, ~10 minutes
    .venv/bin/python benchmarks/compare.py --png benchmarks/serving.png --profile-seconds 20
    .venv/bin/python benchmarks/compare.py --peers llamacpp --pyserve-args "--dtype bfloat16" \
        "--quantization int4"
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving.py, bench_worker.py

import serving

from pyserve.model_files import cache_dir, default_model_path

BENCH_DIR = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
PEERS = ("llamacpp", "transformers")
LLAMA_SERVER_FLAGS = ["-np", "32", "-c", "32768", "--cont-batching", "-t", "2"]
LLAMA_CMAKE_FLAGS = [
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_NATIVE=ON",
    "-DCMAKE_BUILD_TYPE=Release",
]
# ggml's AMX kernels die with SIGILL at their first tilezero on an AMX VM here (2026-12-03,
# Intel Xeon with amx_tile/amx_int8; a plain ldtilecfg + tilezero program runs there), so on a
# CPU that has AMX the peer is built without it: its AVX-512 VNNI kernels, what it runs elsewhere.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def llama_cmake_flags() -> list[str]:
    flags = list(LLAMA_CMAKE_FLAGS)
    cpu_flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if "amx_tile" in cpu_flags:
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
    return flags


# transformers serve rejects ignore_eos (422); an impossible eos id has the same effect.
TRANSFORMERS_NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1})}


class StartError(RuntimeError):
    """A server that exited or never became ready; the message carries its log's tail."""


# ----------------------------------------------------------------------------- servers


@dataclass
class ServerSpec:
    name: str  # label in tables, JSON file names and the plot
    kind: str  # "pyserve", "llama.cpp" or "transformers"
    argv: list[str]  # with {port} where the port goes
    model: str  # the model name sent in request bodies
    dtype: str | None = None  # the compute dtype, where known before the start
    ready_path: str = "/health"
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    start_timeout: float = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


class RunningServer:
    """A server process in its own process group; ``stop`` ends the whole group. Every one
    started is in ``STARTED`` until stopped, so that ``main`` can stop any left on an error."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [a.replace("{port}", str(self.port)) for a in spec.argv]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        env, self._state = None, None
        if spec.kind == "pyserve" and "--state-dir" not in argv:
            # a state directory of its own: an earlier server's prefix cache on disk (written at
            # its clean stop) would serve this one's prompts, and none is the user's
            self._state = tempfile.TemporaryDirectory(prefix="pyserve-bench-state-")
            env = {**os.environ, "PYSERVE_STATE_DIR": self._state.name}
        # A new session: a Ctrl-C in the terminal reaches only us, and we stop it in order.
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        self.argv = argv
        self.runs_as: dict = {"dtype": spec.dtype} if spec.dtype else {}
        STARTED.append(self)

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def wait_ready(self, poll_s: float = 0.5) -> float:
        started = time.monotonic()
        while time.monotonic() - started < self.spec.start_timeout:
            if self.proc.poll() is not None:
                raise StartError(
                    f"{self.spec.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            status, _ = _get(self.base_url + self.spec.ready_path, timeout=2.0)
            if status == 200:
                return time.monotonic() - started
            time.sleep(poll_s)
        raise StartError(f"{self.spec.name} not ready after {self.spec.start_timeout:.0f} s")

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server (it drains and stops its children), then SIGKILL whatever of
        its process tree is left (pyserve's children live in sessions of their own)."""
        if self not in STARTED:
            return
        STARTED.remove(self)
        tree = [pid for pid, _ in self.descendants()]
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group (the leader's pid): a hang
        for pid in tree:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._log.close()
        if self._state is not None:
            self._state.cleanup()
        left = [pid for pid in [self.proc.pid, *tree] if _alive(pid)]
        if left:
            print(f"[{self.spec.name}] WARNING: processes {left} still alive after the stop")

    def descendants(self) -> list[tuple[int, str]]:
        """(pid, command line) of every live process below the server, children first."""
        parent_of = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    stat = (entry / "stat").read_text()
                    parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        found, frontier = [], [self.proc.pid]
        while frontier:
            parent = frontier.pop(0)
            for pid, ppid in parent_of.items():
                if ppid == parent:
                    with contextlib.suppress(OSError):
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                        found.append((pid, cmd.replace(b"\0", b" ").decode(errors="replace")))
                    frontier.append(pid)
        return found


STARTED: list[RunningServer] = []


def stop_all() -> None:
    for server in list(STARTED):
        server.stop()


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped by someone else."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextlib.contextmanager
def running(spec: ServerSpec, out_dir: Path):
    server = RunningServer(spec, out_dir / f"{spec.name}.log")
    try:
        took = server.wait_ready()
        print(f"[{spec.name}] ready in {took:.1f} s at {server.base_url} (log {server.log_path})")
        yield server
    finally:
        server.stop()


def _unwind_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so that every ``running`` block stops its
    server (SIGINT too: a shell starts background jobs with it ignored)."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pyserve_spec(name: str, extra_args: list[str], gguf: str | None = None) -> ServerSpec:
    """pyserve on the default model, or on ``gguf`` (served under its file name's stem)."""
    argv = [sys.executable, "-m", "pyserve", "run", "--host", "127.0.0.1", "--port", "{port}"]
    if gguf is None:
        return ServerSpec(name, "pyserve", argv + extra_args, model="SmolLM2-135M-Instruct")
    argv += ["--model", gguf]
    return ServerSpec(name, "pyserve", argv + extra_args, model=Path(gguf).stem)


def pyserve_variant_name(extra: str) -> str:
    """'pyserve' for the defaults, else the flags as given: 'pyserve --quantization int4'."""
    return f"pyserve {' '.join(extra.split())}".strip()


def describe_pyserve(base_url: str) -> dict:
    """What a running pyserve really computes in, from /server_info: the dtype (``auto``
    resolved) and the weights' quantization where the server reports it (the resolved one
    first, then the flag)."""
    status, body = _get(base_url + "/server_info")
    if status != 200:
        return {}
    info = json.loads(body)
    config, kv = info.get("config") or {}, info.get("kv_cache") or {}
    dtype = info.get("dtype") or config.get("dtype")
    quant = next(
        (
            q
            for q in (info.get("quantization"), kv.get("quantization"), config.get("quantization"))
            if q
        ),
        None,
    )
    runs_as = {
        "dtype": str(dtype).removeprefix("torch.") if dtype else None,
        "quantization": None if quant == "none" else quant,
        "kv_cache_dtype": kv.get("dtype"),
    }
    if runs_as["quantization"] and config.get("activation_bits", 16) != 16:
        runs_as["activation_bits"] = config["activation_bits"]
    return runs_as


def runs_as_text(runs_as: dict) -> str:
    """'bfloat16, int4 weights' from describe_pyserve's answer; '' when nothing is known."""
    if not runs_as:
        return ""
    parts = [runs_as.get("dtype") or "?"]
    if runs_as.get("quantization"):
        parts.append(f"{runs_as['quantization']} weights")
    if runs_as.get("activation_bits"):
        parts.append(f"int{runs_as['activation_bits']} activations")
    if runs_as.get("kv_cache_dtype") and runs_as["kv_cache_dtype"] != runs_as.get("dtype"):
        parts.append(f"{runs_as['kv_cache_dtype']} K/V")
    return ", ".join(parts)


def llamacpp_spec(binary: str, gguf: str) -> ServerSpec:
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", *LLAMA_SERVER_FLAGS]
    return ServerSpec("llama.cpp", "llama.cpp", argv, model=Path(gguf).name)


def transformers_spec(hf_dir: Path, dtype: str) -> ServerSpec:
    argv = [
        str(VENV_BIN / "transformers"),
        "serve",
        str(hf_dir),
        "--continuous-batching",
        "--dtype",
        dtype,
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
    ]
    return ServerSpec(
        f"transformers {dtype}",
        "transformers",
        argv,
        # transformers serve loads the model a request names; the forced one is this path.
        model=str(hf_dir),
        dtype=dtype,
        ignore_eos=False,
        extra_body=TRANSFORMERS_NO_EOS,
    )


# ----------------------------------------------------------------------------- peers' files


def peers_dir() -> Path:
    return cache_dir() / "peers"


def find_llama_server(explicit: str | None) -> str | None:
    """The llama-server binary: the given one, a cached build, or a fresh build from the sdist."""
    if explicit:
        if not os.access(explicit, os.X_OK):
            print(f"[llama.cpp] --llama-server {explicit} is not an executable: skipping it")
            return None
        return explicit
    built = peers_dir() / "llama.cpp-build" / "bin" / "llama-server"
    if built.is_file():
        return str(built)
    print(
        f"[llama.cpp] no llama-server in {built.parent}: "
        "building it from the llama-cpp-python sdist"
    )
    try:
        return str(build_llama_server(peers_dir()))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        print(f"[llama.cpp] could not build llama-server ({e}): skipping it")
        return None


def build_llama_server(root: Path) -> Path:
    """pip download the llama-cpp-python sdist, unpack it, build its vendored llama-server."""
    root.mkdir(parents=True, exist_ok=True)
    sdist_dir = root / "sdist"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*pip, "-d", str(sdist_dir), "llama-cpp-python"], check=True)
    archives = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise RuntimeError(f"no llama_cpp_python-*.tar.gz in {sdist_dir}")
    src_root = root / "src"
    with tarfile.open(archives[-1]) as tar:
        tar.extractall(src_root, filter="data")
    source = next(src_root.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if source is None:
        raise RuntimeError(f"no vendor/llama.cpp inside {archives[-1].name}")
    cmake = shutil.which("cmake", path=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
    if cmake is None:
        raise RuntimeError("cmake not found")
    build = root / "llama.cpp-build"
    subprocess.run([cmake, "-S", str(source), "-B", str(build), *llama_cmake_flags()], check=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        [cmake, "--build", str(build), "--target", "llama-server", "-j", jobs], check=True
    )
    binary = build / "bin" / "llama-server"
    if not binary.is_file():
        raise RuntimeError(f"the build made no {binary}")
    return binary


def hf_dir_for(gguf: str) -> Path:
    """A Hugging Face directory (fp32 safetensors, config, tokenizer) made once from ``gguf``."""
    st = os.stat(gguf)
    out = peers_dir() / f"hf-{Path(gguf).stem}-{st.st_size}-{st.st_mtime_ns}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".hf-", dir=out.parent))
    try:
        # In a subprocess: loading the model here would keep its memory for the whole run.
        print(f"[transformers] writing a Hugging Face copy of {gguf} to {out} (once)")
        proc = subprocess.run(
            [sys.executable, __file__, "--make-hf-dir", gguf, str(tmp)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed")
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_hf_dir(gguf: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    # The config transformers reads from a GGUF names no architecture; serve needs one.
    model.config.architectures = ["LlamaForCausalLM"]
    # The weights are already dequantized to fp32; without this save_pretrained refuses
    # ("quantized with gguf and is not serializable").
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    print(f"wrote {out}")


# ----------------------------------------------------------------------------- the ceiling


def matmul_flops_per_token(config) -> tuple[float, float]:
    """(FLOPs of every layer's projections, FLOPs of the vocabulary projection) for one token."""
    h, inter = config.hidden_size, config.intermediate_size
    per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * inter
    return 2.0 * config.num_layers * per_layer, 2.0 * config.vocab_size * h


def matmul_gflops(gguf: str, rows_list: list[int], quick: bool) -> dict[str, dict[int, float]]:
    """GFLOP/s of the model's matmuls (every projection plus the vocabulary one) on M rows, per
    dtype, with torch on at most 2 threads."""
    import torch
    from bench_worker import matmul_ceiling

    from pyserve.worker.loading import open_checkpoint

    torch.set_num_threads(min(2, os.cpu_count() or 2))
    config = open_checkpoint(gguf).config
    flops = sum(matmul_flops_per_token(config))
    repeats = 2 if quick else 6
    return {
        name: {
            rows: matmul_ceiling(config, rows, dtype, repeats if rows > 1 else 4 * repeats)
            * flops
            / 1e9
            for rows in sorted(set(rows_list))
        }
        for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))
    }


def ceiling_report(
    gguf: str, gflops: dict[str, dict[int, float]], args: argparse.Namespace
) -> dict:
    """The output tok/s that matmuls at the measured rates allow on the load.

    A request costs a prefill of ``input_len`` rows (logits for its last row only) and
    ``output_len - 1`` decode rows (logits for each); prefill runs at the rate of 256-row
    matmuls, decodes at the rate of ``concurrency``-row ones.
    """
    from pyserve.worker.loading import open_checkpoint

    layers, vocab = matmul_flops_per_token(open_checkpoint(gguf).config)
    prefill_flops = args.input_len * layers + vocab
    decode_flops = (args.output_len - 1) * (layers + vocab)
    result: dict = {"flops_per_request": prefill_flops + decode_flops, "dtypes": {}}
    for name, rates in gflops.items():
        ceilings = {
            conc: args.output_len
            / (prefill_flops / (rates[256] * 1e9) + decode_flops / (rates[conc] * 1e9))
            for conc in args.concurrency
        }
        ms_per_token = 1000 * (layers + vocab) / (rates[1] * 1e9)
        result["dtypes"][name] = {
            "gflops_by_rows": rates,
            "batch1_ms_per_token": ms_per_token,
            "ceiling_output_tok_per_s": ceilings,
        }
        print(
            f"[ceiling] {name}: matmul GFLOP/s "
            + ", ".join(f"M={r}: {g:.0f}" for r, g in rates.items())
            + f"; batch-1 decode {ms_per_token:.1f} ms/token; ceiling output tok/s "
            + ", ".join(f"c={c}: {v:.0f}" for c, v in ceilings.items())
        )
    return result


def best_of(*measured: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """The faster figure of each (dtype, rows): the machine is shared, the quietest run counts."""
    return {
        name: {rows: max(m[name][rows] for m in measured) for rows in measured[0][name]}
        for name in measured[0]
    }


# ----------------------------------------------------------------------------- loads


def load_args(
    args: argparse.Namespace, spec: ServerSpec, base_url: str, **over
) -> argparse.Namespace:
    """serving.py's arguments for one server and load."""
    argv = [
        "--base-url",
        base_url,
        "--model",
        spec.model,
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--concurrency",
        *map(str, args.concurrency),
        "--extra-body",
        json.dumps(spec.extra_body),
        "--label",
        spec.name,
        "--warmup",
        str(args.warmup),
        "--ignore-eos" if spec.ignore_eos else "--no-ignore-eos",
    ]
    ns = serving.parse_args(argv)
    for key, value in over.items():
        setattr(ns, key, value)
    return ns


@dataclass
class PromptSets:
    """Fresh prompts for every phase: a server must not answer a measured prompt from a cache an
    earlier phase filled (llama.cpp's slots keep their last prompt and pick the slot with the
    longest common prefix; pyserve's radix cache keeps them all). Every server gets the same."""

    warmup: list[serving.Prompt]
    by_concurrency: dict[int, list[serving.Prompt]]
    profile: list[serving.Prompt]

    @classmethod
    def build(cls, tok, args: argparse.Namespace) -> PromptSets:
        def make(n: int, seed: int) -> list[serving.Prompt]:
            return serving.random_dataset(tok, n, args.input_len, seed)

        return cls(
            warmup=make(args.warmup, seed=10_000),
            by_concurrency={c: make(args.num_prompts, seed=c) for c in args.concurrency},
            profile=make(args.num_prompts, seed=20_000) if args.profile_seconds else [],
        )


def token_counter(tok):
    return lambda text: len(tok.encode(text, add_special_tokens=False))


async def measure(
    args: argparse.Namespace, server: RunningServer, prompts: PromptSets, tok
) -> dict:
    """The warm-up, then each concurrency on its own prompts; serving.py's JSON layout plus
    what the server is (kind, command line, dtype)."""
    ns = load_args(args, server.spec, server.base_url)
    if prompts.warmup:
        await serving.run_load(ns, prompts.warmup, len(prompts.warmup), None)
    runs = []
    for concurrency, measured in prompts.by_concurrency.items():
        results, wall = await serving.run_load(ns, measured, concurrency, None)
        runs.append(
            serving.summarize(results, wall, concurrency, args.output_len, token_counter(tok))
        )
    serving.print_table(runs, server.spec.name)
    return {
        "label": server.spec.name,
        "kind": server.spec.kind,
        "argv": server.argv,
        "runs_as": server.runs_as,
        "args": vars(ns),
        "runs": runs,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def scrape_prefix_counters(base_url: str) -> tuple[float, float] | None:
    """(queried, hit) prompt tokens from pyserve's /metrics, or None."""
    status, body = _get(base_url + "/metrics")
    if status != 200:
        return None
    values = {}
    for line in body.decode().splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    queried = values.get("pyserve_prefix_cache_queried_tokens_total")
    hit = values.get("pyserve_prefix_cache_hit_tokens_total")
    if queried is None or hit is None:
        return None
    return queried, hit


def theoretical_hit_rate(
    tok, prompts: list[serving.Prompt], block: int, in_flight: int = 0
) -> float:
    """Prompt tokens a perfect cache serves: each prompt's longest prefix shared with any prompt
    sent before it (cut to whole blocks: caches hold blocks), over all prompt tokens.

    ``in_flight`` > 0: as if the ``in_flight`` prompts sent just before each one were still
    being prefilled and had cached nothing yet (a pessimistic bound for bounded concurrency)."""
    seqs = [tok.encode(p.text, add_special_tokens=False) for p in prompts]
    hit = 0
    for i, seq in enumerate(seqs):
        best = 0
        for prev in seqs[: max(0, i - in_flight)]:
            n = 0
            for a, b in zip(seq, prev, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        hit += min(best, len(seq) - 1) // block * block  # the last token is always computed
    return hit / max(1, sum(len(s) for s in seqs))


async def prefix_load(args: argparse.Namespace, server: RunningServer, prompts, warm, tok) -> dict:
    ns = load_args(
        args, server.spec, server.base_url, concurrency=[args.prefix_concurrency], warmup=0
    )
    ns.output_len = args.prefix_output_len
    await serving.run_load(ns, warm, len(warm), None)  # warm-up on unrelated prompts
    before = scrape_prefix_counters(server.base_url)
    results, wall = await serving.run_load(ns, prompts, args.prefix_concurrency, None)
    after = scrape_prefix_counters(server.base_url)
    summary = serving.summarize(
        results, wall, args.prefix_concurrency, args.prefix_output_len, token_counter(tok)
    )
    if before and after and after[0] > before[0]:
        summary["metrics_hit_rate"] = (after[1] - before[1]) / (after[0] - before[0])
    if summary["input_tokens"]:
        summary["usage_hit_rate"] = summary["cached_tokens"] / summary["input_tokens"]
    serving.print_table([summary], f"{server.spec.name}, shared prefix")
    return summary


# ----------------------------------------------------------------------------- profiling


def profile_worker(args: argparse.Namespace, server: RunningServer, prompts, out_dir: Path) -> dict:
    """py-spy records pyserve's worker and main process during one more load at the top
    concurrency; returns the hottest frames of each."""
    py_spy = shutil.which("py-spy", path=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
    if py_spy is None:
        print("[profile] py-spy not found (pip install py-spy): skipping the profile")
        return {}
    targets = {"main": server.proc.pid}
    for pid, cmd in server.descendants():
        if "pyserve.worker" in cmd:
            targets["worker"] = pid
    recorders = {}
    for role, pid in targets.items():
        raw = out_dir / f"py-spy-{role}.txt"
        argv = [py_spy, "record", "--native", "--pid", str(pid), "--rate", "50"]
        argv += ["--duration", str(args.profile_seconds), "--format", "raw", "--output", str(raw)]
        recorders[role] = (
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
            raw,
        )
    ns = load_args(
        args, server.spec, server.base_url, concurrency=[max(args.concurrency)], warmup=0
    )
    try:
        results, wall = asyncio.run(serving.run_load(ns, prompts, max(args.concurrency), None))
    finally:
        for proc, _ in recorders.values():
            try:
                proc.wait(args.profile_seconds + 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    report = {"load": serving.summarize(results, wall, max(args.concurrency), args.output_len)}
    for role, (proc, raw) in recorders.items():
        if not raw.is_file():
            err = proc.stderr.read().decode(errors="replace")[-300:] if proc.stderr else ""
            print(f"[profile] py-spy on {role} wrote nothing: {err}")
            continue
        report[role] = hottest_frames(raw)
        print(
            f"\n== py-spy, pyserve {role} (pid {targets[role]}), {raw}: "
            f"{report[role]['samples']} samples, {100 * report[role]['idle_share']:.0f}% waiting; "
            "shares of the busy ones:"
        )
        for frame, share in report[role]["self"][:12]:
            print(f"  self {100 * share:5.1f}%  {frame}")
        # Python frames by inclusive share, below the entry chain that every sample shares.
        inner = [(f, x) for f, x in report[role]["total"] if x < 0.99]
        for frame, share in inner[:15]:
            print(f"  total {100 * share:4.1f}%  {frame}")
    return report


# A sample with one of these on its stack is a thread waiting (py-spy --native does not always
# tell idle threads apart itself).
IDLE_MARKERS = (
    "epoll_wait",
    "epoll_pwait",
    "poll (",
    "select (",
    "acquire_lock",
    "SimpleQueue_get",
    "cond_wait",
    "cond_timedwait",
    "nanosleep",
    "sem_wait",
    "Poller.poll",
    "zmq_poll",
    "Socket.recv",
)


def hottest_frames(raw: Path, top: int = 40) -> dict:
    """From py-spy's collapsed stacks: the share of samples spent waiting, and per frame the
    share of busy samples where it is the innermost frame (self) or a Python frame anywhere on
    the stack (total)."""
    own: collections.Counter = collections.Counter()
    anywhere: collections.Counter = collections.Counter()
    total = idle = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        if any(marker in stack for marker in IDLE_MARKERS):
            idle += n
            continue
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            if ".py:" in frame:
                anywhere[frame] += n
    busy = max(1, total - idle)
    return {
        "samples": total,
        "idle_share": idle / max(1, total),
        "self": [(f, n / busy) for f, n in own.most_common(top)],
        "total": [(f, n / busy) for f, n in anywhere.most_common(top)],
    }


# ----------------------------------------------------------------------------- report

RATIO_KEYS = ("output_tok_per_s", "ttft_p50_ms", "itl_p50_ms")


def comparable(ours: dict, peer: dict, same_dtype_only: bool) -> bool:
    """transformers runs at pyserve's dtype: each pyserve run meets the transformers run at its
    own dtype only (unless --transformers-dtype chose one for all)."""
    if peer["kind"] != "transformers" or not same_dtype_only:
        return True
    return peer["runs_as"].get("dtype") == ours["runs_as"].get("dtype")


def ratio_table(results: dict[str, dict], same_dtype_only: bool = True) -> list[dict]:
    """pyserve / peer for output tok/s, TTFT p50 and ITL p50 at each concurrency."""
    rows = []
    for ours_name, ours in results.items():
        if ours["kind"] != "pyserve":
            continue
        for peer_name, peer in results.items():
            if peer["kind"] == "pyserve" or not comparable(ours, peer, same_dtype_only):
                continue
            theirs = {r["concurrency"]: r for r in peer["runs"]}
            for mine in ours["runs"]:
                other = theirs.get(mine["concurrency"])
                if other is None:
                    continue
                rows.append(
                    {
                        "pyserve": ours_name,
                        "peer": peer_name,
                        "peer_kind": peer["kind"],
                        "concurrency": mine["concurrency"],
                        **{key: _ratio(mine[key], other[key]) for key in RATIO_KEYS},
                    }
                )
    return rows


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b:
        return float("nan")
    return a / b


def print_summary(results: dict[str, dict], ratios: list[dict]) -> None:
    print("\n== all servers (out len: the mean real output length / requested)")
    print(
        f"{'server':<30} {'runs as':<22} {'conc':>4} {'ok':>4} {'out tok/s':>10} "
        f"{'TTFT p50':>10} {'ITL p50':>9} {'out len':>9}"
    )
    for name, data in results.items():
        for r in data["runs"]:
            print(
                f"{name:<30} {runs_as_text(data['runs_as']):<22} {r['concurrency']:>4} "
                f"{r['completed']:>4} {r['output_tok_per_s']:>10.1f} "
                f"{r['ttft_p50_ms']:>8.0f}ms {r['itl_p50_ms']:>7.1f}ms "
                f"{r['mean_output_len']:>5.0f}/{r['requested_output_len']}"
            )
    if ratios:
        print("\n== ratios pyserve / peer (tok/s: higher is better; TTFT, ITL: lower is better)")
        print(
            f"{'pyserve':<30} {'peer':<22} {'conc':>4} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8}"
        )
        for r in ratios:
            print(
                f"{r['pyserve']:<30} {r['peer']:<22} {r['concurrency']:>4} "
                f"{r['output_tok_per_s']:>6.2f}× {r['ttft_p50_ms']:>8.2f}× {r['itl_p50_ms']:>7.2f}×"
            )


def target_checks(
    args: argparse.Namespace,
    results: dict[str, dict],
    ratios: list[dict],
    ceiling: dict | None,
    prefix: dict,
) -> list[dict]:
    """Issue 5's targets, one row each: what, for which pyserve run, the measured figure, the
    bound and whether it is met (None: not measurable, a peer or phase missing). The issue's
    c=32 and c=1 are the highest and lowest concurrency run (the same in a full run)."""
    top, low = max(args.concurrency), min(args.concurrency)
    rows: list[dict] = []

    def add(target: str, server: str, conc: int | None, value, bound: float) -> None:
        """``bound`` > 0: at least that; ≤ 0: at most its magnitude."""
        if value is None or value != value:  # None or NaN: a peer or phase is missing
            met = None
        else:
            met = value >= bound if bound > 0 else value <= -bound
        text = f"≥ {bound:g}" if bound > 0 else f"≤ {-bound:.3g}"
        rows.append(
            {
                "target": target,
                "server": server,
                "concurrency": conc,
                "measured": value,
                "bound": text,
                "met": met,
            }
        )

    for name, data in results.items():
        if data["kind"] != "pyserve":
            continue
        at = _ratio_lookup(ratios, name)
        checks = [
            ("output tok/s vs llama.cpp", top, at("llama.cpp", top, "output_tok_per_s"), 4.0),
            ("TTFT p50 vs llama.cpp", top, at("llama.cpp", top, "ttft_p50_ms"), -1 / 3),
            ("ITL p50 vs llama.cpp", low, at("llama.cpp", low, "itl_p50_ms"), -1.5),
            (
                "output tok/s vs transformers (same dtype)",
                top,
                at("transformers", top, "output_tok_per_s"),
                6.0,
            ),
            ("output tok/s / bf16 matmul ceiling", top, _ceiling_share(data, ceiling, top), 0.6),
        ]
        for target, conc, value, bound in checks:
            add(target, name, conc, value, bound)
    if "radix" in prefix and "no-radix" in prefix:
        conc = args.prefix_concurrency
        speedup = _ratio(prefix["no-radix"]["ttft_p50_ms"], prefix["radix"]["ttft_p50_ms"])
        add("prefix cache: TTFT p50 without / with", "pyserve-radix", conc, speedup, 4.0)
        reported = prefix["radix"].get("metrics_hit_rate")
        gap = None if reported is None else abs(reported - prefix["theoretical_hit_rate"]) * 100
        add("prefix cache: |hit rate − theoretical| (points)", "pyserve-radix", conc, gap, -5.0)
    for name, data in results.items():  # every figure above assumes full-length outputs
        off = sum(r.get("off_length_outputs", 0) for r in data["runs"])
        add("outputs not of the requested length", name, None, off, -0.0)
    return rows


def _ratio_lookup(ratios: list[dict], pyserve_name: str):
    """at(peer kind, concurrency, key) -> the ratio for this pyserve run, or None."""
    table = {(r["peer_kind"], r["concurrency"]): r for r in ratios if r["pyserve"] == pyserve_name}

    def at(kind: str, conc: int, key: str) -> float | None:
        row = table.get((kind, conc))
        return None if row is None else row[key]

    return at


def _ceiling_share(data: dict, ceiling: dict | None, conc: int) -> float | None:
    """Output tok/s at ``conc`` over the bf16 matmul ceiling for the same load."""
    if not ceiling:
        return None
    bf16 = ceiling["dtypes"]["bfloat16"]["ceiling_output_tok_per_s"]
    mine = {r["concurrency"]: r for r in data["runs"]}
    if conc not in bf16 or conc not in mine:
        return None
    return mine[conc]["output_tok_per_s"] / bf16[conc]


def print_targets(rows: list[dict], args: argparse.Namespace) -> None:
    print("\n== issue 5 targets")
    if (max(args.concurrency), min(args.concurrency)) != (32, 1):
        print(
            f"(the issue's c=32 and c=1 checked at c={max(args.concurrency)} and "
            f"c={min(args.concurrency)}: this is not the issue's load)"
        )
    print(f"{'':>7}  {'target':<48} {'server':<30} {'conc':>4} {'measured':>9} {'bound':>8}")
    for r in rows:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[r["met"]]
        value = "-" if r["measured"] is None else f"{r['measured']:.2f}"
        conc = "" if r["concurrency"] is None else r["concurrency"]
        print(
            f"{verdict:>7}  {r['target']:<48} {r['server']:<30} {conc:>4} {value:>9} "
            f"{r['bound']:>8}"
        )


def finite(obj):
    """``obj`` with NaN and infinities as None (strict JSON) and every key a string."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(finite(data), indent=2, default=str, allow_nan=False))


def file_stem(name: str) -> str:
    return name.replace(" ", "_").replace("/", "_")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small smoke run")
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS)
    p.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    p.add_argument("--model", default=None, help="a GGUF file for every server (default: SmolLM2)")
    p.add_argument(
        "--pyserve-args",
        nargs="+",
        action="extend",
        default=[],
        metavar="ARGS",
        help='more pyserve runs, one per quoted string: "--dtype bfloat16" "--quantization int4"',
    )
    p.add_argument("--no-pyserve-default", action="store_true", help="only the --pyserve-args runs")
    p.add_argument(
        "--transformers-dtype",
        default=None,
        help="one dtype for transformers serve; default: each dtype the pyserve runs used",
    )
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-prefix", action="store_true", help="skip the prefix-cache load")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--prefix-output-len", type=int, default=32)
    p.add_argument("--prefix-concurrency", type=int, default=8)
    p.add_argument("--no-ceiling", action="store_true", help="skip the matmul ceiling")
    p.add_argument("--profile-seconds", type=int, default=0, help="py-spy pyserve's worker")
    p.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/out/compare-…")
    p.add_argument("--png", type=Path, default=None, help="default: OUT_DIR/serving.png")
    p.add_argument("--make-hf-dir", nargs=2, metavar=("GGUF", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 8, 64, 16
        args.concurrency = [1, 4]
        args.groups, args.prompts_per_group, args.system_len = 2, 4, 256
        args.question_len, args.prefix_output_len, args.prefix_concurrency = 16, 8, 4
        args.warmup = 1
        args.profile_seconds = min(args.profile_seconds, 5)
    args.concurrency = sorted(set(args.concurrency))
    return args


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()
    return f"{cpu}, nproc {os.cpu_count()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_hf_dir:
        make_hf_dir(*args.make_hf_dir)
        return 0
    _unwind_on_signals()
    sys.stdout.reconfigure(line_buffering=True)  # a log file shows progress as it happens
    try:
        return compare(args)
    finally:
        stop_all()  # servers an error left running


def compare(args: argparse.Namespace) -> int:
    gguf = args.model or default_model_path()
    out_dir = args.out_dir or BENCH_DIR / "out" / time.strftime("compare-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    machine_start = machine_line()
    print(f"compare.py {' '.join(sys.argv[1:])}\n{started}; {machine_start}\nout: {out_dir}")

    ceiling_rows = [1, 256, *args.concurrency]
    gflops_start = None if args.no_ceiling else matmul_gflops(gguf, ceiling_rows, args.quick)
    if gflops_start:
        ceiling_report(gguf, gflops_start, args)

    tok = serving._tokenizer(None)
    prompts = PromptSets.build(tok, args)
    bench = Bench(args, tok, prompts, out_dir)
    variants = ([] if args.no_pyserve_default else [""]) + args.pyserve_args
    for i, extra in enumerate(variants):
        spec = pyserve_spec(pyserve_variant_name(extra), extra.split(), args.model)
        bench.run(spec, profile=i == 0)
    for spec in peer_specs(args, gguf, bench.results):
        bench.run(spec)

    prefix: dict = {}
    if not args.no_prefix and variants:
        prefix = run_prefix_comparison(args, tok, out_dir, variants[0].split())

    ceiling = None
    if gflops_start:  # again at the end; each figure is the better of the two
        print("\n[ceiling] measured again after the servers; the better of the two counts:")
        ceiling = ceiling_report(
            gguf, best_of(gflops_start, matmul_gflops(gguf, ceiling_rows, args.quick)), args
        )
    results = bench.results
    ratios = ratio_table(results, same_dtype_only=args.transformers_dtype is None)
    print_summary(results, ratios)
    targets = target_checks(args, results, ratios, ceiling, prefix)
    print_targets(targets, args)
    for name, why in bench.failures.items():
        print(f"FAILED: {name}: {why.splitlines()[0] if why else ''}")
    png = args.png or out_dir / "serving.png"
    if results and importlib.util.find_spec("matplotlib") is None:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")
    elif results:
        serving.plot([str(out_dir / f"{file_stem(n)}.json") for n in results], str(png))
    summary = {
        "schema": 2,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine_start": machine_start,
        "machine_end": machine_line(),
        "argv": sys.argv[1:],
        "load": {k: getattr(args, k) for k in LOAD_KEYS},
        "ceiling": ceiling,
        "results": results,
        "failures": bench.failures,
        "ratios": ratios,
        "prefix": prefix,
        "profile": bench.profile,
        "targets": targets,
        "png": str(png),
    }
    write_json(out_dir / "summary.json", summary)
    print(f"\nwrote {out_dir / 'summary.json'}; {machine_line()}")
    return 1 if bench.failures else 0


LOAD_KEYS = (
    "num_prompts",
    "input_len",
    "output_len",
    "concurrency",
    "warmup",
    "groups",
    "prompts_per_group",
    "system_len",
    "question_len",
    "prefix_output_len",
    "prefix_concurrency",
)


class Bench:
    """Runs one server at a time through the loads and keeps what came out: results by server
    name, failures (a server that did not start or broke down: the others still run)."""

    def __init__(self, args: argparse.Namespace, tok, prompts: PromptSets, out_dir: Path):
        self.args, self.tok, self.prompts, self.out_dir = args, tok, prompts, out_dir
        self.results: dict[str, dict] = {}
        self.failures: dict[str, str] = {}
        self.profile: dict = {}

    def run(self, spec: ServerSpec, profile: bool = False) -> None:
        try:
            with running(spec, self.out_dir) as server:
                if spec.kind == "pyserve":
                    server.runs_as = describe_pyserve(server.base_url)
                    print(f"[{spec.name}] runs as {runs_as_text(server.runs_as)}")
                result = asyncio.run(measure(self.args, server, self.prompts, self.tok))
                result["label"] = display_label(spec.name, server.runs_as)
                self.results[spec.name] = result
                write_json(self.out_dir / f"{file_stem(spec.name)}.json", result)
                if profile and self.args.profile_seconds:
                    self.profile = profile_worker(
                        self.args, server, self.prompts.profile, self.out_dir
                    )
        except StartError as e:
            print(f"[{spec.name}] did not start, skipping it: {e}")
            self.failures[spec.name] = f"did not start: {e}"
        except Exception as e:  # one broken server must not cost the others' figures
            traceback.print_exc()
            print(f"[{spec.name}] failed, going on without it: {type(e).__name__}: {e}")
            self.failures[spec.name] = f"{type(e).__name__}: {e}"


def display_label(name: str, runs_as: dict) -> str:
    text = runs_as_text(runs_as)
    return f"{name} ({text})" if text and text not in name else name


def peer_specs(args: argparse.Namespace, gguf: str, results: dict[str, dict]) -> list[ServerSpec]:
    """llama.cpp's server on the GGUF; transformers serve at each dtype pyserve ran in."""
    specs = []
    if "llamacpp" in args.peers:
        binary = find_llama_server(args.llama_server)
        if binary:
            specs.append(llamacpp_spec(binary, gguf))
    if "transformers" in args.peers:
        try:
            hf_dir = hf_dir_for(gguf)
        except (OSError, RuntimeError) as e:
            print(f"[transformers] could not make a Hugging Face directory ({e}): skipping it")
            return specs
        for dtype in transformers_dtypes(args, results):
            specs.append(transformers_spec(hf_dir, dtype))
    return specs


def transformers_dtypes(args: argparse.Namespace, results: dict[str, dict]) -> list[str]:
    """The one asked for, else the dtypes the pyserve runs reported, else float32."""
    if args.transformers_dtype:
        return [args.transformers_dtype]
    found = [
        data["runs_as"].get("dtype")
        for data in results.values()
        if data["kind"] == "pyserve" and data["runs_as"].get("dtype")
    ]
    return list(dict.fromkeys(found)) or ["float32"]


def run_prefix_comparison(
    args: argparse.Namespace, tok, out_dir: Path, base_args: list[str]
) -> dict:
    """pyserve (the first configuration run) with and without the radix cache on the
    shared-prefix dataset."""
    prompts = serving.shared_prefix_dataset(
        tok, args.groups, args.prompts_per_group, args.system_len, args.question_len, seed=1
    )
    warm = serving.random_dataset(tok, 2, 32, seed=2)
    prefix: dict = {
        "pyserve_args": base_args,
        "theoretical_hit_rate": theoretical_hit_rate(tok, prompts, block=16),
        # The same if the prompts still in flight when one is sent had cached nothing yet.
        "theoretical_hit_rate_in_flight_miss": theoretical_hit_rate(
            tok, prompts, block=16, in_flight=args.prefix_concurrency - 1
        ),
    }
    for name, extra in (("radix", []), ("no-radix", ["--disable-radix-cache"])):
        spec = pyserve_spec(f"pyserve-{name}", [*base_args, *extra], args.model)
        try:
            with running(spec, out_dir) as server:
                prefix[name] = asyncio.run(prefix_load(args, server, prompts, warm, tok))
                prefix[name]["runs_as"] = describe_pyserve(server.base_url)
        except StartError as e:
            print(f"[{spec.name}] did not start, skipping it: {e}")
    if "radix" in prefix and "no-radix" in prefix:
        radix, plain = prefix["radix"], prefix["no-radix"]
        print(
            f"\nprefix cache: TTFT p50 {plain['ttft_p50_ms']:.0f} ms without, "
            f"{radix['ttft_p50_ms']:.0f} ms with "
            f"({_ratio(plain['ttft_p50_ms'], radix['ttft_p50_ms']):.2f}×); "
            f"hit rate reported {radix.get('metrics_hit_rate', float('nan')):.3f} "
            f"(usage {radix.get('usage_hit_rate', float('nan')):.3f}), theoretical "
            f"{prefix['theoretical_hit_rate']:.3f} "
            f"({prefix['theoretical_hit_rate_in_flight_miss']:.3f} if in-flight prompts miss)"
        )
    return prefix


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped", file=sys.stderr)
        sys.exit(130)

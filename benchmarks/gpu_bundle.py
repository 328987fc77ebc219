"""What benchmarks/gpu_check.py needs on a GPU machine that reaches no package index, in .gpu/.

The lent GPU machine (an H200) has Python 3.12 with torch, triton, transformers, aiohttp and
most of what pyserve needs, but nothing can be installed there from the network, and each call
may carry at most 64 MiB beside the working tree. So this script, run here:

- downloads (pip, with their dependencies) the Python 3.12 manylinux wheels of the packages
  pyserve and ``transformers serve`` need that the machine's image lacks, at the versions this
  checkout's .venv runs, into ``.gpu/wheels``;
- cuts the default model (SmolLM2-135M GGUF, 94 MiB) into ``.gpu/model-a`` and
  ``.gpu/model-b``, one for each of the two calls, with its SHA-256 in ``.gpu/model.sha256``;
- prints the two calls (benchmarks/gpu_device.sh says what each runs there).

    .venv/bin/python benchmarks/gpu_bundle.py              # cp312 wheels, for the H200
    .venv/bin/python benchmarks/gpu_bundle.py --python 3.11 --out DIR   # to rehearse here
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The machine image's packages (the device library's KINDS.md, read 2026-11-17): never carried.
_IMAGE_PACKAGES = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
    lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
    ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
    pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
    psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
    torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
    treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
    werkzeug wheel wrapt xarray xxhash yarl zipp"""
IMAGE_HAS = set(_IMAGE_PACKAGES.split())
# pyserve's own needs the image lacks, and transformers[serving]'s (for the c=32 comparison)
NEEDED = ["orjson", "msgspec", "pyzmq", "gguf", "llguidance"]
SERVING = ["openai", "pydantic", "uvicorn", "fastapi", "starlette"]
# carried although the image has it: pydantic-core and openai need a recent one (and an older
# image's would fail them at import)
CARRY_ANYWAY = {"typing-extensions"}
PLATFORMS = [
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
]
CALL_LIMIT = 64 << 20  # what one call may carry, the working tree included


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    return normalized(path.name.split("-")[0])


def pinned(name: str) -> str:
    """``name==version`` as this checkout's environment has it (what the tests ran)."""
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def download_wheels(out: Path, python: str) -> list[Path]:
    staging = out / "all-wheels"
    shutil.rmtree(staging, ignore_errors=True)
    argv = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:"]
    argv += ["--python-version", python, "--implementation", "cp", "-d", str(staging)]
    argv += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([*argv, *map(pinned, NEEDED + SERVING)], check=True)
    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    kept = []
    for wheel in sorted(staging.glob("*.whl")):
        if wheel_name(wheel) not in IMAGE_HAS - CARRY_ANYWAY:
            kept.append(shutil.move(str(wheel), wheels / wheel.name))
    shutil.rmtree(staging)
    return [Path(p) for p in kept]


def split_model(out: Path) -> tuple[Path, Path, str]:
    sys.path.insert(0, str(ROOT))
    from pyserve.model_files import default_model_path

    data = Path(default_model_path()).read_bytes()
    half = len(data) // 2
    parts = (out / "model-a", out / "model-b")
    parts[0].write_bytes(data[:half])
    parts[1].write_bytes(data[half:])
    digest = hashlib.sha256(data).hexdigest()
    (out / "model.sha256").write_text(f"{digest}  {Path(default_model_path()).name}\n")
    return parts[0], parts[1], digest


def tree_bytes() -> int:
    """What travels without being carried: tracked and untracked files git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    paths = [ROOT / p.decode() for p in listed.split(b"\0") if p]
    return sum(p.stat().st_size for p in paths if p.is_file())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (3.12)")
    p.add_argument("--out", type=Path, default=ROOT / ".gpu", help="where (default .gpu/)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    wheels = download_wheels(args.out, args.python)
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    a, b, digest = split_model(args.out)
    tree = tree_bytes()
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(f"{len(wheels)} wheels, {mib(wheel_bytes)}: {' '.join(map(wheel_name, wheels))}")
    print(f"model {digest[:12]}: {mib(a.stat().st_size)} + {mib(b.stat().st_size)}")
    for part in (a, b):
        total = tree + wheel_bytes + part.stat().st_size
        verdict = "fits" if total <= CALL_LIMIT else "DOES NOT FIT"
        print(f"a call with {part.name}: {mib(total)} of 64 ({verdict})")
    rel = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
    print("\nthe two calls (device run tool), one right after the other (30 s idle release):")
    for part, what in ((a, "stage"), (b, "finish")):
        carry = [f"{rel}/wheels", f"{rel}/{part.name}", f"{rel}/model.sha256"]
        print(f"  carry={carry} command='bash benchmarks/gpu_device.sh {what}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())

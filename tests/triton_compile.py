"""Triton kernels compiled for a GPU, on a machine without one.

Triton's interpreter runs kernels on the CPU but checks none of what the compiler rejects: module
globals that are not constexprs, ``tl.dot`` shapes, types the code generator has no lowering
for. So the tests record the launches that the kernel wrappers make under the interpreter
(``record_launches``: the kernel, its argument types and its constexprs), and this file, run as
a script without ``TRITON_INTERPRET``, compiles each one for real GPU targets with Triton's own
compiler and ``ptxas`` (both in the triton wheel; no driver is needed) and reports the shared
memory, registers and stack (spilled registers) each compiled kernel needs.

    python tests/triton_compile.py < launches.json > results.json
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from collections.abc import Iterator

# what a launch may set beside the arguments
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
# what each target allows a block to use (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SHARED_LIMITS = {90: 232448, 80: 166912}
_POINTER_TYPES = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "i1",
}


def _type_of(value: object) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _specialized(value: object) -> tuple[str, str | None]:
    """What Triton's JIT makes of a runtime argument on a GPU: ("constexpr", 1) for an integer
    1, else its type and "D" where a pointer or an integer is a multiple of 16 (which lets the
    compiler vectorize loads and stores), as triton.runtime.jit does."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    if isinstance(value, bool) or not isinstance(value, int | torch.Tensor):
        return _type_of(value), None
    kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
    return ("constexpr", key) if kind == "constexpr" else (_type_of(value), key)


@contextlib.contextmanager
def record_launches() -> Iterator[list[dict]]:
    """Under ``TRITON_INTERPRET=1``: every kernel launch in the block, as the kernel's module
    and name, the type of each runtime argument, the value of each constexpr and the
    specializations the JIT would make on a GPU. The kernels do not run (their outputs stay as
    they were)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[dict] = []
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        declared = inspect.signature(self.fn)
        bound = declared.bind(*args, **kwargs)
        bound.apply_defaults()
        params = declared.parameters
        signature, constexprs, aligned = {}, {}, []
        for name, value in bound.arguments.items():
            if "constexpr" in str(params[name].annotation):
                signature[name] = "constexpr"
                constexprs[name] = value
                continue
            kind, key = _specialized(value)
            signature[name] = kind
            if kind == "constexpr":
                constexprs[name] = key
            elif key == "D":
                aligned.append(name)
        kernel = {"module": self.fn.__module__, "name": self.fn.__name__}
        launches.append(
            kernel
            | {"signature": signature, "constexprs": constexprs, "options": options}
            | {"aligned": aligned}
        )

    InterpretedFunction.run = recording
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


def unique(launches: list[dict]) -> list[dict]:
    seen: dict[str, dict] = {}
    for launch in launches:
        seen.setdefault(json.dumps(launch, sort_keys=True), launch)
    return list(seen.values())


def compile_one(launch: dict, capability: int) -> dict:
    """Compiles one recorded launch for an NVIDIA GPU of this compute capability."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    # multiples of 16, as the JIT marks them (what lets loads and stores be vectorized)
    divisible = [["tt.divisibility", 16]]
    attrs = {(kernel.arg_names.index(name),): divisible for name in launch.get("aligned", ())}
    source = ASTSource(kernel, launch["signature"], launch["constexprs"], attrs)
    row = {"kernel": launch["name"], "capability": capability}
    try:
        target = GPUTarget("cuda", capability, 32)
        compiled = triton.compile(source, target=target, options=launch.get("options") or None)
    except Exception as e:
        return row | {"error": f"{type(e).__name__}: {e}"[:3000]}
    shared = int(compiled.metadata.shared)
    row |= {"shared": shared, "num_warps": compiled.metadata.num_warps}
    row |= resource_usage(compiled.asm["cubin"])
    if shared > SHARED_LIMITS[capability]:
        row["error"] = f"needs {shared} bytes of shared memory, sm_{capability} allows "
        row["error"] += str(SHARED_LIMITS[capability])
    return row


def _compile_job(job: tuple[dict, int]) -> dict:
    launch, capability = job
    described = {k: launch[k] for k in ("signature", "constexprs", "options", "aligned")}
    return compile_one(launch, capability) | described


def resource_usage(cubin: bytes) -> dict:
    """Registers a thread and stack bytes (where ptxas spills registers) of a compiled kernel,
    from the cuobjdump in the triton wheel."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {text[-500:]}")
    return {"registers": int(found[1]), "stack": int(found[2])}


def main() -> int:
    from concurrent.futures import ProcessPoolExecutor

    launches = json.load(sys.stdin)
    capabilities = [int(c) for c in sys.argv[1:]] or sorted(SHARED_LIMITS, reverse=True)
    jobs = [(launch, capability) for launch in launches for capability in capabilities]
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # ptxas and MLIR
        rows = list(pool.map(_compile_job, jobs, chunksize=4))
    json.dump(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

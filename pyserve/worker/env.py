"""The worker's environment switches, read here and nowhere else under pyserve/worker/.

The names and meanings are an interface (README.md, cpp/kernels/README.md and the tests set
them), so they stay as they are. Each function reads the environment when called; its callers
call it once (the worker's start, the kernels' first setup), so no step reads the environment.
What WorkerSettings says comes from the engine instead (pyserve/worker/settings.py); these are
the knobs a person or a test sets from outside, for a whole process and its children.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# Forces a kernel path: avx512_vnni, avx2 or scalar (the compiled module checks the name).
KERNELS_ISA = "PYSERVE_KERNELS_ISA"
# 1: int8 activations from 32 rows on run on AMX tiles where the CPU has them and Linux grants
# the tile state (otherwise a warning says why, and the AVX-512 VNNI loops run: the same outputs
# bit for bit); 0 or unset: the VNNI loops (the tiles were no faster: RESULTS.md, "AMX").
KERNELS_AMX = "PYSERVE_KERNELS_AMX"
# (PYSERVE_KERNELS_FAKE_AMX_REFUSAL, for the tests, is read by the C++ kernels themselves:
# cpp/kernels/qgemm_amx.cpp.)
# Triton's own switch: 1 runs Triton kernels in its interpreter, which lets them run on the CPU.
TRITON_INTERPRET = "TRITON_INTERPRET"

# Tests only (pyserve/testing/worker_hooks.py acts on them); never set them anywhere else.
# A path: the worker waits before loading the model for as long as that file exists.
HOLD_LOADING = "PYSERVE_TEST_HOOK_HOLD_WORKER_LOADING"
# A path: each Step waits, before its forward pass, for as long as that file exists.
HOLD_STEPS = "PYSERVE_TEST_HOOK_HOLD_WORKER_STEPS"
# Seconds: each Step sleeps this long before its forward pass.
STEP_DELAY_S = "PYSERVE_TEST_HOOK_WORKER_STEP_DELAY_S"


def kernels_isa(environ: Mapping[str, str] = os.environ) -> str | None:
    """The kernel path ``PYSERVE_KERNELS_ISA`` forces, or None to pick the best this CPU has."""
    return environ.get(KERNELS_ISA) or None


def kernels_amx(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``PYSERVE_KERNELS_AMX`` asks for AMX tiles; ValueError on anything but 0 or 1."""
    value = environ.get(KERNELS_AMX, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{KERNELS_AMX}={value!r}: 0 or 1")
    return value == "1"


def triton_interpret(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether Triton runs its kernels in the interpreter (``TRITON_INTERPRET=1``). Read at each
    call: a script may set it after importing pyserve, before Triton reads it."""
    return environ.get(TRITON_INTERPRET) == "1"


@dataclass(frozen=True)
class HookSwitches:
    """The test hooks set for this worker (empty or zero: unset)."""

    hold_loading: str = ""
    hold_steps: str = ""
    step_delay_s: float = 0.0

    def any_set(self) -> bool:
        return bool(self.hold_loading or self.hold_steps or self.step_delay_s)


def hook_switches(environ: Mapping[str, str] = os.environ) -> HookSwitches:
    """The ``PYSERVE_TEST_HOOK_*`` switches of the worker, as set in ``environ``."""
    return HookSwitches(
        hold_loading=environ.get(HOLD_LOADING) or "",
        hold_steps=environ.get(HOLD_STEPS) or "",
        step_delay_s=float(environ.get(STEP_DELAY_S) or 0),
    )

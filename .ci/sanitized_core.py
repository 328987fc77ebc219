"""pytest plugin for CI: makes ``pyserve._core`` the ASan+UBSan build named by
``$PYSERVE_SANITIZED_CORE`` instead of the installed one, before any test imports it.

The sanitizer runtimes must already be loaded (LD_PRELOAD, see .ci/run): CPython itself is not
instrumented, so libasan has to come first in the process. The plugin refuses to run otherwise,
so that a misconfigured CI job cannot pass without sanitizers.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def _load_sanitized_core() -> None:
    path = os.environ["PYSERVE_SANITIZED_CORE"]
    with open("/proc/self/maps") as maps:
        loaded = maps.read()
    for runtime in ("libasan", "libubsan"):
        if runtime not in loaded:
            raise RuntimeError(f"{runtime} is not loaded: run with LD_PRELOAD (see .ci/run)")
    spec = importlib.util.spec_from_file_location("pyserve._core", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyserve._core"] = module
    spec.loader.exec_module(module)
    import pyserve

    pyserve._core = module  # `from pyserve import _core` reads the attribute first


def pytest_configure(config) -> None:
    _load_sanitized_core()


def pytest_report_header(config) -> str:
    return f"pyserve._core: {sys.modules['pyserve._core'].__file__} (ASan+UBSan)"

"""pyserve: an OpenAI-compatible LLM inference server with a C++ scheduling core.

Public names are imported lazily, so that ``import pyserve`` stays cheap (subprocesses and the
CLI import it before they know what they need).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Engine": "pyserve.engine",
    "EngineConfig": "pyserve.engine",
    "ContextLengthExceeded": "pyserve.engine",
    "EngineError": "pyserve.engine",
    "SamplingParams": "pyserve.wire.main_to_worker",
    "DetokParams": "pyserve.wire.main_to_worker",
    "GenerationChunk": "pyserve.outputs",
    "create_app": "pyserve.http.app",
}

__all__ = [
    "ContextLengthExceeded",
    "DetokParams",
    "Engine",
    "EngineConfig",
    "EngineError",
    "GenerationChunk",
    "SamplingParams",
    "__version__",
    "create_app",
]

if TYPE_CHECKING:
    from pyserve.engine import ContextLengthExceeded, Engine, EngineConfig, EngineError
    from pyserve.http.app import create_app
    from pyserve.outputs import GenerationChunk
    from pyserve.wire.main_to_worker import DetokParams, SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pyserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

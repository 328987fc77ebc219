"""The engine: subprocess ring, tokenizer manager and the scheduler loop over ``pyserve._core``."""

from pyserve.engine.config import EngineConfig
from pyserve.engine.engine import Engine
from pyserve.engine.errors import (
    ContextLengthExceeded,
    EngineDeadError,
    EngineError,
    EngineStartError,
    KVCacheTooSmall,
    RequestTimedOut,
)

__all__ = [
    "ContextLengthExceeded",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStartError",
    "KVCacheTooSmall",
    "RequestTimedOut",
]

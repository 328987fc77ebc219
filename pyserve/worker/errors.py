"""The worker's exceptions shared between its modules: a leaf that imports nothing of the
worker, so that raising one ties no module to another."""

from __future__ import annotations


class TensorParallelError(RuntimeError):
    """The ranks can no longer work together (a collective failed: a rank died, or a step
    failed in the model on some rank): the worker stops."""

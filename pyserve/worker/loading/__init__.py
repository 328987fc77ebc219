"""Weight loading: Hugging Face directories (safetensors) and GGUF files, with clear errors."""

from __future__ import annotations

from pyserve.worker.loading.base import Checkpoint, ModelLoadError

__all__ = ["Checkpoint", "ModelLoadError", "open_checkpoint"]


def open_checkpoint(model: str | None) -> Checkpoint:
    """``model``: a HF model directory, a .gguf file, or None for the bundled SmolLM2 GGUF."""
    from pyserve.model_files import ModelFilesError, resolve_model

    try:
        source = resolve_model(model)
    except ModelFilesError as e:
        raise ModelLoadError(str(e)) from None
    if source.kind == "gguf":
        from pyserve.worker.loading.gguf import open_gguf_checkpoint

        return open_gguf_checkpoint(source)
    from pyserve.worker.loading.hf import open_hf_checkpoint

    return open_hf_checkpoint(source)

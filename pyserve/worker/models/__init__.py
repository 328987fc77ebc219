"""Model families (one file each, registered by architecture name: registry.py) and the decoder
they share (decoder.py). Importing this package registers every family; it stays torch-free."""

from pyserve.worker.models import (  # noqa: F401
    gemma2,
    gemma3,
    gpt_oss,
    llama,
    olmoe,
    phi3,
    qwen2,
    qwen3,
    qwen_moe,
)

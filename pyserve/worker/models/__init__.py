"""Model families (one file each, registered by architecture name: registry.py) and the decoder
they share (decoder.py). Importing this package registers every family; it stays torch-free."""

from pyserve.worker.models import gemma2, gemma3, llama, phi3, qwen2, qwen3  # noqa: F401

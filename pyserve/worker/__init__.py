"""The model worker: torch modules over the paged KV cache, sampling, and its process loop."""

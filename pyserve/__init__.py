"""pyserve: an OpenAI-compatible LLM inference server with a C++ scheduling core."""

__version__ = "0.1.0"

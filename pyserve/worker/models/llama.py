"""Llama 2/3/3.1/3.2, Mistral and Mixtral: pre-norm blocks with RMSNorm, RoPE (plain, linear
or llama3 scaling; per-frequency factors in GGUF), grouped-query attention and a SwiGLU MLP;
optional attention biases, tied embeddings (Llama 3.2) and a sliding window (Mistral). Mixtral
is a Mistral with a mixture of experts on every layer (llama.cpp's files call it "llama" too,
with an expert count). The registry's Family defaults are this family's."""

from __future__ import annotations

from pyserve.worker.models.registry import Family, register


@register
class Llama(Family):
    name = "llama"
    hf_model_types = ("llama",)
    gguf_architectures = ("llama",)  # Mistral GGUFs say "llama" too
    gguf_permutes_qk = True


@register
class Mistral(Llama):
    """A Llama whose attention keeps to a sliding window (``sliding_window``) on every layer."""

    name = "mistral"
    hf_model_types = ("mistral",)
    gguf_architectures = ()


@register
class Mixtral(Mistral):
    """A Mistral whose MLP is a mixture of experts (w1 gate, w3 up, w2 down) on every layer."""

    name = "mixtral"
    hf_model_types = ("mixtral",)
    hf_moe_prefix = "block_sparse_moe"
    hf_expert_names = ("w1", "w3", "w2")

"""ModelConfig: the shape of a Llama-family decoder, whichever file format it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

# Architectures the Llama module runs: all are pre-norm decoders with RMSNorm, RoPE, GQA and a
# SwiGLU MLP; they differ only in biases, rope scaling and sliding windows.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int  # positions the model was trained for (max_position_embeddings)
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    # None, or {"rope_type": "linear"|"llama3", ...} in Hugging Face's rope_parameters form
    rope_scaling: dict | None = None
    sliding_window: int | None = None  # Mistral: attention window; we cap the context at it
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = ""
    # GGUF llama3 models carry per-frequency divisors instead of rope_scaling parameters
    rope_freq_factors: tuple[float, ...] | None = field(default=None, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """The longest sequence this model computes exactly like its reference implementation."""
        if self.sliding_window:
            return min(self.context_length, self.sliding_window)
        return self.context_length

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

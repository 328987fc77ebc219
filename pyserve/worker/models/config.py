"""ModelConfig: what a decoder-only model computes, whichever family and file format it came from.

A family (pyserve/worker/models/<family>.py) reads its checkpoint's metadata into this
description; the shared layers (models/decoder.py) and the backends run what it says, and a fast
path that cannot run some of it refuses at start. Everything that changes the model's output is
here: nothing is inferred later from the family's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class RopeConfig:
    """One rotary table: the layers that share it rotate q and k by the same angles."""

    theta: float
    rotary_dim: int  # leading dims of a head that rotate (partial rotary: < head_dim), even
    # None, or Hugging Face's rope_parameters without rope_theta: {"rope_type": "linear" |
    # "llama3" | "yarn" | "longrope", ...}
    scaling: dict | None = field(default=None, hash=False, compare=True)
    # GGUF llama3 files carry per-frequency divisors instead of the scaling parameters
    freq_factors: tuple[float, ...] | None = field(default=None, repr=False)
    # the context the rope scaling is relative to (yarn, longrope); None: not scaled
    max_position_embeddings: int | None = None
    # multimodal rope (Qwen2.5-VL): the rotated pairs in sections turned by a token's temporal,
    # height and width positions in turn (equal for text); None: one position
    mrope_section: tuple[int, ...] | None = None

    def key(self) -> tuple:
        """Equal for tables that give the same angles (they are computed once)."""
        scaling = tuple(sorted((k, repr(v)) for k, v in (self.scaling or {}).items()))
        return (
            self.theta,
            self.rotary_dim,
            scaling,
            self.freq_factors,
            self.max_position_embeddings,
            self.mrope_section,
        )


@dataclass(frozen=True)
class LayerConfig:
    rope: RopeConfig
    sliding_window: int | None = None  # attends to the last W positions (itself included)
    moe: bool = False  # its MLP is the model's mixture of experts (ModelConfig.moe)


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: a router picks ``top_k`` of ``num_experts`` gated MLPs per token (softmax
    over all experts' logits, the k largest), whose outputs are summed by their probabilities."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate width
    normalize_top_k: bool  # the k probabilities rescaled to sum to 1 (Qwen3-MoE, Mixtral)
    # an expert every token runs, scaled by sigmoid(x · gate) (Qwen2-MoE); 0: none
    shared_expert_size: int = 0
    router_bias: bool = False  # the router's logits have a bias (gpt-oss)
    expert_bias: bool = False  # every expert's gate/up and down have biases (gpt-oss)
    # the k largest logits first, then a softmax over those k alone (gpt-oss), rather than
    # the k largest of a softmax over all experts
    softmax_after_top_k: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top-{self.top_k} routing over {self.num_experts} experts")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the family's registered name (models/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    context_length: int  # positions the model was trained for (max_position_embeddings)
    tie_word_embeddings: bool
    layers: tuple[LayerConfig, ...]
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    # Every RMSNorm scales by (offset + w): 1 for Gemma's (1 + w). The loaders store offset + w,
    # so the norms compute w'·x̂ whatever the family.
    norm_offset: float = 0.0
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # the q/k norm over all of q's (and all of k's) heads together, not per head (OLMoE)
    qk_norm_full_width: bool = False
    # Norms after attention and around the MLP as well (Gemma 2/3): x + norm(attn(norm(x))),
    # then x + norm(mlp(norm(x)))
    sandwich_norms: bool = False
    activation: str = "silu"  # the MLP's gate: silu | gelu_tanh | clamped_swiglu
    # clamped_swiglu (gpt-oss): gate clamped above at the limit, up to ±limit, then
    # (up + 1) · gate · sigmoid(alpha · gate)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # a learned logit per head that joins every row's softmax as one more column, with no value
    # (gpt-oss's attention sinks): rows can attend to "nothing"
    attention_sinks: bool = False
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores → cap·tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits → cap·tanh(logits / cap) (Gemma 2)
    embedding_scale: float | None = None  # embeddings × this (Gemma: √hidden, in the dtype)
    moe: MoEConfig | None = None  # the sparse MLP of the layers whose LayerConfig.moe is set
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer descriptions for {self.num_layers} layers")
        if self.moe is None and any(layer.moe for layer in self.layers):
            raise ValueError("layers with a mixture of experts, but no MoEConfig")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation {self.activation!r} (supported: {', '.join(ACTIVATIONS)})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def served(self, max_model_len: int) -> ModelConfig:
        """This model as served up to ``max_model_len`` tokens: a window that long or longer
        never hides a position, so those layers attend to everything (and need no window)."""
        layers = tuple(
            replace(layer, sliding_window=None)
            if layer.sliding_window and layer.sliding_window >= max_model_len
            else layer
            for layer in self.layers
        )
        return self if layers == self.layers else replace(self, layers=layers)

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """As pyserve.model_files.ModelInfo's (this process's kv heads)."""
        return 2 * self.num_layers * (self.kv_size * dtype_bytes + self.num_kv_heads * scale_bytes)

    def features(self) -> list[str]:
        """What this model computes beyond a plain Llama block, for logs and /server_info."""
        found = []
        windows = sorted({w for layer in self.layers if (w := layer.sliding_window)})
        if windows:
            local = sum(1 for layer in self.layers if layer.sliding_window)
            found.append(f"sliding window {'/'.join(map(str, windows))} on {local} layers")
        tables = {layer.rope.key() for layer in self.layers}
        if len(tables) > 1:
            found.append(f"{len(tables)} rope tables")
        for rope in {layer.rope.key(): layer.rope for layer in self.layers}.values():
            if rope.scaling:
                found.append(f"rope {rope.scaling['rope_type']}")
            if rope.freq_factors:
                found.append("rope frequency factors")
            if rope.rotary_dim != self.head_dim:
                found.append(f"partial rotary {rope.rotary_dim}/{self.head_dim}")
        moe_layers = sum(1 for layer in self.layers if layer.moe)
        if self.moe is not None and moe_layers:
            moe = self.moe
            shared = " + a shared expert" if moe.shared_expert_size else ""
            found.append(
                f"mixture of experts: top-{moe.top_k} of {moe.num_experts}{shared} "
                f"on {moe_layers} layers"
            )
            if moe.softmax_after_top_k:
                found.append("softmax over the top-k logits")
            if moe.router_bias:
                found.append("router bias")
            if moe.expert_bias:
                found.append("expert biases")
        flags = {
            "qkv bias": self.qkv_bias,
            "o bias": self.o_bias,
            "q/k norm": self.qk_norm and not self.qk_norm_full_width,
            "full-width q/k norm": self.qk_norm and self.qk_norm_full_width,
            "sandwich norms": self.sandwich_norms,
            "attention sinks": self.attention_sinks,
            f"norm offset {self.norm_offset:g}": self.norm_offset != 0,
            f"activation {self.activation}": self.activation != "silu",
            f"attention scale {self.scale:.4g}": self.attention_scale is not None,
            f"attention softcap {self.attn_softcap}": self.attn_softcap is not None,
            f"final softcap {self.final_softcap}": self.final_softcap is not None,
            f"embedding scale {self.embedding_scale or 0:.4g}": self.embedding_scale is not None,
            "tied embeddings": self.tie_word_embeddings,
        }
        return found + [name for name, on in flags.items() if on]


ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")


def uniform_layers(
    num_layers: int, rope: RopeConfig, sliding_window: int | None = None, moe: bool = False
) -> tuple[LayerConfig, ...]:
    """Every layer alike (most families)."""
    return tuple(LayerConfig(rope, sliding_window, moe) for _ in range(num_layers))

"""Where every checkpoint tensor goes, declared once per layer kind.

Each layer kind (attention, the gated MLP, the mixture of experts) lists its tensors as
``CheckpointTensor``s: the Hugging Face name, the name llama.cpp's converter gives it in a GGUF
file, the model parameter (and the rows of it) it fills, and how it splits across
tensor-parallel ranks. The loader (weights.py), the shard rules (loading/shards.py) and the
GGUF names (loading/gguf.py) all read these declarations, so a new kind of layer is one more
function here plus its module in decoder.py. A family changes only names (``Family``: fused
q/k/v, Gemma's norm names, Mixtral's expert names).

Fused parameters: q/k/v are one ``qkv_proj`` ([q; k; v] rows), gate/up one ``gate_up_proj``
([gate; up]) in every layer and every expert, so that each runs one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

from pyserve.worker.models.config import ModelConfig

if TYPE_CHECKING:
    from pyserve.worker.models.registry import Family


class Split(Enum):
    """How a tensor divides across tensor-parallel ranks (Megatron's split)."""

    REPLICATE = "replicate"  # every rank holds all of it (norms, the router)
    ROWS = "rows"  # each of its row segments in equal parts: column-parallel layers
    COLUMNS = "columns"  # its columns in equal parts: row-parallel layers (o_proj, down_proj)
    RANK0 = "rank0"  # a row-parallel layer's bias: rank 0 adds it, the others hold zeros
    VOCAB = "vocab"  # rows of the vocabulary, the last rank padded with zero rows


@dataclass(frozen=True)
class CheckpointTensor:
    """One checkpoint tensor and where it lands."""

    hf: str  # Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
    gguf: str | None  # llama.cpp's, e.g. "blk.0.attn_q.weight"; None: not in GGUF files
    target: str  # the model's parameter, e.g. "layers.0.qkv_proj.weight"
    rows: tuple[int, int] | None = None  # the rows of ``target`` it fills (None: all)
    split: Split = Split.REPLICATE
    # ROWS: the sizes of the parts it holds one after another (q, k, v of a fused qkv), each
    # split on its own; COLUMNS: the width of its input
    segments: tuple[int, ...] = ()
    linear: str | None = None  # a projection's module, which is packed whole once all its rows
    norm: bool = False  # gets the family's norm offset
    embedding: bool = False
    # GGUF files hold every expert of a layer in one stacked tensor: this tensor is expert
    # ``expert`` of ``gguf`` (its rows expert·n .. expert·n + n, n this tensor's rows)
    expert: int | None = None


@dataclass(frozen=True)
class FusedExperts:
    """A checkpoint that holds each layer's experts as 3-D tensors (transformers' fused form):
    ``experts.gate_up_proj`` [experts, 2·width, hidden] and ``experts.down_proj`` [experts,
    hidden, width], or both transposed ([experts, in, out]: x @ W), with biases
    ``gate_up_proj_bias`` [experts, 2·width] and ``down_proj_bias`` [experts, hidden]. The HF
    loader reads them as the per-expert tensors declared below (loading/hf.py)."""

    transposed: bool  # [experts, in, out]
    interleaved: bool  # gate and up outputs alternate (gpt-oss), else all gates then all ups


def _param(module: str, name: str) -> str:
    return f"{module}.{name}"


def _gguf(block: str, family: Family, hf_part: str) -> str | None:
    """llama.cpp's name for a block tensor ("blk.3." + its part), None where it has none."""
    part = family.gguf_part_of(hf_part)
    return None if part is None else block + part


def layer_norm_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(Hugging Face name, the layer's module) of a layer's hidden-size norms."""
    if config.sandwich_norms:  # Gemma 2/3: norms after attention and around the MLP as well
        return [
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "attn_out_norm"),
            ("pre_feedforward_layernorm", "mlp_norm"),
            ("post_feedforward_layernorm", "mlp_out_norm"),
        ]
    return [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")]


def _projection(
    hf: str,
    gguf: str | None,
    module: str,
    *,
    rows: tuple[int, int] | None,
    split: Split,
    segments: tuple[int, ...],
    bias: bool = False,
    expert: int | None = None,
) -> list[CheckpointTensor]:
    """A projection's weight (and bias): ``hf`` and ``gguf`` without ".weight"."""
    out = [
        CheckpointTensor(
            f"{hf}.weight",
            None if gguf is None else f"{gguf}.weight",
            _param(module, "weight"),
            rows,
            split,
            segments,
            linear=module,
            expert=expert,
        )
    ]
    if bias:
        bias_split = Split.RANK0 if split is Split.COLUMNS else split
        out.append(
            CheckpointTensor(
                f"{hf}.bias",
                None if gguf is None else f"{gguf}.bias",
                _param(module, "bias"),
                rows,
                bias_split,
                segments,
                expert=expert,
            )
        )
    return out


def _norm(hf: str, gguf: str | None, module: str, split: Split = Split.REPLICATE, size: int = 0):
    return CheckpointTensor(
        f"{hf}.weight",
        None if gguf is None else f"{gguf}.weight",
        _param(module, "weight"),
        split=split,
        segments=(size,) if split is Split.ROWS else (),
        norm=True,
    )


def top_level_tensors(config: ModelConfig) -> list[CheckpointTensor]:
    """The embedding, the final norm and the vocabulary projection."""
    out = [
        CheckpointTensor(
            "model.embed_tokens.weight",
            "token_embd.weight",
            "embed_tokens",
            split=Split.VOCAB,
            embedding=True,
        ),
        _norm("model.norm", "output_norm", "norm"),
    ]
    if not config.tie_word_embeddings:
        out.append(
            CheckpointTensor(
                "lm_head.weight",
                "output.weight",
                "lm_head.weight",
                split=Split.VOCAB,
                linear="lm_head",
            )
        )
    return out


def attention_tensors(config: ModelConfig, family: Family, i: int) -> list[CheckpointTensor]:
    """Layer ``i``'s norms around attention, its q/k/v, q/k norms and output projection."""
    p, m, g = f"model.layers.{i}.", f"layers.{i}.", f"blk.{i}."
    q, kv = config.q_size, config.kv_size
    out = []
    for hf_norm, module in layer_norm_names(config):
        out.append(_norm(p + hf_norm, _gguf(g, family, hf_norm), m + module))
    if config.qk_norm:
        full = config.qk_norm_full_width
        for name, size in (("q_norm", q), ("k_norm", kv)):
            hf = f"self_attn.{name}"
            # per head: [head_dim], the same on every rank; full width: the rank's heads
            split = Split.ROWS if full else Split.REPLICATE
            out.append(_norm(p + hf, _gguf(g, family, hf), m + name, split, size))
    bias = config.qkv_bias
    if family.fused_qkv:
        hf = "self_attn.qkv_proj"
        out += _projection(
            p + hf, _gguf(g, family, hf), m + "qkv_proj",
            rows=None, split=Split.ROWS, segments=(q, kv, kv), bias=bias,
        )  # fmt: skip
    else:
        spans = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        for proj, (lo, hi) in spans.items():
            hf = f"self_attn.{proj}"
            out += _projection(
                p + hf, _gguf(g, family, hf), m + "qkv_proj",
                rows=(lo, hi), split=Split.ROWS, segments=(hi - lo,), bias=bias,
            )  # fmt: skip
    hf = "self_attn.o_proj"
    out += _projection(
        p + hf, _gguf(g, family, hf), m + "o_proj",
        rows=None, split=Split.COLUMNS, segments=(q,), bias=config.o_bias,
    )  # fmt: skip
    if config.attention_sinks:  # one logit per head: each rank holds its heads'
        sinks = CheckpointTensor(
            p + "self_attn.sinks", g + "attn_sinks.weight", m + "sinks",
            split=Split.ROWS, segments=(config.num_heads,),
        )  # fmt: skip
        out.append(sinks)
    return out


def gated_mlp_tensors(
    hf_prefix: str,
    gguf_names: tuple[str | None, str | None, str | None],
    module: str,
    width: int,
    *,
    fused: bool = False,
    expert: int | None = None,
    bias: bool = False,
) -> list[CheckpointTensor]:
    """A gated MLP's gate/up (fused into ``module``.gate_up_proj) and down projections;
    ``hf_prefix`` ends in "." and names the checkpoint's gate_proj, up_proj and down_proj
    under it (or gate_up_proj when ``fused``), ``gguf_names`` their GGUF names (gate, up,
    down; without ".weight")."""
    gate, up, down = gguf_names
    out = []
    if fused:
        out += _projection(
            hf_prefix + "gate_up_proj", up, module + "gate_up_proj",
            rows=None, split=Split.ROWS, segments=(width, width), expert=expert, bias=bias,
        )  # fmt: skip
    else:
        for name, gguf, rows in (
            ("gate_proj", gate, (0, width)),
            ("up_proj", up, (width, 2 * width)),
        ):
            out += _projection(
                hf_prefix + name, gguf, module + "gate_up_proj",
                rows=rows, split=Split.ROWS, segments=(width,), expert=expert, bias=bias,
            )  # fmt: skip
    out += _projection(
        hf_prefix + "down_proj", down, module + "down_proj",
        rows=None, split=Split.COLUMNS, segments=(width,), expert=expert, bias=bias,
    )  # fmt: skip
    return out


def mlp_tensors(config: ModelConfig, family: Family, i: int) -> list[CheckpointTensor]:
    """Layer ``i``'s dense gated MLP."""
    p, g = f"model.layers.{i}.mlp.", f"blk.{i}."
    gate, up, down = (_gguf(g, family, f"mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj"))
    if family.fused_gate_up:
        up = _gguf(g, family, "mlp.gate_up_proj")
    return gated_mlp_tensors(
        p, (gate, up, down), f"layers.{i}.", config.intermediate_size, fused=family.fused_gate_up
    )


def moe_tensors(config: ModelConfig, family: Family, i: int) -> list[CheckpointTensor]:
    """Layer ``i``'s mixture of experts: the router, every expert's gated MLP (in GGUF files, one
    stacked tensor per projection), and the shared expert with its gate where there is one.

    Tensor parallelism splits inside each expert (its gate/up rows, its down columns), as for
    a dense MLP: every rank reads 1/N of each active expert, so a decode's bytes divide evenly
    whichever experts the router picks, and one all-reduce completes the layer as before."""
    moe = config.moe
    assert moe is not None
    prefix = f"model.layers.{i}.{family.hf_moe_prefix}."
    g, m = f"blk.{i}.", f"layers.{i}.moe."
    router = f"{prefix}{family.hf_router_name}."
    out = [CheckpointTensor(router + "weight", g + "ffn_gate_inp.weight", m + "router")]
    if moe.router_bias:
        out.append(CheckpointTensor(router + "bias", g + "ffn_gate_inp.bias", m + "router_bias"))
    gate, up, down = family.hf_expert_names
    for e in range(moe.num_experts):
        hf = f"{prefix}experts.{e}."
        parts = [
            _renamed(t, hf, gate, up, down)
            for t in gated_mlp_tensors(
                hf,
                (g + "ffn_gate_exps", g + "ffn_up_exps", g + "ffn_down_exps"),
                f"{m}experts.{e}.",
                moe.expert_size,
                expert=e,
                bias=moe.expert_bias,
            )
        ]
        out += parts
    if moe.shared_expert_size:
        out += gated_mlp_tensors(
            prefix + "shared_expert.",
            (g + "ffn_gate_shexp", g + "ffn_up_shexp", g + "ffn_down_shexp"),
            m + "shared_expert.",
            moe.shared_expert_size,
        )
        out.append(
            CheckpointTensor(
                prefix + "shared_expert_gate.weight",
                g + "ffn_gate_inp_shexp.weight",
                m + "shared_gate",
            )
        )
    return out


def _renamed(t: CheckpointTensor, prefix: str, gate: str, up: str, down: str) -> CheckpointTensor:
    """``t`` with the family's names for an expert's gate, up and down projections."""
    names = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    rest = t.hf[len(prefix) :]
    proj, _, kind = rest.partition(".")
    return replace(t, hf=f"{prefix}{names.get(proj, proj)}.{kind}")


def checkpoint_tensors(config: ModelConfig, family: Family) -> list[CheckpointTensor]:
    """Every tensor of the model ``config`` describes, in its family's names."""
    out = top_level_tensors(config)
    for i, layer in enumerate(config.layers):
        out += attention_tensors(config, family, i)
        out += moe_tensors(config, family, i) if layer.moe else mlp_tensors(config, family, i)
    return out


def by_hf_name(config: ModelConfig, family: Family) -> dict[str, CheckpointTensor]:
    return {t.hf: t for t in checkpoint_tensors(config, family)}

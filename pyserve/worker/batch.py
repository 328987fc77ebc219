"""ForwardBatch: one Step, made into tensors; the contract between the worker loop and the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    """Entries in Step order; a decode entry is a 1-token entry like any other.

    Token ``t`` of entry ``i`` sits at position ``start_pos[i] + t`` of its request and its K/V
    are written into block ``block_tables[i][pos // block_size]`` at slot ``pos % block_size``.
    Entry ``i`` attends to its cached positions ``[0, start_pos[i])`` plus its own new tokens,
    causally.
    """

    input_ids: torch.Tensor  # int64 [T]: all entries' new tokens, concatenated
    positions: torch.Tensor  # int64 [T]
    start_pos: list[int]  # per entry: tokens already in the KV cache
    num_tokens: list[int]  # per entry: new tokens (1 for a decode)
    block_tables: list[list[int]]  # per entry: block ids covering [0, start_pos + num_tokens)
    sample_index: torch.Tensor  # int64 [S]: index into T of each sampling entry's last token
    # int64 [H]: rows of T whose final-norm hidden states the forward returns too (prefill-only
    # requests that pool them into an embedding); None: logits only
    hidden_index: torch.Tensor | None = None
    # rows of T that take an image's embeddings instead of their token's (int64 [R]), and
    # those embeddings ([R, hidden], the model's dtype); None: no image in this step
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    # runs of rows that attend to each other both ways (Gemma 3's images): (entry, offset of the
    # run's first row within the entry, rows); every row of a run sees the whole run. Empty:
    # causal everywhere
    bidirectional: list[tuple[int, int, int]] = field(default_factory=list)
    # int64 [3, T]: each row's rope positions (temporal, height, width) where the model's rope is
    # multimodal and a request's differ from its cache positions (Qwen2.5-VL after an image);
    # None: ``positions``
    rope_positions: torch.Tensor | None = None

    @property
    def num_entries(self) -> int:
        return len(self.num_tokens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_tokens)

    @classmethod
    def whole_prompt(cls, prompt: list[int], block_size: int) -> ForwardBatch:
        """One prompt prefilled from position 0 into blocks 0, 1, ..., sampling every position:
        the logits a model gives a whole sequence (tests, accuracy benchmarks)."""
        n = len(prompt)
        return cls(
            input_ids=torch.tensor(prompt),
            positions=torch.arange(n),
            start_pos=[0],
            num_tokens=[n],
            block_tables=[list(range(-(-n // block_size)))],
            sample_index=torch.arange(n),
        )

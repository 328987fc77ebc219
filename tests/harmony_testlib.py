"""A harmony (gpt-oss) tokenizer and a scripted engine that "generates" given text through it.

The tokenizer is built as the real o200k_harmony one is: byte-level BPE, with the harmony
markers added as special tokens at their real ids (the base vocabulary is padded with unused
entries up to 199998 so that they land there), and the real chat template of gpt-oss:
``tests/templates/openai-gpt-oss-120b.jinja``, copied unchanged from llama.cpp's
models/templates/openai-gpt-oss-120b.jinja (commit b204a5a2), itself a copy of the
``chat_template`` of Hugging Face's openai/gpt-oss-120b (Apache-2.0).

``ScriptedEngine`` is just enough engine for the chat routes: the real chat template and
tokenizer manager, and a ``generate`` that emits the token ids of a scripted text one by one
through pyserve's own incremental detokenizer, ending at an EOS or stop token as the worker
does (whose text is then not output).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from pyserve.detokenizer.incremental import IncrementalDecoder, decode_step
from pyserve.engine.config import EngineConfig
from pyserve.engine.tokenizer_manager import TokenizerManager
from pyserve.outputs import GenerationChunk
from pyserve.wire.main_to_worker import DetokParams, SamplingParams

TEMPLATE = (Path(__file__).parent / "templates" / "openai-gpt-oss-120b.jinja").read_text()

# The special tokens of o200k_harmony that have names, at their ids; the rest are reserved.
NAMED = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}
FIRST_SPECIAL, LAST_SPECIAL = 199998, 200018
VOCAB_SIZE = 201088  # gpt-oss's embedding rows
EOS_IDS = (200002, 199999, 200012)  # gpt-oss's generation_config.json


def harmony_tokenizer(chat_template: str = TEMPLATE):
    """A transformers fast tokenizer with o200k_harmony's special tokens and ``chat_template``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for i in range(len(vocab), FIRST_SPECIAL):
        vocab[f"<|unused_{i}|>"] = i  # never produced: no merge leads to it
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(NAMED.get(i, f"<|reserved_{i}|>"), special=True, normalized=False)
            for i in range(FIRST_SPECIAL, LAST_SPECIAL + 1)
        ]
    )
    assert backend.token_to_id("<|call|>") == 200012
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


class ScriptedEngine:
    """The engine under the chat routes, generating ``script`` (text with harmony markers) for
    every request; ``requests`` records (prompt ids, sampling, detok) of each."""

    model_name = "gpt-oss-scripted"
    ready = healthy = serving = True
    failure = None
    context_length = 8192
    num_blocks, block_size = 0, 16
    capabilities = ["generate"]
    takes_images = False  # the routes render text-only messages for it

    def __init__(self, tokenizer, script: str = "", **config) -> None:
        self.tokenizer = tokenizer
        self.config = EngineConfig(**config)
        self.script = script
        self.requests: list[tuple[list[int], SamplingParams, DetokParams]] = []
        self._manager = TokenizerManager(
            tokenizer, workers=1, context_length=self.context_length, vocab_size=VOCAB_SIZE
        )

    def close(self) -> None:
        self._manager.close()

    def stats(self) -> dict:
        return {"num_blocks": 0, "block_size": 16}

    def server_info(self) -> dict:
        return {"model_path": None}

    def chat_template_reads(self, name: str) -> bool:
        return self._manager.template_reads(name)

    async def apply_chat_template(self, messages: list[dict], **kwargs) -> list[int]:
        return await self._manager.apply_chat_template(messages, **kwargs)

    async def check_grammar(self, grammar, param: str = "grammar") -> None:
        await self._manager.check_grammar(grammar, param)

    def stream_directly(self, rid: str, sink) -> bool:
        return False

    def abort(self, rid: str) -> bool:
        return False

    async def generate(
        self,
        prompt: Sequence[int],
        sampling: SamplingParams,
        detok: DetokParams | None = None,
        rid: str | None = None,
        images: Sequence = (),  # always none: it takes no images
        priority: int = 0,
        timeout: float | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        # a script has no queue: the tests that send a priority, a deadline or a tenant use a
        # real engine
        assert priority == 0 and timeout is None and tenant is None, (priority, timeout, tenant)
        detok = detok or DetokParams()
        self.requests.append((list(prompt), sampling, detok))
        ids = self.tokenizer.encode(self.script, add_special_tokens=False)
        decoder = IncrementalDecoder(list(prompt), detok.skip_special_tokens)
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(EOS_IDS))
        backend = self.tokenizer.backend_tokenizer
        ids = ids[: sampling.max_new_tokens] or [stop_id for stop_id in EOS_IDS[:1]]
        for n, token in enumerate(ids, start=1):
            stop = token in stops
            # a script that runs out without a stop token is cut off, as by max_tokens
            finish = "stop" if stop else ("length" if n == len(ids) else None)
            if not stop:  # the worker's EOS or stop token is not output
                decoder.append(token)
            [text] = decode_step(backend, [decoder], [finish is not None])
            yield GenerationChunk(
                rid or "r",
                text,
                [token],
                len(prompt),
                n,
                finish_reason=finish,
                matched_stop=token if stop else None,
            )
            await asyncio.sleep(0)
            if finish is not None:
                return

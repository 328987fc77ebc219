"""TokenizerManager: chat templates, encoding and decoding off the event loop, and prompt checks.

Encoding a long prompt takes milliseconds; done on the event loop it would stall every stream.
It runs in a small thread pool instead (HF ``tokenizers`` releases the GIL while it encodes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from pyserve.engine.errors import ContextLengthExceeded
from pyserve.engine.image_prompts import ImagePrompt, ImagePrompts, PromptImage
from pyserve.grammars import GrammarChecker
from pyserve.wire.main_to_worker import Grammar, InvalidSampling

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


# apply_chat_template's own parameters: not for chat_template_kwargs to override
RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
     "add_generation_prompt", "continue_final_message", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


class TokenizerManager:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        *,
        workers: int,
        context_length: int,
        vocab_size: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="pyserve-tokenizer")
        self._grammars = GrammarChecker()
        self.images: ImagePrompts | None = None  # set where the served model takes images

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The pool that encodes: images are decoded and processed on it too."""
        return self._executor

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.check_token_ids(ids)
        return await self._run(self._decode, list(ids), skip_special_tokens)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Renders the model's chat template and encodes it (the template adds BOS if it wants).

        ``tools`` are OpenAI tool definitions (``{"type": "function", "function": {...}}``), as
        HF chat templates take them; ``chat_template_kwargs`` are the template's own variables
        (e.g. ``enable_thinking``)."""
        kwargs = self._template_kwargs(messages, chat_template_kwargs)
        return await self._run(self._render_chat, messages, add_generation_prompt, kwargs, tools)

    async def apply_chat_template_with_images(
        self,
        messages: list[dict],
        images: Sequence[PromptImage],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> ImagePrompt:
        """``apply_chat_template`` for messages whose content parts hold ``{"type": "image"}``
        (one per image of ``images``, in order): each image through the model's processor, its
        marker expanded into placeholders (``pyserve.engine.image_prompts``)."""
        if self.images is None:
            raise ValueError("this model takes no images")
        kwargs = self._template_kwargs(messages, chat_template_kwargs)
        return await self._run(
            self._render_chat_with_images, messages, images, add_generation_prompt, kwargs, tools
        )

    async def encode_with_images(
        self, text: str, images: Sequence[PromptImage], add_special_tokens: bool = True
    ) -> ImagePrompt:
        """``text`` that holds the model's image marker once per image of ``images`` (in
        order), each marker expanded as a rendered chat's is, then encoded."""
        if self.images is None:
            raise ValueError("this model takes no images")
        return await self._run(self._encode_with_images, text, images, add_special_tokens)

    @property
    def image_marker(self) -> str | None:
        """What stands for one image in a prompt's text (``<image>``); None: no images."""
        return self.images.marker if self.images is not None else None

    def _template_kwargs(self, messages: list[dict], chat_template_kwargs: dict | None) -> dict:
        if not messages:
            raise ValueError("messages must not be empty")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_ARGS & kwargs.keys())
        if reserved:
            raise InvalidSampling(
                f"chat_template_kwargs: {reserved[0]!r} is not a template variable",
                "chat_template_kwargs",
            )
        return kwargs

    def template_reads(self, name: str) -> bool:
        """Whether the chat template mentions variable ``name`` (e.g. ``tools``)."""
        return name in (self.tokenizer.chat_template or "")

    def _render_chat(
        self, messages: list[dict], add_generation_prompt: bool, kwargs: dict, tools: list | None
    ) -> list:
        text = self._render_text(messages, add_generation_prompt, kwargs, tools)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _render_chat_with_images(
        self,
        messages: list[dict],
        images: Sequence[PromptImage],
        add_generation_prompt: bool,
        kwargs: dict,
        tools: list | None,
    ) -> ImagePrompt:
        text = self._render_text(messages, add_generation_prompt, kwargs, tools)
        return self._encode_with_images(text, images, add_special_tokens=False)

    def _encode_with_images(
        self, text: str, images: Sequence[PromptImage], add_special_tokens: bool
    ) -> ImagePrompt:
        assert self.images is not None
        text, processed = self.images.expand(text, images)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.images.place(ids, processed)

    def _render_text(
        self, messages: list[dict], add_generation_prompt: bool, kwargs: dict, tools: list | None
    ) -> str:
        from jinja2 import TemplateError

        if not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template; use a plain prompt instead")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except (TemplateError, TypeError) as e:  # e.g. roles that do not alternate
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        return text

    def check_token_ids(self, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            return
        arr = np.asarray(ids)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError("token ids must be a flat list of integers")
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is out of range [0, {self.vocab_size})")

    async def check_grammar(self, grammar: Grammar, param: str) -> None:
        """InvalidSampling naming ``param`` for a grammar the worker could not enforce;
        compiled off the event loop, and once per grammar (a known one is answered here: the
        HTTP layer and the engine both ask)."""
        if self._grammars.known(grammar):
            self._grammars.check(grammar, param)
        else:
            await self._run(self._grammars.check, grammar, param)

    def check_logit_bias(self, logit_bias: dict[int, float]) -> None:
        outside = [t for t in logit_bias if t >= self.vocab_size]
        if outside:
            raise InvalidSampling(
                f"logit_bias: token id {outside[0]} is outside the vocabulary "
                f"[0, {self.vocab_size})",
                "logit_bias",
            )

    def check_prompt(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Raises ValueError (ContextLengthExceeded for a too long request) before any work."""
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.check_token_ids(prompt_ids)
        if len(prompt_ids) + max_new_tokens > self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), max_new_tokens, self.context_length)

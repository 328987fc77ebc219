"""Prompts with images, for a served vision model (Idefics3 / SmolVLM, Gemma 3, Qwen2.5-VL).

transformers' own processor class for the model does the model-specific work, as it does for
HF's ``generate``: its image processor (the PIL backend: no torchvision) turns each image into
the tensors the vision tower reads, and its ``replace_image_token`` expands each image marker of
the rendered chat (``<image>``, ``<start_of_image>``) into the placeholder tokens the language
model expects. The expanded text is encoded as a whole; the placeholder positions of each image
(the model config's image token, in order) are where its embedding rows go.

Each image's placeholders then get ids of their own, derived from the image's content and above
the vocabulary (``with_image_ids``, as the engine submits the prompt): the radix cache matches a
prefix only where every id agrees, so the same image in a later turn is a prefix hit and two
different images never share KV. The worker reads those positions' embeddings from its vision
tower, never the ids. Everything here runs in the tokenizer thread pool, never on the event loop.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pyserve.mmproj import PLACEHOLDER_TOKENS, Mmproj
from pyserve.wire.main_to_worker import ImageInput, WireTensor

if TYPE_CHECKING:
    from PIL import Image

# The largest token id the core takes; image ids lie in [vocab_size, MAX_TOKEN_ID).
MAX_TOKEN_ID = 2**31 - 1

# OpenAI's ``detail`` per family: the image processor's settings it selects (absent: defaults)
_DETAIL_SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    # one global tile, no split into the sub-images a large picture gets by default
    "idefics3": {"low": {"do_image_splitting": False}},
    "smolvlm": {"low": {"do_image_splitting": False}},
    # pan-and-scan crops beside the whole image (off in Gemma 3's defaults)
    "gemma3": {"high": {"do_pan_and_scan": True}},
}
# families whose image processor batches per prompt: one image's tensors carry a leading 1
_NESTED = frozenset({"idefics3", "smolvlm"})
# processor_config.json entries that are not the processor's own settings
_NOT_SETTINGS = frozenset({"processor_class", "image_processor", "video_processor", "tokenizer"})
# families whose transformers processor cannot be built here (its video processor needs
# torchvision): MergedPatchPrompts stands in
_MERGED_PATCH_FAMILIES = frozenset({"qwen2_5_vl"})
# the families whose vision towers the worker runs (pyserve/worker/vision)
VISION_FAMILIES = frozenset({"idefics3", "smolvlm", "gemma3", "qwen2_5_vl"})
# per family served from an mmproj file: its transformers image processor (the PIL backend)
_MMPROJ_IMAGE_PROCESSORS = {
    "idefics3": ("transformers.models.idefics3", "Idefics3ImageProcessorPil"),
    "gemma3": ("transformers.models.gemma3", "Gemma3ImageProcessorPil"),
    "qwen2_5_vl": ("transformers.models.qwen2_vl", "Qwen2VLImageProcessorPil"),
}
# the image tokens Gemma 3's tokenizer config names (boi, the placeholder, eoi)
GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}
# tensors of the processor's output that are not the vision tower's input
_NOT_TENSORS = frozenset({"rows", "cols", "num_crops"})


class ImagePromptError(ValueError):
    """Images that do not fit the prompt (a marker count that differs, too many tokens)."""


@dataclass(frozen=True)
class PromptImage:
    """A decoded image of a request: RGB pixels, their digest, the part's ``detail``."""

    image: Image.Image
    digest: bytes
    detail: str | None = None


@dataclass
class ImagePrompt:
    """An encoded prompt with images: ``ids`` hold the image token at each image position
    (checkable against the vocabulary); ``images`` say which positions each image fills."""

    ids: list[int]
    images: list[ImageInput] = field(default_factory=list)


def with_image_ids(ids: list[int], images: Sequence[ImageInput], vocab_size: int) -> list[int]:
    """``ids`` with image ``j``'s positions holding ids in ``[vocab_size, MAX_TOKEN_ID)`` drawn
    from its key: ``vocab + (a + i·b) mod M`` for its ``i``-th row, so two images agree at every
    position only if their keys agree on (a, b) (a chance of about 2^-60)."""
    if not images:
        return ids
    out = np.asarray(ids, dtype=np.int64)
    span = MAX_TOKEN_ID - vocab_size
    for image in images:
        positions = np.frombuffer(image.positions, dtype="<i4")
        a = int.from_bytes(image.key[:8], "little") % span
        b = int.from_bytes(image.key[8:16], "little") % span or 1
        out[positions] = vocab_size + (a + np.arange(len(positions), dtype=np.int64) * b) % span
    return out.tolist()


class ImagePrompts:
    """How the served model's prompts take images (``load``: None for a text-only model)."""

    def __init__(self, processor: Any, family: str, image_token_id: int) -> None:
        self.processor = processor
        self.family = family
        self.image_token_id = image_token_id  # the placeholder the embeddings replace
        self.marker: str = processor.image_token  # what the chat template writes per image
        tokenizer = processor.tokenizer
        self._placeholder: str = tokenizer.convert_ids_to_tokens(image_token_id)
        self._images_kwargs = processor._merge_kwargs(tokenizer_init_kwargs=tokenizer.init_kwargs)[
            "images_kwargs"
        ]

    @classmethod
    def load(cls, path: str, tokenizer: Any) -> ImagePrompts | None:
        """From a Hugging Face model directory whose config has a vision tower of one of
        ``VISION_FAMILIES``; None for a text-only model (or a single file, which holds no
        vision tower), or another family's."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            return None
        raw = json.loads(config_file.read_text())
        if "vision_config" not in raw:
            return None
        family = raw.get("model_type", "")
        if family not in VISION_FAMILIES:
            return None  # the worker serves it as text (and says so in its log)
        import transformers
        from transformers import AutoImageProcessor
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

        image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        if family in _MERGED_PATCH_FAMILIES:
            processor: Any = MergedPatchPrompts(image_processor, tokenizer)
        else:
            processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[family])
            settings_file = Path(path) / "processor_config.json"
            settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
            settings = {k: v for k, v in settings.items() if k not in _NOT_SETTINGS}
            processor = processor_class(
                image_processor=image_processor, tokenizer=tokenizer, **settings
            )
        token = raw.get("image_token_id", raw.get("image_token_index"))
        if token is None:
            raise ValueError(f"{config_file}: no image_token_id")
        return cls(processor, family, int(token))

    @classmethod
    def from_mmproj(cls, mmproj: Mmproj, tokenizer: Any) -> ImagePrompts:
        """For a GGUF text model served with llama.cpp's ``--mmproj`` file: the family's image
        processor with the file's sizes and normalization, and its processor's expansion."""
        import importlib

        import transformers

        module, name = _MMPROJ_IMAGE_PROCESSORS[mmproj.family]
        image_processor_class = getattr(importlib.import_module(module), name)
        image_processor = image_processor_class(**mmproj.image_processor_settings())
        if mmproj.family in _MERGED_PATCH_FAMILIES:
            processor: Any = MergedPatchPrompts(image_processor, tokenizer)
        elif mmproj.family == "gemma3":
            # Gemma3Processor finds its tokens on the tokenizer, named as Gemma's tokenizer
            # config names them (extra_special_tokens); a GGUF's tokenizer has no such names
            if getattr(tokenizer, "boi_token", None) is None:
                tokenizer._set_model_specific_special_tokens(GEMMA3_TOKENS)
            processor = transformers.Gemma3Processor(
                image_processor, tokenizer, image_seq_length=mmproj.tokens_per_image
            )
        else:
            processor = transformers.Idefics3Processor(
                image_processor, tokenizer=tokenizer, image_seq_len=mmproj.tokens_per_image
            )
        token = tokenizer.convert_tokens_to_ids(PLACEHOLDER_TOKENS[mmproj.family])
        return cls(processor, mmproj.family, int(token))

    def expand(self, text: str, images: Sequence[PromptImage]) -> tuple[str, list[Processed]]:
        """The rendered ``text`` with each marker expanded, and each image's tensors."""
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(images):
            raise ImagePromptError(
                f"the chat template wrote {len(pieces) - 1} image markers for "
                f"{len(images)} images (is a literal {self.marker!r} in the text?)"
            )
        expanded = [pieces[0]]
        processed = []
        for image, piece in zip(images, pieces[1:], strict=True):
            replacement, arrays = self._process(image)
            expanded += [replacement, piece]
            rows = replacement.count(self._placeholder)
            processed.append(Processed(_image_key(image, arrays), arrays, rows))
        return "".join(expanded), processed

    def _process(self, image: PromptImage) -> tuple[str, dict[str, np.ndarray]]:
        settings = {**self._images_kwargs, "return_tensors": "np"}
        settings.update(_DETAIL_SETTINGS.get(self.family, {}).get(image.detail or "auto", {}))
        nested = self.family in _NESTED
        outputs, replacements = self.processor._process_images(
            [[image.image]] if nested else [image.image], **settings
        )
        arrays = {
            name: np.ascontiguousarray(value[0] if nested else value)
            for name, value in outputs.items()
            if name not in _NOT_TENSORS
        }
        return replacements[0], arrays

    def place(self, ids: list[int], processed: Sequence[Processed]) -> ImagePrompt:
        """The encoded expansion's image positions, shared out to the images in order (each
        takes the placeholder count its expansion wrote)."""
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id).astype("<i4")
        if sum(p.rows for p in processed) != len(positions):
            raise ImagePromptError(
                f"the prompt holds {len(positions)} image placeholders, its images need "
                f"{sum(p.rows for p in processed)}"
            )
        inputs = []
        at = 0
        for p in processed:
            inputs.append(
                ImageInput(
                    key=p.key,
                    positions=positions[at : at + p.rows].tobytes(),
                    tensors={name: _wire(value) for name, value in p.arrays.items()},
                )
            )
            at += p.rows
        return ImagePrompt(ids, inputs)


@dataclass(frozen=True)
class Processed:
    """One image through the processor: its cache key, tensors and placeholder count."""

    key: bytes
    arrays: dict[str, np.ndarray]
    rows: int


class MergedPatchPrompts:
    """Qwen2.5-VL's processor for images alone: its image processor, and each marker expanded
    into one placeholder per merged patch, as ``Qwen2_5_VLProcessor.replace_image_token``
    does (its video half needs torchvision, which the PIL image processor does not)."""

    image_token = "<|image_pad|>"

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer

    def _merge_kwargs(self, tokenizer_init_kwargs: dict) -> dict:
        return {"images_kwargs": {}}

    def _process_images(self, images: list, **settings: Any) -> tuple[dict, list[str]]:
        outputs = self.image_processor(images, **settings)
        merged = self.image_processor.merge_size**2
        counts = [int(np.prod(grid)) // merged for grid in outputs["image_grid_thw"]]
        return outputs, [self.image_token * n for n in counts]


def _image_key(image: PromptImage, arrays: dict[str, np.ndarray]) -> bytes:
    """The encoder cache's key: what the tower reads (the tensors' bytes, which the detail
    setting changes), summarized with the decoded pixels' digest."""
    h = hashlib.sha256(image.digest)
    for name in sorted(arrays):
        value = arrays[name]
        h.update(f"{name}:{value.dtype.str}:{value.shape}".encode())
        h.update(value.tobytes())
    return h.digest()[:16]


def _wire(value: np.ndarray) -> WireTensor:
    return WireTensor(value.dtype.str, list(value.shape), value.tobytes())

"""llama.cpp's ``--mmproj`` files: a GGUF holding a vision tower and its projector
(``general.architecture`` clip), served beside a text model's GGUF.

What both processes need from its metadata, torch-free: which of our vision families it is
(``clip.projector_type``), the tower's shape (``clip.vision.*``) and the image processor's
settings. The worker reads the tensors (``pyserve/worker/vision/mmproj.py``); the main process
rebuilds the family's transformers image processor (``pyserve/engine/image_prompts.py``).

Keys llama.cpp's converter leaves out are llama.cpp's own defaults for the projector type (its
``clip.cpp``): Gemma 3 pools by 4 a side, Qwen2.5-VL attends in 112-pixel windows, and those are
also what the released models were trained with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# clip.projector_type -> our vision family (pyserve/worker/vision)
PROJECTOR_FAMILIES = {"gemma3": "gemma3", "idefics3": "idefics3", "qwen2.5vl_merger": "qwen2_5_vl"}
# per family: the token each image row fills (from the text model's vocabulary)
PLACEHOLDER_TOKENS = {
    "gemma3": "<image_soft_token>",
    "idefics3": "<image>",
    "qwen2_5_vl": "<|image_pad|>",
}
GEMMA3_POOLING = 4  # clip.cpp's n_merge when clip.vision.projector.scale_factor is absent
QWEN_WINDOW_PIXELS = 112  # clip.cpp's attention window when clip.vision.window_size is absent
# Qwen2.5-VL's released image-size limits, in merged patches (3136 and 12845056 pixels at 28)
QWEN_MIN_TOKENS, QWEN_MAX_TOKENS = 4, 16384


class MmprojError(ValueError):
    """An mmproj file that cannot be served with the text model; the message names both."""


@dataclass(frozen=True)
class Mmproj:
    """An mmproj file's metadata, as the towers and image processors take it."""

    path: str
    projector: str  # clip.projector_type
    family: str  # a key of PLACEHOLDER_TOKENS
    fields: dict[str, Any] = field(repr=False)  # every clip.* key

    def get(self, key: str, default: object = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.fields.get(key)
        if value is None:
            raise MmprojError(f"{self.path}: no {key} in the mmproj metadata")
        return value

    @property
    def projection_dim(self) -> int:
        """The text model's hidden size the projector writes."""
        return int(self.need("clip.vision.projection_dim"))

    @property
    def image_size(self) -> int:
        return int(self.need("clip.vision.image_size"))

    @property
    def patch_size(self) -> int:
        return int(self.need("clip.vision.patch_size"))

    @property
    def scale_factor(self) -> int:
        """Gemma 3's pooling a side, Idefics3's pixel shuffle, Qwen's merge."""
        if self.family == "qwen2_5_vl":
            return int(self.get("clip.vision.spatial_merge_size", 2))
        default = GEMMA3_POOLING if self.family == "gemma3" else 2
        return int(self.get("clip.vision.projector.scale_factor", default))

    @property
    def tokens_per_image(self) -> int:
        """Rows an image (Gemma 3) or a tile (Idefics3) becomes."""
        side = self.image_size // self.patch_size // self.scale_factor
        return side * side

    def vision_config(self) -> dict[str, Any]:
        """The family's transformers ``vision_config`` fields the towers read."""
        common = {
            "hidden_size": int(self.need("clip.vision.embedding_length")),
            "intermediate_size": int(self.need("clip.vision.feed_forward_length")),
            "patch_size": self.patch_size,
            "layer_norm_eps": float(self.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        }
        heads = int(self.need("clip.vision.attention.head_count"))
        depth = int(self.need("clip.vision.block_count"))
        if self.family != "qwen2_5_vl":
            return {
                **common,
                "num_hidden_layers": depth,
                "num_attention_heads": heads,
                "image_size": self.image_size,
                "hidden_act": "gelu_pytorch_tanh",
            }
        # every n-th block attends to the whole image, the others within windows
        pattern = int(self.need("clip.vision.n_wa_pattern"))
        return {
            **common,
            "depth": depth,
            "num_heads": heads,
            "out_hidden_size": self.projection_dim,
            "spatial_merge_size": self.scale_factor,
            "temporal_patch_size": 2,  # the converter splits the Conv3d in two frames
            "window_size": int(self.get("clip.vision.window_size", QWEN_WINDOW_PIXELS)),
            "fullatt_block_indexes": [i for i in range(depth) if (i + 1) % pattern == 0],
            "hidden_act": "silu",
        }

    def image_processor_settings(self) -> dict[str, Any]:
        """Keyword arguments of the family's transformers image processor."""
        mean = [float(x) for x in self.need("clip.vision.image_mean")]
        std = [float(x) for x in self.need("clip.vision.image_std")]
        settings: dict[str, Any] = {"image_mean": mean, "image_std": std}
        if self.family == "gemma3":
            settings["size"] = {"height": self.image_size, "width": self.image_size}
        elif self.family == "idefics3":
            longest = int(self.get("clip.vision.preproc_image_size", self.image_size))
            settings["size"] = {"longest_edge": longest}
            settings["max_image_size"] = {"longest_edge": self.image_size}
        else:
            unit = (self.patch_size * self.scale_factor) ** 2
            settings |= {
                "patch_size": self.patch_size,
                "temporal_patch_size": 2,
                "merge_size": self.scale_factor,
                "min_pixels": int(self.get("clip.vision.image_min_pixels", QWEN_MIN_TOKENS * unit)),
                "max_pixels": int(self.get("clip.vision.image_max_pixels", QWEN_MAX_TOKENS * unit)),
            }
        return settings


def read_mmproj(path: str) -> Mmproj:
    """The metadata of ``path``; MmprojError when it is not an mmproj file of a family we serve."""
    from pyserve.model_files import open_gguf_reader

    try:
        reader = open_gguf_reader(path)
    except Exception as e:  # a missing, truncated or foreign file fails in many ways
        raise MmprojError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("clip.")}
    arch = reader.fields.get("general.architecture")
    if arch is None or arch.contents() != "clip":
        found = arch.contents() if arch is not None else None
        raise MmprojError(
            f"{path}: not an mmproj file (general.architecture {found!r}, not 'clip')"
        )
    projector = fields.get("clip.projector_type") or fields.get("clip.vision.projector_type")
    family = PROJECTOR_FAMILIES.get(str(projector))
    if family is None:
        raise MmprojError(
            f"{path}: projector type {projector!r} is not supported "
            f"({', '.join(sorted(PROJECTOR_FAMILIES))})"
        )
    return Mmproj(path=path, projector=str(projector), family=family, fields=fields)


def gguf_token_id(path: str, token: str) -> int | None:
    """The id of ``token`` in a GGUF text model's vocabulary (``tokenizer.ggml.tokens``), or
    None: the strings are walked in the file, not decoded into a list."""
    from pyserve.model_files import open_gguf_reader

    reader = open_gguf_reader(path)
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return None
    data, order = memoryview(reader.data), "little" if reader.endianess.name == "LITTLE" else "big"

    def u64(at: int) -> int:
        return int.from_bytes(data[at : at + 8], order)

    # the field: key length, key, value type, item type, count, then each string's length and
    # bytes
    at = field.offset + 8 + u64(field.offset) + 4 + 4
    count, at = u64(at), at + 8
    want = token.encode()
    for index in range(count):
        size, at = u64(at), at + 8
        if size == len(want) and data[at : at + size] == want:
            return index
        at += size
    return None


def check_pairing(
    mmproj: Mmproj, model_path: str, hidden_size: int, architecture: str | None = None
) -> int:
    """The placeholder token's id in the GGUF text model's vocabulary, once the two files fit
    each other: MmprojError naming both where they do not. ``architecture``: the text GGUF's
    ``general.architecture``, where known (Qwen2.5-VL's projector needs ``qwen2vl``'s rope)."""
    pair = f"--mmproj {mmproj.path} does not fit --model {model_path}"
    if mmproj.family == "qwen2_5_vl" and architecture not in (None, "qwen2vl"):
        raise MmprojError(
            f"{pair}: a {mmproj.projector} projector goes with a qwen2vl text model (its "
            f"multimodal rope), not {architecture}"
        )
    if mmproj.projection_dim != hidden_size:
        raise MmprojError(
            f"{pair}: the projector writes {mmproj.projection_dim}-wide rows, the text model's "
            f"hidden size is {hidden_size}"
        )
    placeholder = PLACEHOLDER_TOKENS[mmproj.family]
    token = gguf_token_id(model_path, placeholder)
    if token is None:
        raise MmprojError(
            f"{pair}: its vocabulary has no {placeholder} token ({mmproj.projector} projector)"
        )
    return token

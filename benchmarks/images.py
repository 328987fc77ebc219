"""Images: the vision tower's encode time and the TTFT of a one-image question, pyserve against
transformers on the same random weights.

Two towers, random weights, float32, transformers' own configs:

- ``gemma3-4b``: Gemma 3 4B's vision side (SigLIP so400m: 27 layers of width 1152, 896 px images
  in 14 px patches, pooled to 256 tokens) before a Gemma 3 text model of 4B's width cut to
  ``--text-layers`` layers (the tower is what this measures; a whole random 4B text model would
  not fit the machine's memory in float32 beside transformers' copy);
- ``smolvlm-256m``: SmolVLM-256M's (SigLIP of 12 layers of width 768, 512 px tiles in 16 px
  patches, pixel shuffle by 4) before SmolLM2-135M's shape cut the same way.

Encode: best of ``--rounds`` of pyserve's tower (``pyserve/worker/vision``) and transformers'
``get_image_features`` on the same preprocessed pixels, in this process, with ``--threads``
torch threads. TTFT: best of ``--rounds`` of a chat request with one picture (``max_tokens`` 1)
to `pyserve run` (a new picture each round, so no cache hit; once with the tower in the model's
float32, once with ``--vision-dtype bfloat16``), against transformers' processor plus
``generate(max_new_tokens=1)`` in this process. With ``--llama``, the same model converted by
llama.cpp's converter to a text GGUF and an ``--mmproj`` file (f16, as users download them) is
served by llama-server and by pyserve, the same requests to each.

    .venv/bin/python benchmarks/images.py --rounds 3 --llama
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from http_testlib import Server
from mmproj_files import convert_vlm
from vision_models import gemma3_tokenizer, idefics3_tokenizer, random_picture

from pyserve.worker.loading import open_checkpoint
from pyserve.worker.vision import load_vision_weights, vision_tower_for


def gemma3_4b(out: Path, text_layers: int):
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    tok = gemma3_tokenizer(out)
    text = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=text_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        layer_types=["full_attention"] * text_layers,
    )
    vision = SiglipVisionConfig(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=256,
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    processor = Gemma3Processor(
        Gemma3ImageProcessorPil(size={"height": 896, "width": 896}),
        tokenizer=tok,
        image_seq_length=256,
    )
    return model, processor


def smolvlm_256m(out: Path, text_layers: int):
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    tok = idefics3_tokenizer(out)
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=text_layers,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    vision = Idefics3VisionConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=512,
        patch_size=16,
    )
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        scale_factor=4,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    model = Idefics3ForConditionalGeneration(config).eval()
    image_processor = Idefics3ImageProcessorPil(
        max_image_size={"longest_edge": 512}, size={"longest_edge": 1024}
    )
    processor = Idefics3Processor(image_processor, tokenizer=tok, image_seq_len=64)
    return model, processor


MODELS = {"gemma3-4b": gemma3_4b, "smolvlm-256m": smolvlm_256m}


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def data_url(picture) -> str:
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def measure(name: str, directory: Path, args) -> dict:

    out = directory / name
    out.mkdir()
    torch.manual_seed(0)
    model, processor = MODELS[name](out, args.text_layers)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    processor.tokenizer.save_pretrained(out)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    rendered = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    picture = random_picture(600, 800, 1)
    inputs = processor(
        text=rendered, images=[[picture]], add_special_tokens=False, return_tensors="pt"
    )
    extra = {k: v for k, v in inputs.items() if k == "pixel_attention_mask"}
    pixels = inputs["pixel_values"]
    from transformers import AutoConfig

    tower = vision_tower_for(AutoConfig.from_pretrained(out), dtype=torch.float32, device="cpu")
    load_vision_weights(tower, open_checkpoint(str(out)).tensors, str(out))
    with torch.inference_mode():
        ours = best(lambda: tower.encode(pixels, **extra), args.rounds)
        theirs = best(lambda: model.model.get_image_features(pixels, **extra), args.rounds)

        def hf_ttft() -> None:
            fresh = random_picture(600, 800, int(time.perf_counter() * 1e6) % 1000)
            batch = processor(
                text=rendered, images=[[fresh]], add_special_tokens=False, return_tensors="pt"
            )
            model.generate(**batch, max_new_tokens=1, do_sample=False)

        hf = best(hf_ttft, args.rounds)
    tokens = int(inputs["input_ids"].shape[1])
    common = ["--torch-threads", str(args.threads), "--kv-cache-tokens", "16384"]
    common += ["--tokenizer-workers", "1"]
    ttft = {"transformers": hf * 1e3}
    ttft["pyserve"] = pyserve_ttft(["--model", str(out), *common], args.rounds)
    bf16 = ["--model", str(out), "--vision-dtype", "bfloat16", *common]
    ttft["pyserve bf16 tower"] = pyserve_ttft(bf16, args.rounds)
    if args.llama and name in GGUF_FAMILIES:
        convert_vlm(out, out / "gguf", GGUF_FAMILIES[name], "f16", timeout=1800)
        files = ["--model", str(out / "gguf" / "model.gguf")]
        files += ["--mmproj", str(out / "gguf" / "mmproj.gguf")]
        ttft["pyserve gguf+mmproj"] = pyserve_ttft([*files, *common], args.rounds)
        both = [*files, "--vision-dtype", "bfloat16", *common]
        ttft["pyserve gguf+mmproj bf16 tower"] = pyserve_ttft(both, args.rounds)
        ttft["llama-server gguf+mmproj"] = llama_ttft(out / "gguf", args)
    return {
        "model": name,
        "prompt_tokens": tokens,
        "encode_ms": {"pyserve": ours * 1e3, "transformers": theirs * 1e3},
        "ttft_ms": ttft,
    }


# the benchmark's models llama.cpp's converter takes, by family
GGUF_FAMILIES = {"gemma3-4b": "gemma3", "smolvlm-256m": "idefics3"}


def ask_with_pictures(url: str, rounds: int) -> float:
    """The best time to the first token of ``rounds`` one-picture chat requests (max_tokens 1),
    after one that warms the server up; a new picture each time (no cache hit)."""
    import requests

    times = []
    for round_ in range(rounds + 1):
        picture = data_url(random_picture(600, 800, 50 + round_))
        content = [
            {"type": "image_url", "image_url": {"url": picture}},
            {"type": "text", "text": "What?"},
        ]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        started = time.perf_counter()
        reply = requests.post(url + "/v1/chat/completions", json=body, timeout=1200)
        reply.raise_for_status()
        times.append(time.perf_counter() - started)
    return min(times[1:]) * 1e3


def pyserve_ttft(server_args: list[str], rounds: int) -> float:
    server = Server(server_args)
    try:
        return ask_with_pictures(server.url, rounds)
    finally:
        server.stop()


def llama_ttft(files: Path, args) -> float:
    from compare import find_llama_server, free_port

    binary = find_llama_server(None)
    assert binary is not None, "no llama-server on this machine"
    port = free_port()
    command = [binary, "-m", str(files / "model.gguf"), "--mmproj", str(files / "mmproj.gguf")]
    command += ["-t", str(args.threads), "-c", "8192", "-np", "1", "--port", str(port)]
    command += ["--host", "127.0.0.1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url + "/health", server)
        return ask_with_pictures(url, args.rounds)
    finally:
        server.terminate()
        server.wait(60)


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 600) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "llama-server exited"
        try:
            if requests.get(url, timeout=5).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise TimeoutError("llama-server did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text-layers", type=int, default=2)
    parser.add_argument(
        "--llama", action="store_true", help="also llama-server on the converted GGUF + mmproj"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, torch threads {args.threads}")
    with tempfile.TemporaryDirectory(prefix="pyserve-bench-images-") as directory:
        for name in args.models.split(","):
            row = measure(name, Path(directory), args)
            encode, ttft = row["encode_ms"], row["ttft_ms"]
            print(
                f"{name}: {row['prompt_tokens']} prompt tokens; encode pyserve "
                f"{encode['pyserve']:.0f} ms, transformers {encode['transformers']:.0f} ms "
                f"({encode['transformers'] / encode['pyserve']:.2f}x)",
                flush=True,
            )
            for server, ms in ttft.items():
                print(
                    f"  TTFT {server}: {ms:.0f} ms ({ttft['transformers'] / ms:.2f}x transformers)"
                )
            print(json.dumps(row))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

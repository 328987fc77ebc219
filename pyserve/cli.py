"""``pyserve run``: serve a model over HTTP (OpenAI and native APIs) on uvloop.

The HTTP server starts first, so that /health answers 503 while the model loads; then the
engine starts its subprocesses. SIGTERM or SIGINT stops new requests (503), lets the requests in
flight finish for up to ``--shutdown-timeout`` seconds, ends the rest with an error and exits 0.
If a subprocess dies the server exits 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from pyserve import replicas
from pyserve.chat.harmony import HARMONY
from pyserve.chat.reasoning import REASONING_PARSERS
from pyserve.chat.tool_calls import PARSERS as TOOL_CALL_PARSERS
from pyserve.engine import Engine, EngineConfig
from pyserve.engine.config import SPECULATIVE_ALGORITHMS
from pyserve.engine.state_dir import resolve_state_dir
from pyserve.http.app import HTTP2PrefaceFilter, create_app, server_state
from pyserve.http.bodies import DEFAULT_MAX_BODY_BYTES
from pyserve.http.image_inputs import (
    DEFAULT_IMAGE_FETCH_TIMEOUT,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    ImageOptions,
)
from pyserve.http.state import ServerState
from pyserve.worker.dtypes import ACTIVATION_BITS, KV_CACHE_DTYPE_NAMES, QUANTIZATION_NAMES
from pyserve.worker.settings import BACKEND_NAMES

log = logging.getLogger("pyserve")

PROGRESS_EVERY_S = 5.0
HANDLER_GRACE_S = 3.0  # after the engine stops: time for handlers to write their error events
DEAD_LINGER_S = 1.0  # after the engine dies: /health answers 503 this long before the exit
DEFAULT_DISK_CACHE_GIB = 4.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyserve", description="An OpenAI-compatible LLM inference server."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="serve a model over HTTP",
        description="Serve a model over HTTP: OpenAI and native (SGLang-style) APIs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = run.add_argument
    add("--model", help="a Hugging Face model directory or a .gguf file; none: SmolLM2-135M")
    add(
        "--mmproj",
        help="llama.cpp's multimodal projector file (a GGUF vision tower) for a .gguf --model: "
        "serves images for Gemma 3, SmolVLM/Idefics3 and Qwen2.5-VL",
    )
    add("--served-model-name", help="the model's name in the API; none: from the model")
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--port", type=int, default=30000, help="port to listen on; 0 picks a free one")
    add(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="what the model computes in; auto: float32 on the CPU, bfloat16 elsewhere",
    )
    add(
        "--vision-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="what a vision model's image tower computes in; auto: the model's dtype (bfloat16 "
        "is several times faster on CPUs with AMX or AVX512-BF16: benchmarks/RESULTS.md, Images)",
    )
    add(
        "--activation-bits",
        type=int,
        default=16,
        choices=list(ACTIVATION_BITS),
        help="what int8/int4 layers round activations to; 8: llama.cpp's numerics, faster "
        "prefill and batched decode, less accurate",
    )
    add(
        "--backend",
        default="auto",
        choices=list(BACKEND_NAMES),
        help="how the worker computes: auto (Triton kernels on a CUDA device, the CPU kernels "
        "where this CPU has AVX2 or AVX-512, the torch reference elsewhere), cpu-kernels, "
        "triton (needs pip install 'pyserve[gpu]'), or torch (the reference, any device); the "
        "startup log and /server_info say which ran and why",
    )
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPE_NAMES),
        help="what K and V are stored in; auto: float16 for a float32 model on the CPU "
        "(as llama.cpp), the model's dtype otherwise; int8: symmetric int8 with a float32 "
        "scale per token and kv head (about half float16's bytes)",
    )
    add("--device", default="cpu", help="torch device of the model worker")
    add(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: the model split over N worker processes joined by "
        "torch.distributed (gloo on the CPU, NCCL on CUDA, rank r on cuda:r)",
    )
    add(
        "--dp",
        "--data-parallel-size",
        dest="dp",
        type=int,
        default=1,
        help="replicas of the model on this machine behind SGLang's model gateway "
        "(sglang-router, pip install 'pyserve[router]'): N servers on free local ports, the "
        "router on --host/--port; on CUDA each gets its own --tp GPUs, on the CPU its share "
        "of the cores",
    )
    add(
        "--router-policy",
        default="cache_aware",
        choices=list(replicas.ROUTER_POLICIES),
        help="with --dp: how the router picks a replica (cache_aware: the one whose prefix "
        "cache holds most of the prompt, unless the load is too uneven)",
    )
    add(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATION_NAMES),
        help="linear layers as 8- or 4-bit integers on pyserve's CPU kernels or, on CUDA, its "
        "Triton ones (int8, int4: several times faster small-batch decode, logits slightly off "
        "float32), or none; auto: the precision a GGUF file stores (int4 for Q4_*, int8 for "
        "Q5_*-Q8_0), none for float checkpoints",
    )
    kv = run.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-tokens", type=int, help="KV cache size in tokens")
    kv.add_argument(
        "--kv-cache-gib", type=float, help="KV cache size in GiB (of each --tp rank); none: 1 GiB"
    )
    add(
        "--mem-fraction-static",
        type=float,
        help="on a CUDA device, the fraction of its memory the worker holds once loaded: the KV "
        f"pool takes what the weights leave of it; none: {DEFAULT_MEM_FRACTION} on CUDA unless "
        "--kv-cache-tokens or --kv-cache-gib is given",
    )
    add("--block-size", type=int, default=16, help="tokens per KV cache block")
    add("--context-length", type=int, help="a context length below the model's")
    add("--max-running-requests", type=int, default=256, help="requests computed together")
    add(
        "--max-prefill-tokens",
        type=int,
        help="prompt tokens in one step; none: 512 on the CPU (decodes keep flowing), 8192 else",
    )
    add(
        "--chunked-prefill-size",
        type=int,
        help="prompt tokens of one request in one step; none: 512 on the CPU, 2048 else",
    )
    add(
        "--schedule-policy",
        default="fcfs",
        choices=["fcfs", "lpm", "priority"],
        help="queue order: arrival, longest cached prefix first, or requests' priority field "
        "(lower first; a waiting request preempts less important running ones)",
    )
    add(
        "--fairness",
        default="none",
        choices=["none", "tenant"],
        help="tenant: admit first the waiting request of the tenant served the fewest tokens "
        "(a request's tenant: its user field, Anthropic's metadata.user_id; none given: one "
        "anonymous tenant), and preempt a running request of a tenant served more than "
        "--fairness-quantum tokens beyond a waiting one's; needs --schedule-policy fcfs",
    )
    add(
        "--fairness-quantum",
        type=int,
        default=4096,
        help="with --fairness tenant: tokens a tenant may be served beyond a waiting tenant "
        "before its running request is retracted (recomputed later, mostly from the prefix "
        "cache) to give the waiting one its slot; larger: fewer preemptions",
    )
    add("--disable-radix-cache", action="store_true", help="no prefix caching")
    add_speculative_args(add)
    add("--tokenizer-workers", type=int, default=2, help="threads for chat templates and encoding")
    add("--stream-interval", type=int, default=1, help="stream a chunk every N tokens")
    add("--torch-threads", type=int, help="torch threads of the worker; none: torch's default")
    add("--seed", type=int, help="sampling seed of requests that give none")
    add(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "none", *TOOL_CALL_PARSERS, HARMONY],
        help="how the model writes tool calls (hermes: Qwen/Hermes <tool_call>; llama3_json; "
        "mistral [TOOL_CALLS]; harmony: gpt-oss; generic: any model, tools in the system "
        "prompt and one JSON object of calls or a reply); auto: the format its chat template "
        "uses, else generic; none: refuse tools",
    )
    add(
        "--reasoning-parser",
        choices=[*REASONING_PARSERS, HARMONY],
        help="return a thinking model's <think>...</think> as reasoning_content (qwen3: the "
        "model opens it; deepseek_r1: the prompt does); none: the thought stays in the content. "
        "A harmony model's (gpt-oss) analysis channel is its reasoning_content without a flag",
    )
    add(
        "--pooling",
        choices=["last", "mean", "cls"],
        help="how /v1/embeddings pools the final hidden states: the last token, the mean over "
        "all tokens, or the first; default: the model's (a sentence-transformers Pooling "
        "module, last for a decoder embedding model such as Qwen3-Embedding, else mean)",
    )
    add(
        "--embedding-normalize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="scale embeddings to unit length (the default; --no-embedding-normalize: as pooled)",
    )
    add(
        "--rerank-mode",
        default="auto",
        choices=["auto", "yes-no", "cosine"],
        help="how /v1/rerank scores: yes-no (a Qwen3-Reranker-style model's 'yes'/'no' logits "
        "under its prompt), cosine (of embeddings); auto: yes-no for a model named a reranker",
    )
    add(
        "--api-key",
        default=os.environ.get("PYSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(also read from $PYSERVE_API_KEY)",
    )
    add("--max-queued-requests", type=int, help="429 once this many requests wait to start")
    add("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="413 above this")
    add("--log-requests", action="store_true", help="log prompts and outputs")
    add_image_args(add)
    add(
        "--state-dir",
        default=str(resolve_state_dir()),
        help="what survives a restart, in a private directory (created 0700): stored Responses "
        "API responses (previous_response_id) and the disk cache of prefix blocks "
        "(kv-cache/); default: $PYSERVE_STATE_DIR, else $XDG_CACHE_HOME/pyserve, else "
        "~/.cache/pyserve (here %(default)s)",
    )
    add(
        "--responses-store-mb",
        type=float,
        default=256,
        help="the most MB of stored responses; the oldest go first (0: store none)",
    )
    add(
        "--no-web-ui",
        dest="web_ui",
        action="store_false",
        help="do not serve the chat page (/) and the dashboard (/dashboard)",
    )
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight work")
    add(
        "--step-timeout",
        type=float,
        default=300.0,
        help="seconds the worker may take to answer one step before /health answers 503 and an "
        "error is logged (until the step completes; nothing is killed); 0: never",
    )
    add(
        "--request-timeout",
        type=float,
        help="seconds a generation request may take, queue and generation together, unless it "
        "sets its own timeout; past it a request that produced nothing gets a 503 "
        '(request_timeout), one that did ends with finish_reason "timeout"; none: no limit',
    )
    add(
        "--disk-cache-gib",
        type=float,
        default=None,
        help="GiB of disk under --state-dir for prefix-cache blocks evicted from the KV pool "
        "(and, at a clean stop, all cached ones): a prompt reusing them loads them instead of "
        "recomputing, after a restart too; 0: off; default: "
        f"{DEFAULT_DISK_CACHE_GIB:g} (0 with --disable-radix-cache)",
    )
    return parser


def disk_cache_bytes(args: argparse.Namespace) -> int:
    gib = args.disk_cache_gib
    if gib is None:
        gib = 0.0 if args.disable_radix_cache else DEFAULT_DISK_CACHE_GIB
    if not gib >= 0:  # also NaN
        raise ValueError(f"--disk-cache-gib must be >= 0, got {gib}")
    return int(gib * 2**30)


DEFAULT_MEM_FRACTION = 0.88  # SGLang's default for a large GPU


def add_image_args(add: Callable[..., object]) -> None:
    """Where the images of chat requests (image_url parts) may come from, and how large."""
    add(
        "--no-fetch-images",
        dest="fetch_images",
        action="store_false",
        help="refuse http(s):// image URLs (images then come as base64 data: URLs, or file:// "
        "under --allowed-media-dir)",
    )
    add(
        "--allowed-media-dir",
        type=existing_dir,
        help="accept file:// image URLs of files under this directory (symlinks and '..' "
        "resolved first); none: file:// URLs are refused",
    )
    add(
        "--max-image-bytes",
        type=int,
        default=DEFAULT_MAX_IMAGE_BYTES,
        help="the largest image, encoded, that a request may send or a URL may serve",
    )
    add(
        "--image-fetch-timeout",
        type=float,
        default=DEFAULT_IMAGE_FETCH_TIMEOUT,
        help="seconds to fetch one http(s) image URL, redirects and body included",
    )
    add(
        "--max-images-per-request",
        type=int,
        default=DEFAULT_MAX_IMAGES_PER_REQUEST,
        help="a request with more images is refused (400)",
    )


def existing_dir(path: str) -> str:
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is not a directory")
    return path


def image_options(args: argparse.Namespace) -> ImageOptions:
    return ImageOptions(
        fetch=args.fetch_images,
        allowed_media_dir=args.allowed_media_dir,
        max_bytes=args.max_image_bytes,
        fetch_timeout=args.image_fetch_timeout,
        max_images=args.max_images_per_request,
    )


def add_speculative_args(add: Callable[..., object]) -> None:
    """SGLang's names for speculative decoding (the algorithm case-insensitive, as there)."""
    defaults = EngineConfig()
    add(
        "--speculative-algorithm",
        type=str.lower,
        choices=list(SPECULATIVE_ALGORITHMS),
        help="speculative decoding: ngram drafts tokens from the request's own prompt and "
        "output and from earlier requests' sequences; standalone drafts with a smaller model "
        "(--speculative-draft-model-path, the same vocabulary); either is verified in the "
        "batched step (outputs are exactly those without it); default: off",
    )
    add(
        "--speculative-draft-model-path",
        help="the draft model of --speculative-algorithm standalone (a Hugging Face directory "
        "or a .gguf file)",
    )
    add(
        "--speculative-num-draft-tokens",
        type=int,
        default=defaults.speculative_num_draft_tokens,
        help="the most drafts one request verifies in a step (each request's count adapts to "
        "its acceptance); default: %(default)s",
    )
    add(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=defaults.speculative_ngram_min_match_window_size,
        help="the shortest suffix of the output that may propose drafts; default: %(default)s",
    )
    add(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=defaults.speculative_ngram_max_match_window_size,
        help="the longest suffix looked up (longer matches win); default: %(default)s",
    )
    add(
        "--speculative-ngram-capacity",
        type=int,
        default=defaults.speculative_ngram_capacity,
        help="tokens of finished requests' sequences kept to draft from (emptied by "
        "/flush_cache); 0: each request drafts from itself only; default: %(default)s",
    )
    add(
        "--speculative-token-budget",
        type=int,
        default=defaults.speculative_token_budget,
        help="a step speculates only while its decodes plus drafts stay within this many "
        "tokens (larger batches are compute-bound, where drafts cost more than they save); "
        "default: %(default)s",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        model=args.model,
        mmproj=args.mmproj,
        vision_dtype=args.vision_dtype,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        activation_bits=args.activation_bits,
        backend=args.backend,
        tp_size=args.tp,
        block_size=args.block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        schedule_policy=args.schedule_policy,
        fairness=args.fairness,
        fairness_quantum=args.fairness_quantum,
        enable_radix_cache=not args.disable_radix_cache,
        max_model_len=args.context_length,
        tokenizer_workers=args.tokenizer_workers,
        stream_interval=args.stream_interval,
        torch_threads=args.torch_threads,
        seed=args.seed,
        log_level=args.log_level,
        step_timeout=args.step_timeout,
        request_timeout=args.request_timeout,
        disk_cache_bytes=disk_cache_bytes(args),
        state_dir=args.state_dir,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        pooling=args.pooling,
        embedding_normalize=args.embedding_normalize,
        rerank_mode=args.rerank_mode,
        speculative_algorithm=args.speculative_algorithm,
        speculative_draft_model_path=args.speculative_draft_model_path,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        speculative_ngram_min_match_window_size=args.speculative_ngram_min_match_window_size,
        speculative_ngram_max_match_window_size=args.speculative_ngram_max_match_window_size,
        speculative_ngram_capacity=args.speculative_ngram_capacity,
        speculative_token_budget=args.speculative_token_budget,
    )
    if args.kv_cache_gib is not None:
        config.kv_cache_bytes = int(args.kv_cache_gib * (1 << 30))
    sized = args.kv_cache_tokens is not None or args.kv_cache_gib is not None
    if args.mem_fraction_static is not None:
        config.mem_fraction_static = args.mem_fraction_static
    elif args.device.startswith("cuda") and not sized:
        config.mem_fraction_static = DEFAULT_MEM_FRACTION
    return config


def curl_example(url: str, model: str, needs_key: bool) -> str:
    auth = ' -H "Authorization: Bearer $PYSERVE_API_KEY"' if needs_key else ""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 64}'
    )
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


class ShutdownSignals:
    """SIGTERM/SIGINT: the first one drains the server; a second one stops waiting for the
    requests in flight."""

    def __init__(self, state: ServerState) -> None:
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self._state = state
        self._loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        if self.stop.is_set():
            self.hurry.set()
            return
        log.info("%s: shutting down (send it again to stop at once)", signal.Signals(signum).name)
        self._state.draining = True  # new requests get 503 from now on
        self.stop.set()

    def remove(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._loop.remove_signal_handler(signum)


async def first_of(*awaitables: Awaitable) -> None:
    """Waits until one of ``awaitables`` is done; cancels the others."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def start_engine(
    engine: Engine, url: str, signals: ShutdownSignals, needs_key: bool, web_ui: bool = True
) -> bool:
    """Loads the model, logging progress; False if it failed or a signal came first."""
    log.info(
        "loading %s … (%s/health answers 503 until ready)",
        engine.config.model or "the default model (SmolLM2-135M-Instruct)",
        url,
    )
    started = time.monotonic()

    async def report_progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            log.info("still loading the model (%.0f s)…", time.monotonic() - started)

    starting = asyncio.ensure_future(engine.start())
    await first_of(asyncio.shield(starting), signals.stop.wait(), report_progress())
    if not starting.done():  # a signal: give up loading
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        return False
    if starting.exception() is not None:
        log.error("the engine did not start: %s", starting.exception())
        return False
    # Everything alive now lives as long as the server: freezing it keeps full garbage
    # collections short (one over the loaded libraries stalls the event loop noticeably).
    gc.collect()
    gc.freeze()
    pages = f"; chat page: {url}/, dashboard: {url}/dashboard" if web_ui else ""
    log.info(
        "pyserve is ready at %s (%s, loaded in %.1f s)%s; try: %s",
        url,
        engine.model_name,
        time.monotonic() - started,
        pages,
        curl_example(url, engine.model_name, needs_key),
    )
    return True


async def serve_until_stopped(
    engine: Engine, state: ServerState, signals: ShutdownSignals, shutdown_timeout: float
) -> int:
    """Serves until a signal (then drains: 0) or the engine's death (1)."""
    failed = asyncio.ensure_future(engine.wait_failed())
    await first_of(asyncio.shield(failed), signals.stop.wait())
    if failed.done():
        log.error("exiting: %s", failed.result())
        # Requests in flight have failed: let their handlers write the errors, and let probes
        # see a 503 from /health (a status, not just a refused connection) before going.
        await asyncio.gather(state.wait_idle(HANDLER_GRACE_S), asyncio.sleep(DEAD_LINGER_S))
        return 1
    failed.cancel()
    if state.in_flight:
        log.info(
            "waiting up to %.0f s for %d request(s) in flight", shutdown_timeout, state.in_flight
        )
        await first_of(state.wait_idle(shutdown_timeout), signals.hurry.wait())
        if state.in_flight:
            log.warning("ending %d request(s) still in flight", state.in_flight)
    return 0


async def serve(args: argparse.Namespace) -> int:
    config = engine_config(args)
    try:
        config.validate()
        images = image_options(args)
    except ValueError as exc:
        log.error("invalid settings: %s", exc)
        return 2
    engine = Engine(config)
    app = create_app(
        engine,
        api_key=args.api_key,
        max_body_bytes=args.max_request_bytes,
        max_queued_requests=args.max_queued_requests,
        log_requests=args.log_requests,
        web_ui=args.web_ui,
        state_dir=args.state_dir,
        responses_store_mb=args.responses_store_mb,
        images=images,
    )
    state = server_state(app)
    runner = web.AppRunner(app, shutdown_timeout=HANDLER_GRACE_S, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        await runner.cleanup()
        return 1
    host, port = runner.addresses[0][:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    signals = ShutdownSignals(state)
    try:
        if not await start_engine(engine, url, signals, args.api_key is not None, args.web_ui):
            return 0 if signals.stop.is_set() else 1
        return await serve_until_stopped(engine, state, signals, args.shutdown_timeout)
    finally:
        await engine.shutdown()  # fails whatever still runs, with an error for its client
        await runner.cleanup()
        signals.remove()
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.dp != 1:  # N replicas and the router, supervised (pyserve/replicas.py)
        try:  # one line here rather than one from each replica
            engine_config(args).validate()
        except ValueError as exc:
            log.error("invalid settings: %s", exc)
            return 2
        return replicas.run(args, parser)
    logging.getLogger("aiohttp.server").addFilter(HTTP2PrefaceFilter())
    try:
        import uvloop
    except ImportError:  # uvloop is not available on every platform
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())

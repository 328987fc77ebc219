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
import signal
import sys
import time

from aiohttp import web

from pyserve.http.bodies import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger("pyserve")

PROGRESS_EVERY_S = 5.0
HANDLER_GRACE_S = 3.0  # after the engine stops: time for handlers to write their error events


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyserve", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve a model over HTTP")
    add = run.add_argument
    add("--model", help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M)")
    add("--served-model-name", help="the model name in the API (default: from the model)")
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=30000, help="0 picks a free port (default: %(default)s)")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add("--device", default="cpu", help="torch device of the worker (default: %(default)s)")
    kv = run.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-tokens", type=int, help="KV pool size in tokens")
    kv.add_argument("--kv-cache-gib", type=float, help="KV pool size in GiB (default: 1)")
    add("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    add("--context-length", type=int, help="cap the model's context length")
    add("--max-running-requests", type=int, default=256)
    add("--max-prefill-tokens", type=int, default=8192)
    add("--chunked-prefill-size", type=int, default=2048)
    add("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"])
    add("--disable-radix-cache", action="store_true", help="no prefix caching")
    add("--tokenizer-workers", type=int, default=2, help="tokenizer threads (default: 2)")
    add("--stream-interval", type=int, default=1, help="stream a chunk every N tokens")
    add("--torch-threads", type=int, help="torch threads of the worker (default: torch's)")
    add("--seed", type=int, help="sampling seed for requests that give none")
    add("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")
    add("--max-queued-requests", type=int, help="429 when this many requests wait to start")
    add("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="413 above this")
    add("--log-requests", action="store_true", help="log prompts and outputs (off by default)")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight work")
    return parser


def engine_config(args: argparse.Namespace):  # -> EngineConfig
    from pyserve.engine import EngineConfig

    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        schedule_policy=args.schedule_policy,
        enable_radix_cache=not args.disable_radix_cache,
        max_model_len=args.context_length,
        tokenizer_workers=args.tokenizer_workers,
        stream_interval=args.stream_interval,
        torch_threads=args.torch_threads,
        seed=args.seed,
        log_level=args.log_level,
    )
    if args.kv_cache_gib is not None:
        config.kv_cache_bytes = int(args.kv_cache_gib * (1 << 30))
    return config


def curl_example(url: str, model: str, api_key: str | None) -> str:
    auth = " -H 'Authorization: Bearer $PYSERVE_API_KEY'" if api_key else ""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 64}'
    )
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


async def _report_progress(started: float) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        log.info("still loading the model (%.0f s)…", time.monotonic() - started)


async def serve(args: argparse.Namespace) -> int:
    from pyserve.engine import Engine
    from pyserve.http.app import create_app, server_state

    config = engine_config(args)
    try:
        config.validate()
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
    )
    state = server_state(app)
    runner = web.AppRunner(app, shutdown_timeout=HANDLER_GRACE_S, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        await runner.cleanup()
        return 1
    host, port = runner.addresses[0][:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    drain_cut = asyncio.Event()  # a second signal: stop waiting for requests in flight

    def on_signal(signum: int) -> None:
        if stop.is_set():
            drain_cut.set()
            return
        log.info("%s: shutting down (send it again to stop at once)", signal.Signals(signum).name)
        state.draining = True
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    log.info(
        "loading %s … (health check %s/health answers 503 until ready)",
        args.model or "the default model (SmolLM2-135M-Instruct)",
        url,
    )
    started = time.monotonic()
    progress = asyncio.create_task(_report_progress(started))
    starting = asyncio.create_task(engine.start())
    stopping = asyncio.create_task(stop.wait())
    code = 0
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        progress.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
            return 0
        if starting.exception() is not None:
            log.error("the engine did not start: %s", starting.exception())
            return 1
        # Everything alive now lives as long as the server: freezing it keeps full garbage
        # collections short (one over the loaded libraries stalled the loop ~200 ms on 2 cores).
        gc.collect()
        gc.freeze()
        log.info(
            "pyserve is ready at %s (%s, loaded in %.1f s); try: %s",
            url,
            engine.model_name,
            time.monotonic() - started,
            curl_example(url, engine.model_name, args.api_key),
        )

        failed = asyncio.create_task(engine.wait_failed())
        await asyncio.wait({failed, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            log.error("exiting: %s", failed.result())
            state.draining = True
            code = 1
        else:
            failed.cancel()
            if state.in_flight:
                log.info(
                    "waiting up to %.0f s for %d request(s) in flight",
                    args.shutdown_timeout,
                    state.in_flight,
                )
                idle = asyncio.create_task(state.wait_idle(args.shutdown_timeout))
                cut = asyncio.create_task(drain_cut.wait())
                await asyncio.wait({idle, cut}, return_when=asyncio.FIRST_COMPLETED)
                idle.cancel()
                cut.cancel()
                if state.in_flight:
                    log.warning("ending %d request(s) still in flight", state.in_flight)
        return code
    finally:
        progress.cancel()
        stopping.cancel()
        await engine.shutdown()  # fails whatever still runs, with an error for its client
        await runner.cleanup()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        import uvloop
    except ImportError:  # uvloop is not available on every platform
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())

"""pyserve inside your own aiohttp application: the whole API mounted under /llm.

    python examples/embed_aiohttp.py [--model PATH] [--port 8080]
    curl http://127.0.0.1:8080/llm/v1/chat/completions \
        -d '{"messages": [{"role": "user", "content": "Hello!"}]}'
"""

from __future__ import annotations

import argparse

from aiohttp import web

from pyserve import Engine, EngineConfig, create_app


async def index(request: web.Request) -> web.Response:
    return web.json_response({"service": "my gateway", "llm": "/llm/v1/chat/completions"})


def make_app(config: EngineConfig) -> web.Application:
    app = web.Application()
    app.router.add_get("/", index)
    engine = Engine(config)

    async def engine_lifetime(_: web.Application):
        await engine.start()  # loads the model, starts the worker and detokenizer processes
        yield
        await engine.shutdown()

    app.cleanup_ctx.append(engine_lifetime)
    app.add_subapp("/llm", create_app(engine))
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF directory or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    web.run_app(make_app(EngineConfig(model=args.model)), host="127.0.0.1", port=args.port)

"""The aiohttp application of ``llmc serve``: the KServe v2 and OpenAI routes (chat, completions, responses),
Anthropic's Messages API, vLLM's utility routes (health, version, tokenize), TGI's routes (generate, generate_stream,
info) and ``/metrics`` over one state."""

from __future__ import annotations

from aiohttp import web

from llmc.serve.anthropic_api import add_anthropic_routes
from llmc.serve.cors import cors_middleware, response_marker
from llmc.serve.metrics import CONTENT_TYPE
from llmc.serve.kserve_http import add_kserve_routes
from llmc.serve.openai_api import add_openai_routes
from llmc.serve.openai_responses_api import add_responses_routes
from llmc.serve.state import STATE_KEY, ServerState, auth_and_errors
from llmc.serve.tgi_api import add_tgi_routes
from llmc.serve.vllm_api import add_vllm_routes


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the Prometheus text exposition of the server's metrics."""
    body = request.app[STATE_KEY].client.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def create_app(state: ServerState) -> web.Application:
    """The aiohttp application with the KServe v2, OpenAI, Anthropic, vLLM utility, TGI and metrics routes (and CORS,
    :mod:`llmc.serve.cors`)."""
    app = web.Application(middlewares=[cors_middleware(state.allowed_origins), auth_and_errors],
                          client_max_size=state.max_body_bytes)
    if state.allowed_origins:
        app.on_response_prepare.append(response_marker(state.allowed_origins))
    app[STATE_KEY] = state
    add_kserve_routes(app)
    add_openai_routes(app)
    add_responses_routes(app)
    add_anthropic_routes(app)
    add_vllm_routes(app)
    add_tgi_routes(app)
    app.router.add_get("/metrics", metrics)
    return app

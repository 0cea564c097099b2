"""Run ``llmc serve``: load the engine, start HTTP + gRPC on one event loop, drain gracefully on SIGTERM.

Shutdown (SIGTERM or SIGINT): readiness turns false and new requests get 503 / UNAVAILABLE; in-flight
requests get ``grace_s`` to finish, the rest are aborted (their streams end with finish_reason "abort");
then both servers stop and :func:`serve` returns normally (exit status 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from llmc.errors import ServeError
from llmc.engine.tensorrt_llm.engine import CONCURRENCY_HINT, TrtllmEngine
from llmc.engine.types import StepRunner
from llmc.errors import EngineError
from llmc.manifest import read_manifest
from llmc.runtime.api import Engine
from llmc.serve.engine_client import EngineClient
from llmc.serve.app import create_app
from llmc.serve.state import ServerState
from llmc.serve.reasoning import ReasoningSyntax, served_reasoning
from llmc.serve.tool_syntax import ToolSyntax, served_syntax

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """Resolved ``llmc serve`` options (recipe ``serving`` defaults already applied)."""

    host: str
    port: int
    grpc_port: int | None  # None: no gRPC server
    api_key: str | None
    request_timeout_s: float
    grace_s: float = 30.0
    # Connection timeouts a normal client never hits: a connection gets keepalive_timeout_s to send a complete
    # request head (idle keep-alive connections and slow headers alike), then body_timeout_s for the body.
    keepalive_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    tool_call_syntax: str | None = None  # None: the recipe's serving.tool_call_syntax
    reasoning_syntax: str | None = None  # None: the recipe's serving.reasoning_syntax
    allowed_origins: tuple[str, ...] = ()  # browser origins that may call the HTTP routes (CORS; "*": any)


def load_engine(build_dir: str | Path, device: str = "auto", max_queue_size: int | None = None,
                metrics_log: str | Path | None = None, speculative_tokens: int | None = None) -> Engine:
    """The engine ``llmc serve`` runs: ``Engine.from_dir`` with ``serving.max_queue_size`` (and
    ``serving.speculative_tokens``) optionally overridden, appending its per-step and per-request records to
    ``metrics_log`` (JSON lines) when given.

    Raises EngineError for a TensorRT-LLM build, from its manifest, before loading anything.
    """
    if read_manifest(Path(build_dir)).backend == "tensorrt_llm":
        raise EngineError(_not_servable(build_dir))
    engine = Engine.from_dir(build_dir, device=device, speculative_tokens=speculative_tokens)
    return with_max_queue_size(engine, max_queue_size, metrics_log)


def with_max_queue_size(engine: Engine | TrtllmEngine, max_queue_size: int | None,
                        metrics_log: str | Path | None = None) -> Engine:
    """``engine`` ready for the server, with ``serving.max_queue_size`` overridden when given and a metrics log
    when ``metrics_log`` names one (either makes a new Engine over the same runner and tokenizer; ``engine`` must
    not have been started). EngineError when its runner is not a step runner llmc's scheduler can drive (a
    TensorRT-LLM build: its requests are batched by Triton's tensorrt_llm backend instead)."""
    if not isinstance(engine, Engine) or not isinstance(engine.runner, StepRunner):
        raise EngineError(_not_servable(getattr(engine.recipe, "name", "this build")))
    recipe = engine.recipe
    if max_queue_size is not None and max_queue_size != recipe.serving.max_queue_size:
        recipe = dataclasses.replace(recipe, serving=dataclasses.replace(recipe.serving,
                                                                         max_queue_size=max_queue_size))
    elif metrics_log is None:
        return engine
    speculator = engine.scheduler.speculator  # the loaded engine's overrides carry over
    return Engine(engine.runner, engine.tokenizer, recipe, engine.eos_token_ids, metrics_log=metrics_log,
                  prefix_caching=engine.block_manager.enable_prefix_caching,
                  mixed_step_tokens=engine.scheduler.max_mixed_tokens or 0,
                  speculative_tokens=speculator.num_draft if speculator is not None else 0)


def _not_servable(build: object) -> str:
    return f"{build} is a TensorRT-LLM build, which llmc serve cannot run. Fix: {CONCURRENCY_HINT}"


def answer_syntaxes(engine: Engine, options: ServeOptions) -> tuple[ToolSyntax | None, ReasoningSyntax | None]:
    """How the server reads chat answers: the model's tool-call syntax (for ``tool_choice: "auto"``) and whether
    thinking is split off, from the options, else the recipe's ``serving``, guessed from the chat template."""
    serving, template = engine.recipe.serving, getattr(engine.tokenizer, "chat_template", None)
    return (served_syntax(options.tool_call_syntax or serving.tool_call_syntax, template),
            served_reasoning(options.reasoning_syntax or serving.reasoning_syntax, template))


def make_state(engine: Engine, options: ServeOptions) -> ServerState:
    """The handlers' shared state for a loaded engine."""
    client = EngineClient(engine, options.request_timeout_s)
    tool_syntax, reasoning = answer_syntaxes(engine, options)
    return ServerState(client, engine.recipe.served_model_name, engine.default_params, engine.runner.vocab_size,
                       options.api_key, body_timeout_s=options.body_timeout_s, tool_syntax=tool_syntax,
                       reasoning=reasoning, max_model_len=engine.recipe.engine.max_seq_len,
                       allowed_origins=options.allowed_origins)


async def serve_async(engine: Engine, options: ServeOptions, stop: asyncio.Event,
                      on_ready: Callable[[], None] | None = None) -> None:
    """Serve until ``stop`` is set, then drain and shut down. ``engine`` must not be started yet."""
    from llmc.serve.grpc_server import start_grpc_server  # optional: tritonclient's protos (the serve extra)

    state = make_state(engine, options)
    engine.start()
    runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           keepalive_timeout=options.keepalive_timeout_s)
    await runner.setup()
    grpc_server = None
    try:
        try:
            await web.TCPSite(runner, options.host, options.port).start()
        except OSError as exc:
            raise ServeError(f"cannot listen on {options.host}:{options.port} ({exc.strerror or exc}); pass a "
                             f"free --port or stop the process that holds it") from None
        if options.grpc_port is not None:
            grpc_server = await start_grpc_server(state, options.host, options.grpc_port,
                                                  idle_timeout_s=options.keepalive_timeout_s)
        if on_ready is not None:
            on_ready()
        await stop.wait()
        log.info("shutting down: draining %d in-flight requests", len(state.client.in_flight))
        await state.client.drain(options.grace_s)
    finally:
        engine.shutdown()
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)
        await runner.cleanup()


def serve(engine: Engine, options: ServeOptions, on_ready: Callable[[], None] | None = None) -> None:
    """Blocking entry point of ``llmc serve``: returns after a graceful SIGTERM/SIGINT shutdown."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_async(engine, options, stop, on_ready)

    asyncio.run(main())

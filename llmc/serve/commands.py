"""``llmc serve ENGINE_DIR`` and ``llmc repo ENGINE_DIR OUT`` (registered by llmc/cli.py)."""

from __future__ import annotations

from pathlib import Path

import click

from llmc.runtime.scheduler.speculate import MAX_DRAFT_TOKENS


@click.command("serve")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default=None, help="Bind address (default: the recipe's serving.host, 127.0.0.1).")
@click.option("--port", type=int, default=None, help="HTTP port (default: serving.port).")
@click.option("--grpc-port", type=int, default=None, help="gRPC port (default: serving.grpc_port; 0 disables).")
@click.option("--api-key", default=None, envvar="LLMC_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or 'X-Api-Key: KEY', Anthropic's header) on every "
                   "endpoint except health (env LLMC_API_KEY).")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N")
@click.option("--max-queue-size", type=int, default=None, help="Waiting requests before 503 (default: recipe).")
@click.option("--request-timeout", "request_timeout", type=float, default=None,
              help="Seconds before a request is aborted (default: serving.request_timeout_s).")
@click.option("--grace", type=float, default=30.0, show_default=True,
              help="Seconds in-flight requests get to finish after SIGTERM.")
@click.option("--keepalive-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds a connection may take to send a complete request head: idle keep-alive "
                   "connections and clients sending headers slowly are closed after it (gRPC: idle connections).")
@click.option("--body-timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds a request body may take to arrive after its headers (then 408 and the connection "
                   "is closed).")
@click.option("--metrics-log", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Append the engine's records as JSON lines to FILE: one per step (duration, decode and prompt "
                   "tokens, running / waiting requests, KV blocks) and one per finished request (TTFT, ITLs).")
@click.option("--tool-call-syntax", type=click.Choice(["auto", "hermes", "json", "none"]), default=None,
              help="How the model writes tool calls, for chat's tool_choice \"auto\": hermes (<tool_call> blocks), "
                   "json (the answer is JSON calls: Llama 3.x, Mistral, llmc's own system message), auto (guess "
                   "from the chat template), none (refuse \"auto\"). Default: the recipe's "
                   "serving.tool_call_syntax.")
@click.option("--reasoning-syntax", type=click.Choice(["auto", "think", "none"]), default=None,
              help="think: a chat answer's <think> ... </think> goes out as message.reasoning_content, the rest as "
                   "content (thinking blocks on /v1/messages); auto: when the chat template mentions <think>; none: "
                   "answers as they come. Default: the recipe's serving.reasoning_syntax.")
@click.option("--speculative-tokens", type=click.IntRange(0, MAX_DRAFT_TOKENS), default=None,
              help="Draft tokens each step of a request verifies (prompt lookup), instead of the recipe's "
                   "serving.speculative_tokens; 0 = off (torch builds).")
@click.option("--allowed-origins", default=None, envvar="LLMC_ALLOWED_ORIGINS",
              help="Browser origins whose pages may call the HTTP routes (CORS), comma-separated, e.g. "
                   "http://localhost:3000; * for any (env LLMC_ALLOWED_ORIGINS). Default: none. The API key "
                   "still applies.")
def serve_cmd(engine_dir: Path, host: str | None, port: int | None, grpc_port: int | None, api_key: str | None,
              device: str, max_queue_size: int | None, request_timeout: float | None, grace: float,
              keepalive_timeout: float, body_timeout: float, metrics_log: Path | None,
              tool_call_syntax: str | None, reasoning_syntax: str | None, speculative_tokens: int | None,
              allowed_origins: str | None) -> None:
    """Serve ENGINE_DIR (a build folder): KServe v2 HTTP generate + gRPC, OpenAI /v1, /metrics."""
    from llmc.serve.cors import parse_origins
    from llmc.serve.run import ServeOptions, answer_syntaxes, load_engine, serve

    try:
        origins = parse_origins(allowed_origins)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--allowed-origins") from None
    engine = load_engine(engine_dir, device, max_queue_size, metrics_log, speculative_tokens)
    serving = engine.recipe.serving
    grpc = serving.grpc_port if grpc_port is None else grpc_port
    options = ServeOptions(
        host=host or serving.host,
        port=serving.port if port is None else port,
        grpc_port=grpc or None,
        api_key=api_key,
        request_timeout_s=serving.request_timeout_s if request_timeout is None else request_timeout,
        grace_s=grace,
        keepalive_timeout_s=keepalive_timeout,
        body_timeout_s=body_timeout,
        tool_call_syntax=tool_call_syntax,
        reasoning_syntax=reasoning_syntax,
        allowed_origins=origins,
    )
    name = engine.recipe.served_model_name

    tool_syntax, reasoning = answer_syntaxes(engine, options)

    def announce() -> None:
        grpc_text = f", gRPC on {options.host}:{options.grpc_port}" if options.grpc_port else ""
        click.echo(f"llmc serve: model {name!r} on http://{options.host}:{options.port}{grpc_text}", err=True)
        calls = f"read as {tool_syntax} calls" if tool_syntax else "refused (--tool-call-syntax names the syntax)"
        thinking = "split off as reasoning_content" if reasoning else "not split off (--reasoning-syntax)"
        click.echo(f"llmc serve: chat tool_choice \"auto\" {calls}; <think> {thinking}", err=True)
        speculator = engine.scheduler.speculator
        if speculator is not None:
            click.echo(f"llmc serve: up to {speculator.num_draft} draft tokens a step (prompt lookup)", err=True)
        if origins:
            click.echo(f"llmc serve: cross-origin requests from {', '.join(origins)}", err=True)

    serve(engine, options, on_ready=announce)
    click.echo("llmc serve: stopped", err=True)


@click.command("repo")
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--build-path", default=None,
              help="Where tritonserver sees the build folder (its mount point in the container).")
@click.option("--engine-path", default=None, help="gpt_model_path for tensorrt_llm (default <build-path>/engine).")
@click.option("--repo-path", default=None,
              help="Where tritonserver sees OUT (its mount point in the container; default: OUT's absolute path, "
                   "or under --build-path when OUT is inside the build folder). tensorrt_llm: guided decoding's "
                   "tokenizer info file is named by this path.")
def repo_cmd(engine_dir: Path, out: Path, build_path: str | None, engine_path: str | None,
             repo_path: str | None) -> None:
    """Generate the Triton model repository of ENGINE_DIR into OUT, then validate it."""
    from llmc.serve.pbtxt import check_ensemble, read_config
    from llmc.serve.repo import generate_model_repo

    repo = generate_model_repo(engine_dir, out, build_path=build_path, engine_path=engine_path, repo_path=repo_path)
    models = sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file())
    for model in models:
        read_config(repo / model)
    if "ensemble" in models and check_ensemble(repo):
        raise click.ClickException("the ensemble's wiring is broken: " + "; ".join(check_ensemble(repo)))
    click.echo(f"wrote {repo}: {', '.join(models)} (every config.pbtxt parses"
               f"{'; ensemble wiring checked' if 'ensemble' in models else ''})")
    click.echo(f"run: tritonserver --model-repository {repo}")

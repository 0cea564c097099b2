"""The `llmc` command line.

Commands live next to the code they drive (``llmc/<stage>/commands.py``) and are imported lazily, so
``llmc --help`` is instant and one stage's optional dependencies never break another's command.
Any :class:`~llmc.errors.LlmcError`, and any OSError the environment raises (disk full, permission denied),
becomes one ``error: ...`` line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib
import sys

import click

from llmc import __version__
from llmc.errors import LlmcError

# name -> (module:attribute, one-line help shown by `llmc --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("llmc.builder.preflight:validate_cmd", "Check a recipe (and its model, when present) without building."),
    "build": ("llmc.builder.commands:build_cmd", "Build a recipe: checkpoint IR, quantization, engine, Triton repo."),
    "inspect": ("llmc.builder.commands:inspect_cmd", "Show a build's manifest, model shape, weight bytes and KV-cache plan."),
    "generate": ("llmc.runtime.commands:generate_cmd", "Stream a completion from a built engine."),
    "bench": ("llmc.bench.commands:bench_cmd", "Benchmark TTFT / ITL / TGS offline or against a server (--url)."),
    "tune": ("llmc.bench.tune:tune_cmd", "Tune the int4 kernels (CUDA or Triton) for a W4A16 build on this GPU."),
    "serve": ("llmc.serve.commands:serve_cmd", "Serve an engine: KServe v2 HTTP + gRPC, OpenAI API, /metrics."),
    "repo": ("llmc.serve.commands:repo_cmd", "Generate the Triton model repository for a built engine."),
    "doctor": ("llmc.doctor:doctor_cmd", "Report GPU, CPU, driver, CUDA and library versions, usable backends and the CPU prefill path."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when invoked."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        target, _ = COMMANDS[cmd_name]
        module_name, attr = target.split(":")
        command = getattr(importlib.import_module(module_name), attr)
        command.name = cmd_name
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_text) for name, (_, help_text) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmc")
@click.option("-v", "--verbose", is_flag=True, help="Show debug logging.")
def cli(verbose: bool) -> None:
    """llmc: compile LLM checkpoints into deployable inference engines.

    Pipeline: recipe -> (AWQ int4) -> TensorRT-LLM checkpoint IR -> engine (torch | tensorrt_llm)
    -> runtime -> serving. Start with `llmc build recipes/smollm2-135m-awq.yaml`.
    """
    import logging

    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the CLI and maps LlmcError to exit status 2."""
    try:
        code = cli.main(args=argv, prog_name="llmc", standalone_mode=False)
    except LlmcError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:  # the environment refused (disk full, permission denied, ...): not a bug in the input
        where = f" ({exc.filename})" if exc.filename else ""
        click.echo(f"error: {exc.strerror or exc}{where}; free space or fix the permissions, then run again",
                   err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    # In non-standalone mode click returns a command's ctx.exit() status instead of exiting.
    if isinstance(code, int) and code != 0:
        sys.exit(code)


if __name__ == "__main__":
    main()

"""``llmc validate RECIPE``: the builder's checks before any work -- the recipe, its model (when the source is
present) and its backend -- without building."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from llmc.engine.tensorrt_llm.checks import check_recipe as check_trtllm_recipe
from llmc.errors import LlmcError
from llmc.recipe.checks import check_recipe_against_model, kv_cache_bytes_per_token
from llmc.recipe.load import load_recipe, recipe_hash, recipe_to_dict
from llmc.recipe.schema import Recipe
from llmc.source.sources import read_source_config

GIB = 1 << 30


@click.command("validate")
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the resolved recipe (every default filled in) as JSON.")
@click.pass_context
def validate_cmd(ctx: click.Context, recipe_path: Path, as_json: bool) -> None:
    """Check RECIPE: schema, value consistency and, when the model source is present, the model's shape.

    Exits 0 when the recipe is valid, 2 with one `error: ...` line (file, key path, fix) when it is not.
    A missing model source is only a warning: its checks then run at build time.
    """
    try:
        recipe = load_recipe(recipe_path)
        hf_config = validate_against_sources(recipe)
    except LlmcError as err:
        click.echo(f"error: {err}", err=True)
        ctx.exit(2)
    if as_json:
        click.echo(json.dumps(recipe_to_dict(recipe), indent=2))
    else:
        print_summary(recipe, hf_config)


def validate_against_sources(recipe: Recipe) -> dict[str, Any] | None:
    """Run the model-dependent and backend checks that can run now; return the model config (None if absent).

    Raises RecipeError (or another LlmcError, e.g. an unreadable source) on the first problem.
    """
    hf_config = read_source_config(recipe.model.source)
    if hf_config is None:
        click.echo(f"warning: model source not found at {recipe.model.source}: model-dependent checks run at "
                   f"build time", err=True)
    else:
        check_recipe_against_model(recipe, hf_config)
    if recipe.backend == "tensorrt_llm":
        check_trtllm_recipe(recipe, hf_config)
    return hf_config


def summary_rows(recipe: Recipe, hf_config: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(label, text) rows of the validate summary."""
    m, e, kv = recipe.model, recipe.engine, recipe.kv_cache
    eos = "auto" if m.eos_token_ids == "auto" else ", ".join(map(str, m.eos_token_ids))
    kv_dtype = f"auto (= {m.dtype})" if kv.dtype == "auto" else kv.dtype
    rows = [
        ("recipe", f"{recipe.name}  ({recipe.path}, sha256 {recipe_hash(recipe)[:12]})"),
        ("model", f"{m.source}  dtype {m.dtype}, eos ids {eos}, chat template {m.chat_template}"),
        ("quantization", _quant_text(recipe)),
        ("backend", recipe.backend + (_trt_text(recipe) if recipe.backend == "tensorrt_llm" else "")),
        ("limits", f"batch {e.max_batch_size}, input {e.max_input_len}, sequence {e.max_seq_len}, "
                   f"tokens/step {e.max_num_tokens}, tp {e.tp_size}"),
        ("kv cache", f"{'paged' if kv.paged else 'contiguous'}, {kv.tokens_per_block} tokens/block, dtype "
                     f"{kv_dtype}, GPU memory fraction {kv.memory_fraction:g}, CPU budget {kv.cpu_budget_mb} MB"),
    ]
    if hf_config is not None:
        per_token = kv_cache_bytes_per_token(recipe, hf_config)
        full = per_token * e.max_batch_size * e.max_seq_len
        rows.append(("kv plan", f"{per_token:,} bytes/token, {GIB // per_token:,} tokens/GiB; a full batch "
                                f"({e.max_batch_size} x {e.max_seq_len} tokens) needs {full / GIB:.2f} GiB"))
    s = recipe.serving
    rows.append(("serving", f"{recipe.served_model_name} on http {s.host}:{s.port}, grpc {s.grpc_port}, "
                            f"queue {s.max_queue_size}"))
    return rows


def _quant_text(recipe: Recipe) -> str:
    q = recipe.quantization
    if q.method == "none":
        return "none (16-bit weights)"
    text = f"{q.method} int{q.bits}, group {q.group_size}, {q.effective_rounding} rounding"
    if q.method == "awq":
        c = q.calibration
        mix = c.effective_sources
        total = sum(s.weight for s in mix)
        source = " + ".join((s.dataset if s.path is None else f"file {s.path}")
                            + (f" {s.weight / total:.0%}" if len(mix) > 1 else "") for s in mix)
        text += (f"; calibration {source} {c.n_samples} x {c.seq_len} tokens"
                 f"{', chat template' if c.chat_template else ''}, special tokens "
                 f"{'excluded' if q.exclude_special_tokens else 'included'}; device {q.device}")
    gate = q.gate
    if gate.enabled:
        text += (f"; gate on {', '.join(gate.domains)} ({gate.n_tokens} tokens each): mean KL <= "
                 f"{gate.max_mean_kl:g}")
        if gate.max_ppl_ratio is not None:
            text += f", perplexity ratio <= {gate.max_ppl_ratio:g}"
        if gate.max_kl_vs_rtn is not None:
            text += f", KL <= {gate.max_kl_vs_rtn:g} x RTN"
        if gate.max_ppl_vs_rtn is not None:
            text += f", perplexity <= {gate.max_ppl_vs_rtn:g} x RTN"
    return text


def _trt_text(recipe: Recipe) -> str:
    t = recipe.tensorrt_llm
    flags = [name for name in ("context_fmha", "use_paged_context_fmha", "remove_input_padding", "use_fused_mlp",
                               "multiple_profiles") if getattr(t, name)]
    sm = f", target SM{t.target_sm}" if t.target_sm is not None else ""
    return f" (gemm_plugin {t.gemm_plugin}, gpt_attention_plugin {t.gpt_attention_plugin}; {', '.join(flags)}{sm})"


def print_summary(recipe: Recipe, hf_config: dict[str, Any] | None) -> None:
    """Print the summary table and the verdict with rich."""
    from rich.console import Console
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for label, text in summary_rows(recipe, hf_config):
        table.add_row(label, text)
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
    console.print("[green]ok[/green]: the recipe is valid")

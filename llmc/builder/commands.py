"""``llmc build`` and ``llmc inspect``.

``inspect_build`` is the pure part of ``llmc inspect``: it reads the manifest, the checkpoint's config and its
safetensors headers (never the tensors) and computes the KV-cache plan.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from llmc import manifest as mf
from llmc.checkpoint.safetensors_header import tensor_headers
from llmc.console import table_console
from llmc.errors import EngineError, LlmcError

GIB = 1024**3
SAFETY_MARGIN = 0.8
# safetensors dtype tag -> bytes per element
_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                   "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_SHAPE_LABELS = (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("heads", "num_attention_heads"),
                 ("kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"), ("vocab", "vocab_size"),
                 ("intermediate", "intermediate_size"))


def _fail(exc: LlmcError) -> None:
    click.echo(f"error: {exc}", err=True)
    raise click.exceptions.Exit(2)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@click.command("build")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), default=None,
              help="Build folder (default: build/<recipe name>).")
@click.option("--force", is_flag=True, help="Rebuild even when the build is up to date.")
@click.option("--from-ir", "from_ir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Compile RECIPE's engine from the checkpoint IR of this build folder instead of quantizing "
                   "(the GPU-box half of the two-machine flow; the source model is not needed).")
def build_cmd(recipe: Path, output: Path | None, force: bool, from_ir: Path | None) -> None:
    """Build RECIPE into a build folder: checkpoint IR, engine, tokenizer and manifest."""
    from llmc.builder.pipeline import build
    from llmc.recipe import load_recipe

    err = table_console(stderr=True)  # the gate's table is 9 columns: a log gets them whole
    try:
        loaded = load_recipe(recipe)
        if from_ir is not None:
            from llmc.builder.from_ir import build_from_ir

            result = build_from_ir(loaded, from_ir, out_dir=output, console=err)
        else:
            result = build(loaded, out_dir=output, force=force, console=err)
    except LlmcError as exc:
        _fail(exc)
    out = table_console()
    if result.up_to_date:
        out.print(f"[green]up to date[/]: {result.build_dir} (recipe and source unchanged; use --force to rebuild)",
                  soft_wrap=True)
        return
    table = Table(title=f"built {result.manifest.name}", show_header=True)
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for step, seconds in result.manifest.timings.items():
        table.add_row(step, f"{seconds:.1f}")
    out.print(table)
    warned = len(result.manifest.eos_warnings)
    note = f" ({warned} eos warning(s), recorded in manifest.json)" if warned else ""
    out.print(f"checkpoint: {human_bytes(result.checkpoint_bytes)}   engine: {human_bytes(result.engine_bytes)}   "
              f"eos ids: {list(result.manifest.eos_token_ids)}{note}", soft_wrap=True)
    out.print(f"output: [bold]{result.build_dir}[/]", soft_wrap=True)  # a path stays one line in a log


def device_weight_bytes(checkpoint_dir: Path, tied: bool) -> dict[str, int]:
    """Bytes the torch engine holds for this IR on a CUDA GPU (``cuda``: int4 layers stay packed) and in page-locked
    host memory there (``cuda_host``: an untied input embedding, unless ``LLMC_EMBEDDING=device``), from the
    headers only."""
    from llmc.checkpoint.names import VOCAB_EMBEDDING
    from llmc.engine.torch.host_embedding import placement
    from llmc.engine.torch.int4_install import cuda_weight_bytes

    tensors = tensor_headers(checkpoint_dir)
    on_host = 0
    if not tied and placement() == "host" and VOCAB_EMBEDDING in tensors:
        on_host = tensors.pop(VOCAB_EMBEDDING)[2]
    return {"cuda": cuda_weight_bytes(tensors, tied), "cuda_host": on_host}


def weight_bytes_by_dtype(checkpoint_dir: Path) -> dict[str, int]:
    """Bytes of checkpoint tensors per safetensors dtype, from the files' JSON headers only."""
    totals: dict[str, int] = {}
    for dtype, _, nbytes in tensor_headers(checkpoint_dir).values():
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return totals


def kv_plan(per_token: int, kv_gib: float, max_batch_size: int, max_seq_len: int,
            tokens_per_block: int) -> dict[str, Any]:
    """What fits in a KV-cache budget of ``kv_gib`` GiB at ``per_token`` bytes per token (all layers, K and V)."""
    budget = kv_gib * GIB
    tokens = int(budget // per_token)
    margin_tokens = int(budget * SAFETY_MARGIN // per_token)
    full = per_token * max_batch_size * max_seq_len
    return {
        "bytes_per_token": per_token,
        "budget_gib": kv_gib,
        "tokens_in_budget": tokens,
        "blocks_in_budget": tokens // tokens_per_block,
        "tokens_in_budget_80pct": margin_tokens,
        "max_batch_x_max_seq_len": {"batch": max_batch_size, "seq_len": max_seq_len, "bytes": full,
                                    "gib": full / GIB, "fits_budget": full <= budget},
        "sequences_of_max_seq_len_in_budget": tokens // max_seq_len,
    }


def model_shape_of(manifest: mf.Manifest, checkpoint_dir: Path) -> dict[str, int]:
    """layers, hidden, heads, kv_heads, head_dim, vocab, intermediate: from the manifest, else the IR config."""
    shape = {label: manifest.model.get(key) for label, key in _SHAPE_LABELS}
    cfg_path = checkpoint_dir / "config.json"
    if any(v is None for v in shape.values()) and cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        ir_keys = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                   "kv_heads": "num_key_value_heads", "head_dim": "head_size", "vocab": "vocab_size",
                   "intermediate": "intermediate_size"}
        shape = {k: v if v is not None else cfg.get(ir_keys[k]) for k, v in shape.items()}
    if shape["head_dim"] is None and shape["hidden"] and shape["heads"]:
        shape["head_dim"] = shape["hidden"] // shape["heads"]
    if shape["kv_heads"] is None:
        shape["kv_heads"] = shape["heads"]
    missing = [k for k, v in shape.items() if v is None]
    if missing:
        raise EngineError(f"cannot tell the model shape ({', '.join(missing)}) from the manifest or "
                          f"{cfg_path}. Fix: rebuild with `llmc build RECIPE --force`")
    return {k: int(v) for k, v in shape.items()}


def inspect_build(build_dir: Path, kv_gib: float = 1.0) -> dict[str, Any]:
    """Everything ``llmc inspect`` shows, as JSON-able data. EngineError for a missing/invalid build."""
    manifest = mf.read_manifest(build_dir)
    ckpt = Path(build_dir) / "checkpoint"
    shape = model_shape_of(manifest, ckpt)
    recipe = manifest.recipe_obj()
    from llmc.recipe.checks import DTYPE_BYTES, kv_cache_bytes_per_token

    kv_dtype = recipe.model.dtype if recipe.kv_cache.dtype == "auto" else recipe.kv_cache.dtype
    hf_shape = {key: shape[label] for label, key in _SHAPE_LABELS}
    per_token = kv_cache_bytes_per_token(recipe, hf_shape)
    plan = kv_plan(per_token, kv_gib, recipe.engine.max_batch_size, recipe.engine.max_seq_len,
                   recipe.kv_cache.tokens_per_block)
    by_dtype = weight_bytes_by_dtype(ckpt)
    ir_cfg = json.loads((ckpt / "config.json").read_text()) if (ckpt / "config.json").exists() else {}
    return {
        "build_dir": str(Path(build_dir).absolute()),
        "name": manifest.name,
        "format_version": manifest.format_version,
        "backend": manifest.backend,
        "dtype": recipe.model.dtype,
        "source": manifest.source,
        "recipe_sha256": manifest.recipe_sha256,
        "created_at": manifest.created_at,
        "tools": manifest.tools,
        "timings": manifest.timings,
        "architecture": ir_cfg.get("architecture"),
        "model": shape,
        "weights": {"bytes_by_dtype": by_dtype, "total_bytes": sum(by_dtype.values()),
                    "on_device_bytes": device_weight_bytes(ckpt, bool(ir_cfg.get("tie_word_embeddings")))},
        "quantization": {"recipe": manifest.quantization, "checkpoint": ir_cfg.get("quantization")},
        "eos_token_ids": list(manifest.eos_token_ids),
        "special_token_ids": list(manifest.special_token_ids),
        "kv_cache": {"dtype": kv_dtype, "dtype_bytes": DTYPE_BYTES[kv_dtype], **plan,
                     "fp8_scales": fp8_scales(Path(build_dir))},
    }


def fp8_scales(build_dir: Path) -> dict[str, Any] | None:
    """An fp8 cache's per-layer scales in the IR and the build's held-out KL of the cache against a 16-bit one
    (``build_report.json``); None for a 16-bit cache."""
    from llmc.checkpoint.io import read_kv_scales

    scales = read_kv_scales(build_dir / "checkpoint")
    if scales is None:
        return None
    report_path = build_dir / "build_report.json"
    report = json.loads(report_path.read_text()).get("kv_scales") if report_path.is_file() else None
    return {"layers": len(scales), "min": min(scales), "max": max(scales),
            "heldout_mean_kl": (report or {}).get("mean_kl")}


def _host_part(held: dict[str, int]) -> str:
    """`` (+ N input embedding in page-locked host memory)`` where the engine keeps it there, else ""."""
    on_host = held.get("cuda_host", 0)
    return f" (+ {human_bytes(on_host)} input embedding in page-locked host memory)" if on_host else ""


def _print_inspection(info: dict[str, Any], console: Console) -> None:
    line = functools.partial(console.print, soft_wrap=True)  # paths and long lines stay whole in a log
    line(f"[bold]{info['name']}[/]  {info['build_dir']}")
    line(f"backend {info['backend']}, dtype {info['dtype']}, format v{info['format_version']}, "
         f"built {info['created_at']}")
    src = info["source"]
    line(f"source: {src.get('kind')} {src.get('origin')} (sha256 {str(src.get('sha256'))[:16]}…)")
    line(f"model: {info['architecture']}, " + ", ".join(f"{k} {v}" for k, v in info["model"].items()))
    weights = info["weights"]
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(weights["bytes_by_dtype"].items()))
    line(f"weights: {human_bytes(weights['total_bytes'])} ({parts}); held on a CUDA GPU by the torch "
         f"engine: {human_bytes(weights['on_device_bytes']['cuda'])}{_host_part(weights['on_device_bytes'])}")
    q = info["quantization"]["recipe"]
    qtext = "none" if q.get("method") == "none" else f"{q.get('method')} int{q.get('bits')} group {q.get('group_size')}"
    line(f"quantization: {qtext}")
    line(f"eos ids: {info['eos_token_ids']}   special ids: {len(info['special_token_ids'])}")
    line("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in info["timings"].items()))
    kv = info["kv_cache"]
    full = kv["max_batch_x_max_seq_len"]
    table = Table(title=f"KV-cache plan ({kv['dtype']}, {kv['dtype_bytes']} B/elem)", show_header=False)
    table.add_row("bytes per token", f"{kv['bytes_per_token']:,} ({human_bytes(kv['bytes_per_token'])})")
    table.add_row(f"tokens in {kv['budget_gib']:g} GiB",
                  f"{kv['tokens_in_budget']:,} ({kv['blocks_in_budget']:,} blocks)")
    table.add_row(f"tokens in {SAFETY_MARGIN:.0%} of it", f"{kv['tokens_in_budget_80pct']:,}")
    table.add_row(f"batch {full['batch']} x seq {full['seq_len']}",
                  f"{human_bytes(full['bytes'])} ({'fits' if full['fits_budget'] else 'exceeds'} the budget)")
    console.print(table)
    fp8 = kv.get("fp8_scales")
    if fp8:
        kl = fp8["heldout_mean_kl"]
        line(f"fp8 KV cache: {fp8['layers']} layer scales {fp8['min']:.4g}-{fp8['max']:.4g}"
             + (f", held-out mean KL {kl:.4f} against a 16-bit cache" if kl is not None else "")
             + "; fp8 on CUDA GPUs of compute capability 8.9+, 16-bit elsewhere", highlight=False)


@click.command("inspect")
@click.argument("build_dir", type=click.Path(path_type=Path))
@click.option("--kv-gib", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="KV-cache memory budget for the plan, in GiB.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def inspect_cmd(build_dir: Path, kv_gib: float, as_json: bool) -> None:
    """Show a build's manifest, model shape, weight bytes by dtype, eos ids and KV-cache plan."""
    try:
        info = inspect_build(build_dir, kv_gib)
    except LlmcError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    _print_inspection(info, table_console())

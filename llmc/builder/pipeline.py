"""``llmc build``: recipe -> build folder (checkpoint IR, engine, tokenizer, manifest), atomically.

Order of work: check the output location (an existing folder is replaced only when it holds a valid llmc
manifest), remove temp folders that killed builds left in the same parent, locate and hash the source, skip
when up to date, check the recipe against the model's config (cheap, before any conversion), resolve the source
(may convert a GGUF file, once, cached), then build into ``<parent>/.<name>.tmp-<pid>/`` and swap it in with one
atomic exchange. Any failure removes the temp folder, so a failed build never leaves a partial folder and never
damages the previous build; a build killed with -9 leaves either the old build or the new one in place, and its
temp folder is removed by the next build into the same parent.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from llmc import manifest as mf
from llmc.builder.build_files import export_tokenizer, make_manifest
from llmc.builder.export import export_checkpoint
from llmc.builder.kv_scales import calibrate_checkpoint
from llmc.builder.output_dir import building_into, check_output_location, remove_stale_temp_dirs
from llmc.builder.progress import BuildProgress
from llmc.builder.quantize import quantize_checkpoint
from llmc.builder.verify import accuracy_gate
from llmc.engine.base import compile_engine
from llmc.engine.torch import cpu_ext
from llmc.errors import BuildError, SourceError
from llmc.recipe import Recipe, recipe_hash, recipe_to_dict
from llmc.recipe.checks import check_recipe_against_model
from llmc.serve.repo import generate_model_repo
from llmc.source import load, sources

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class BuildResult:
    """What a build produced: the folder, its manifest, whether it was skipped as up to date, its sizes."""

    build_dir: Path
    manifest: mf.Manifest
    up_to_date: bool
    checkpoint_bytes: int
    engine_bytes: int


def default_build_dir(recipe: Recipe) -> Path:
    """``build/<recipe.name>`` relative to the current directory."""
    return Path("build") / recipe.name


def build(recipe: Recipe, out_dir: Path | None = None, force: bool = False, console: Console | None = None,
          cache_dir: Path | None = None) -> BuildResult:
    """Build ``recipe`` into ``out_dir`` (default ``build/<name>``) and return the result.

    Skips (``up_to_date=True``) when the existing manifest has the same recipe and source hashes, unless
    ``force``. Raises BuildError (output not writable, not an llmc build folder), SourceError, RecipeError
    (recipe inconsistent with the model) or any step's error; in every failure case no partial folder is left.
    ``console``: where rich progress goes (None: silent).
    """
    out_dir = Path(out_dir if out_dir is not None else default_build_dir(recipe)).absolute()
    check_output_location(out_dir)
    if out_dir.parent.is_dir():
        remove_stale_temp_dirs(out_dir.parent)
    origin = sources.locate_source(recipe.model.source)
    source_sha = load.source_sha256(origin)
    recipe_sha = recipe_hash(recipe)
    existing = _existing_manifest(out_dir)
    if not force and existing is not None and _is_current(existing, recipe_sha, source_sha):
        return _result(out_dir, existing, up_to_date=True)
    if recipe.backend == "tensorrt_llm":  # say so before a long quantization, not at the engine step
        from llmc.engine.tensorrt_llm.versions import require_tensorrt_llm_for_build

        require_tensorrt_llm_for_build()
    if recipe.quantization.method != "none":
        require_quant_extra(recipe.quantization.method)
    check_against_model(recipe)
    with building_into(out_dir) as tmp, BuildProgress(console) as progress:
        manifest = _build_into(tmp, out_dir, recipe, recipe_sha, source_sha, progress, cache_dir)
    return _result(out_dir, manifest, up_to_date=False)


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def require_quant_extra(method: str) -> None:
    """BuildError unless the ``quant`` extra is installed: llm-compressor with transformers 5.15+ (llmc's core
    also runs on transformers 4, e.g. inside TensorRT-LLM's environment, where quantization cannot)."""
    compressor, transformers = _package_version("llmcompressor"), _package_version("transformers") or "none"
    if compressor is not None and int(transformers.split(".")[0]) >= 5:
        return
    raise BuildError(
        f"quantization.method {method} needs the quant extra (llm-compressor 0.14 with transformers 5.15 - 5.17); "
        f"this environment has llm-compressor {compressor or 'none'} and transformers {transformers}. Fix: "
        f"pip install 'llmc[quant]', in another venv or machine if this one holds TensorRT-LLM (it pins "
        f"transformers 4); README, \"Two machines\""
    )


def check_against_model(recipe: Recipe) -> None:
    """Check the recipe against the model's config (cheap read, no conversion): architecture, limits, sizes."""
    hf_config = sources.read_source_config(recipe.model.source)
    if hf_config is None:
        raise SourceError(f"model source {recipe.model.source} has no config.json. Fix: point model.source at a "
                          f"Hugging Face model folder or a .gguf file")
    load.check_architecture(hf_config, Path(str(recipe.model.source)))
    check_recipe_against_model(recipe, hf_config)


def _existing_manifest(out_dir: Path) -> mf.Manifest | None:
    """The manifest of the build in ``out_dir`` (check_output_location has refused anything else), or None."""
    if not (out_dir / mf.MANIFEST_NAME).exists():
        return None
    return mf.read_manifest(out_dir)


def _is_current(existing: mf.Manifest, recipe_sha: str, source_sha: str) -> bool:
    return (existing.format_version == mf.FORMAT_VERSION and existing.recipe_sha256 == recipe_sha
            and existing.source.get("sha256") == source_sha)


def _build_into(tmp: Path, out_dir: Path, recipe: Recipe, recipe_sha: str, source_sha: str, progress: BuildProgress,
                cache_dir: Path | None) -> mf.Manifest:
    """Run every build step into the empty folder ``tmp`` (renamed to ``out_dir`` afterwards); returns the
    written manifest."""
    started = time.perf_counter()
    if recipe.backend == "torch":
        # The compile step (and self-generated calibration text on the CPU) load llmc's CPU kernels; on a machine's
        # first build that compiles them (~13 s of g++), which here overlaps the single-threaded GGUF conversion.
        cpu_ext.load_in_background()
    with progress.step("resolve source"):
        source = load.resolve_source(recipe.model, cache_dir=cache_dir, sha256=source_sha)
    reports: dict[str, Any] = {"eos_warnings": list(source.eos_warnings)}
    reports.update(_checkpoint_steps(tmp, source, recipe, progress))
    with progress.step("tokenizer"):
        export_tokenizer(source, tmp / "tokenizer")
    with progress.step("compile engine") as s:
        s.note(recipe.backend)
        reports["engine"] = compile_engine(recipe, tmp / "checkpoint", tmp / "engine")
    with progress.step("model repository"):
        reports["model_repo"] = write_model_repo(tmp, out_dir, recipe, source.eos_token_ids)
    timings = dict(progress.timings)
    timings["total"] = round(time.perf_counter() - started, 3)
    (tmp / "build_report.json").write_text(json.dumps(_jsonable(reports), indent=2, sort_keys=True) + "\n")
    write_recipe_copy(recipe, tmp / "recipe.yaml")
    manifest = make_manifest(recipe, recipe_sha, source, timings)
    mf.write_manifest(tmp, manifest)
    return manifest


def _checkpoint_steps(tmp: Path, source: load.SourceModel, recipe: Recipe, progress: BuildProgress) -> dict:
    """Export the 16-bit IR, or quantize (AWQ/RTN); calibrate an FP8 KV cache's scales; run the accuracy gate of a
    quantized build (with the fp8 cache where the recipe asks for one); returns the step reports."""
    ckpt = tmp / "checkpoint"
    reports: dict[str, Any] = {}
    if recipe.quantization.method == "none":
        with progress.step("export checkpoint"):
            reports["export"] = export_checkpoint(source, recipe, ckpt)
    else:
        with progress.step(f"quantize ({recipe.quantization.method})") as step:
            reports["quantize"] = quantize_checkpoint(source, recipe, ckpt, progress=step)
    if recipe.kv_cache.dtype == "fp8":
        with progress.step("fp8 KV-cache scales") as step:
            reports["kv_scales"] = calibrate_checkpoint(source, recipe, ckpt)
            step.note(f"held-out KL {reports['kv_scales']['mean_kl']:.4f}")
    if recipe.quantization.method != "none" and recipe.quantization.gate.enabled:
        with progress.step("accuracy gate"):
            reports["gate"] = accuracy_gate(source, recipe, ckpt, console=progress.console)
    return reports


def write_model_repo(tmp: Path, out_dir: Path, recipe: Recipe, eos_token_ids: tuple[int, ...]) -> str:
    """Generate the Triton model repository; its configs are validated with tritonclient's protos, so
    without the ``serve`` extra the step is skipped (and said so) rather than written unchecked."""
    if importlib.util.find_spec("tritonclient") is None:
        log.warning("skipped the Triton model repository: tritonclient is not installed. "
                    "Fix: pip install 'llmc[serve]', then run `llmc repo %s %s/model_repo`", out_dir, out_dir)
        return "skipped: tritonclient is not installed (pip install 'llmc[serve]'; then llmc repo)"
    return str(generate_model_repo(tmp, tmp / "model_repo", recipe=recipe, eos_token_ids=eos_token_ids,
                                   build_path=out_dir))


def write_recipe_copy(recipe: Recipe, path: Path) -> None:
    """Copy the recipe file; a recipe built from a dict is written as its resolved YAML."""
    if recipe.path is not None and Path(recipe.path).is_file():
        shutil.copy2(recipe.path, path)
        return
    path.write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))


def _jsonable(value: Any) -> Any:
    """Reports may hold Paths, tuples or numpy/torch scalars; make them JSON-able."""
    return json.loads(json.dumps(value, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def folder_bytes(folder: Path) -> int:
    """Total size of the files under ``folder`` (0 when absent)."""
    if not folder.exists():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _result(out_dir: Path, manifest: mf.Manifest, up_to_date: bool) -> BuildResult:
    return BuildResult(
        build_dir=out_dir,
        manifest=manifest,
        up_to_date=up_to_date,
        checkpoint_bytes=folder_bytes(out_dir / "checkpoint"),
        engine_bytes=folder_bytes(out_dir / "engine"),
    )

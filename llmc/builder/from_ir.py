"""``llmc build RECIPE --from-ir BUILD_DIR``: compile a recipe's engines from the checkpoint IR of another build.

The second half of the two-machine flow (README, "Two machines"): a machine without TensorRT-LLM quantizes
(``backend: torch``: its ``checkpoint/`` is the backend-independent IR), the build folder is copied to a GPU
box, and there this step compiles the ``tensorrt_llm`` engines from that IR without the source model,
the calibration data or llm-compressor. The new build folder gets the IR and tokenizer copied from the
given build (the tokenizer's config as transformers 4 reads it, :func:`make_tokenizer_portable`), the engine,
the Triton repository and a manifest whose source, eos ids and model shape are the given build's (the weights
are its weights) and whose recipe, tools and timings are this build's. Like ``llmc build``, it is written into
a temp folder and swapped in; a failure leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from llmc import manifest as mf
from llmc.builder.build_files import make_tokenizer_portable
from llmc.builder.output_dir import building_into, check_output_location
from llmc.builder.pipeline import BuildResult, default_build_dir, folder_bytes, write_model_repo, write_recipe_copy
from llmc.builder.progress import BuildProgress
from llmc.engine.base import compile_engine
from llmc.errors import BuildError
from llmc.recipe import Recipe, recipe_hash, recipe_to_dict


def check_same_weights(recipe: Recipe, ir_manifest: mf.Manifest, ir_build: Path) -> None:
    """BuildError unless ``recipe`` asks for the weights the IR build holds (dtype and quantization)."""
    wanted = {"model.dtype": recipe.model.dtype, "quantization": recipe_to_dict(recipe)["quantization"]}
    found = {"model.dtype": ir_manifest.dtype, "quantization": ir_manifest.quantization}
    differ = [key for key in wanted if wanted[key] != found[key]]
    if differ:
        raise BuildError(
            f"{ir_build} holds other weights than the recipe asks for: "
            + "; ".join(f"{k} is {found[k]} there, {wanted[k]} in the recipe" for k in differ)
            + ". Fix: use the same model.dtype and quantization section in both recipes, or build the IR again")


def build_from_ir(recipe: Recipe, ir_build: Path, out_dir: Path | None = None, console: Console | None = None
                  ) -> BuildResult:
    """Build ``recipe``'s engine from ``ir_build``'s ``checkpoint/`` into ``out_dir`` (default ``build/<name>``).

    Raises EngineError (``ir_build`` is not an llmc build), BuildError (other weights, output folder is
    ``ir_build`` or not writable), CheckpointError / RecipeError / BackendUnavailableError from the engine
    step. Never modifies ``ir_build``.
    """
    ir_build = Path(ir_build).absolute()
    ir_manifest = mf.read_manifest(ir_build)
    out_dir = Path(out_dir if out_dir is not None else default_build_dir(recipe)).absolute()
    if out_dir == ir_build:
        raise BuildError(f"the output folder {out_dir} is the build whose IR is read. Fix: pass another folder "
                         f"with -o DIR (or give the recipe another name)")
    check_same_weights(recipe, ir_manifest, ir_build)
    check_output_location(out_dir)
    started = time.perf_counter()
    with building_into(out_dir) as tmp:
        with BuildProgress(console) as progress:
            with progress.step("copy IR and tokenizer"):
                shutil.copytree(ir_build / "checkpoint", tmp / "checkpoint")
                shutil.copytree(ir_build / "tokenizer", tmp / "tokenizer")
                make_tokenizer_portable(tmp / "tokenizer")  # an IR build made before llmc wrote it so
            reports: dict[str, Any] = {"ir_from": str(ir_build)}
            with progress.step("compile engine") as step:
                step.note(recipe.backend)
                reports["engine"] = compile_engine(recipe, tmp / "checkpoint", tmp / "engine")
            with progress.step("model repository"):
                reports["model_repo"] = write_model_repo(tmp, out_dir, recipe, ir_manifest.eos_token_ids)
        timings = {**progress.timings, "total": round(time.perf_counter() - started, 3)}
        (tmp / "build_report.json").write_text(json.dumps(reports, indent=2, sort_keys=True, default=str) + "\n")
        write_recipe_copy(recipe, tmp / "recipe.yaml")
        manifest = dataclasses.replace(
            ir_manifest, name=recipe.name, recipe=recipe_to_dict(recipe), recipe_sha256=recipe_hash(recipe),
            backend=recipe.backend, tools=mf.tool_versions(), timings=timings,
            created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            extra={**ir_manifest.extra, "ir_from": {"build": str(ir_build), "recipe_sha256": ir_manifest.recipe_sha256,
                                                    "tools": ir_manifest.tools, "created_at": ir_manifest.created_at}})
        mf.write_manifest(tmp, manifest)
    return BuildResult(out_dir, manifest, False, folder_bytes(out_dir / "checkpoint"), folder_bytes(out_dir / "engine"))

"""Triton model repository generation from the templates in the top-level ``model_repo/`` folder.

``tensorrt_llm`` builds get the five-model TensorRT-LLM layout (ensemble, preprocessing, tensorrt_llm,
postprocessing, tensorrt_llm_bls); ``torch`` builds get one decoupled Python model named after the served
model that runs llmc's runtime. Every config.pbtxt is filled from the recipe and the manifest, parsed with
Triton's schema, and the ensemble's wiring is checked before the function returns.

A ``tensorrt_llm`` repository also carries ``tensorrt_llm/xgrammar_tokenizer_info.json``: the tokenizer facts the
tensorrtllm C++ backend hands to xgrammar for guided decoding (the ``guided_decoding_guide_type`` /
``guided_decoding_guide`` inputs), named by the model's ``xgrammar_tokenizer_info_path`` parameter.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

from llmc.errors import BuildError, SourceError
from llmc.recipe import Recipe
from llmc.serve.pbtxt import check_ensemble, fill_template, parse_config, read_config, render_inputs
from llmc.serve.protocol import ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS
from llmc.serve.trtllm_backend import check_trtllm_model
from llmc.tokenizer import byte_level_decoder, load_tokenizer

log = logging.getLogger(__name__)
TRTLLM_MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
TORCH_TEMPLATE = "llmc"
_TMP_BUILD = re.compile(r"^\.(?P<name>.+)\.tmp-\d+$")  # llmc build's temp folder, renamed at the end
# In the tensorrt_llm model's folder: Triton takes only numeric sub-folders of a model as versions, so a file
# beside config.pbtxt is never mistaken for a model or a version.
XGRAMMAR_INFO = "xgrammar_tokenizer_info.json"


def template_root() -> Path:
    """The ``model_repo`` templates: the source checkout's top-level folder, else the copy inside the
    installed package (``llmc/serve/model_repo``, see pyproject's package-dir mapping)."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "model_repo", here / "model_repo"):
        if (candidate / "ensemble" / "config.pbtxt").is_file():
            return candidate
    raise BuildError(f"the Triton model_repo templates are missing (looked in {here.parents[1] / 'model_repo'} "
                     f"and {here / 'model_repo'}); reinstall llmc")


def generate_model_repo(build_dir: str | Path, out_dir: str | Path, *, recipe: Recipe | None = None,
                        eos_token_ids: Sequence[int] | None = None, build_path: str | Path | None = None,
                        engine_path: str | Path | None = None, repo_path: str | Path | None = None) -> Path:
    """Write the Triton model repository of a build folder to ``out_dir`` (replaced if present); returns it.

    ``recipe`` / ``eos_token_ids`` default to the build's manifest. ``build_path`` is where the build folder
    is seen by tritonserver (default: its absolute path; the container's mount point otherwise) and
    ``engine_path`` overrides ``gpt_model_path`` (default ``<build_path>/engine``). ``repo_path`` is where
    tritonserver sees ``out_dir`` (default: ``build_path`` plus the relative path when ``out_dir`` is inside the
    build folder, as ``llmc build``'s ``model_repo`` is, else its absolute path); the ``tensorrt_llm`` model's
    ``xgrammar_tokenizer_info_path`` points into it. Raises BuildError when a generated file does not parse,
    the ensemble's wiring is broken, the tensorrt_llm model lacks what the tensorrtllm backend reads
    (``llmc.serve.trtllm_backend``) or the build's tokenizer cannot give xgrammar's tokenizer info; EngineError
    for a folder that is not an llmc build. A tokenizer error comes before ``out_dir`` is touched; any later
    error removes ``out_dir``, so no half-written repository is left.
    """
    build_dir, out_dir = Path(build_dir), Path(out_dir)
    if recipe is None:
        from llmc.manifest import read_manifest

        manifest = read_manifest(build_dir)
        recipe, eos_token_ids = manifest.recipe_obj(), manifest.eos_token_ids
    eos = tuple(eos_token_ids if eos_token_ids is not None else _tokenizer_eos(build_dir))
    build_path = Path(build_path) if build_path is not None else _final_path(build_dir)
    repo_path = Path(repo_path) if repo_path is not None else _seen_repo_path(build_dir, out_dir, build_path)
    info = xgrammar_tokenizer_info(build_dir / "tokenizer", eos) if recipe.backend == "tensorrt_llm" else None
    info_path = repo_path / "tensorrt_llm" / XGRAMMAR_INFO if info is not None else None
    values = template_values(recipe, eos, build_path, engine_path, _pad_id(build_dir, eos), info_path)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    try:
        _write_models(out_dir, recipe, values, info)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return out_dir


def _write_models(out_dir: Path, recipe: Recipe, values: dict[str, Any], info: dict[str, Any] | None) -> None:
    """Render the backend's models into ``out_dir`` and check them (see :func:`generate_model_repo`)."""
    root = template_root()
    if recipe.backend != "tensorrt_llm":
        _render_model(root / TORCH_TEMPLATE, out_dir / recipe.served_model_name, values)
        return
    for name in TRTLLM_MODELS:
        _render_model(root / name, out_dir / name, values)
    (out_dir / "tensorrt_llm" / XGRAMMAR_INFO).write_text(json.dumps(info), encoding="utf-8")  # ASCII: \u escapes
    problems = check_ensemble(out_dir)
    if problems:
        raise BuildError("the generated ensemble is mis-wired: " + "; ".join(problems))
    problems = check_trtllm_model(read_config(out_dir / "tensorrt_llm"))
    if problems:
        raise BuildError("the generated tensorrt_llm model does not match Triton's tensorrtllm backend: "
                         + "; ".join(problems))


def xgrammar_tokenizer_info(tokenizer_dir: Path, eos: Sequence[int]) -> dict[str, Any]:
    """The JSON object the tensorrtllm C++ backend reads from ``xgrammar_tokenizer_info_path`` for guided
    decoding: ``encoded_vocab`` (list index = token id, every id of the tokenizer, ``""`` for an unused id, which
    xgrammar treats as a never-allowed special token), ``tokenizer_str`` (the fast tokenizer's tokenizer.json,
    from which xgrammar detects byte-level / byte-fallback decoding: :func:`llmc.tokenizer.byte_level_decoder`) and
    ``stop_token_ids`` (the build's eos ids, the tokens that may end a guided output). BuildError naming the fix
    when the tokenizer cannot give them.
    """
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except SourceError as exc:
        raise BuildError(f"cannot write xgrammar's tokenizer info for guided decoding: {exc}") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise BuildError(f"the tokenizer in {tokenizer_dir} is a slow ({type(tokenizer).__name__}) tokenizer "
                         f"without tokenizer.json, so the xgrammar tokenizer info that TensorRT-LLM's guided "
                         f"decoding reads (tokenizer_str) cannot be written. Fix: save a fast tokenizer there "
                         f"(AutoTokenizer.from_pretrained(dir, use_fast=True).save_pretrained(dir) writes "
                         f"tokenizer.json), then run `llmc repo` again")
    vocab = tokenizer.get_vocab()
    encoded = [""] * (max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        encoded[token_id] = token
    if not eos:
        log.warning("the build has no eos ids, so guided outputs of the tensorrt_llm model can only end at "
                    "max_tokens; set model.eos_token_ids in the recipe and rebuild")
    return {"encoded_vocab": encoded, "tokenizer_str": byte_level_decoder(backend.to_str()),
            "stop_token_ids": [int(i) for i in eos]}


def template_values(recipe: Recipe, eos: Sequence[int], build_path: Path, engine_path: str | Path | None,
                    pad_id: int, xgrammar_info_path: Path | None = None) -> dict[str, Any]:
    """Every ``${placeholder}`` of the templates, from the recipe (serving, engine, kv_cache, model). Guided
    decoding in the tensorrt_llm model is on (``xgrammar``) only with ``xgrammar_info_path``: the backend treats
    an empty value as unset."""
    serving, count = recipe.serving, recipe.serving.instance_count
    return {
        "model_name": recipe.served_model_name,
        "max_batch_size": recipe.engine.max_batch_size,
        "build_path": str(build_path),
        "engine_path": str(engine_path if engine_path is not None else build_path / "engine"),
        "tokenizer_dir": str(build_path / "tokenizer"),
        "add_special_tokens": recipe.model.add_special_tokens,
        "apply_chat_template": False,
        "skip_special_tokens": recipe.runtime.sampling.skip_special_tokens,
        "eos_token_ids": list(eos),
        "pad_id": pad_id,
        "decoupled": True,
        "max_queue_size": serving.max_queue_size,
        "batch_scheduler_policy": serving.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": recipe.kv_cache.memory_fraction,
        "enable_kv_cache_reuse": serving.enable_kv_cache_reuse,
        "enable_chunked_context": serving.enable_chunked_context,
        "preprocessing_instance_count": count,
        "postprocessing_instance_count": count,
        "bls_instance_count": count,
        "ensemble_inputs": render_inputs(ENSEMBLE_INPUTS),
        "ensemble_outputs": render_inputs(ENSEMBLE_OUTPUTS, outputs=True),
        "guided_decoding_backend": "xgrammar" if xgrammar_info_path is not None else "",
        "xgrammar_tokenizer_info_path": str(xgrammar_info_path) if xgrammar_info_path is not None else "",
    }


def _render_model(template_dir: Path, model_dir: Path, values: dict[str, Any]) -> None:
    """Copy one model's template folder, filling and validating its config.pbtxt."""
    shutil.copytree(template_dir, model_dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    config_path = model_dir / "config.pbtxt"
    text = fill_template(config_path.read_text(), values, str(template_dir / "config.pbtxt"))
    parse_config(text, str(config_path))
    config_path.write_text(text)
    (model_dir / "1").mkdir(exist_ok=True)


def _final_path(build_dir: Path) -> Path:
    """The build folder's absolute path once ``llmc build`` has renamed its temp folder into place."""
    build_dir = build_dir.absolute()
    match = _TMP_BUILD.match(build_dir.name)
    return build_dir.parent / match.group("name") if match else build_dir


def _seen_repo_path(build_dir: Path, out_dir: Path, build_path: Path) -> Path:
    """Where tritonserver sees ``out_dir``: under ``build_path`` when it lies inside the build folder (``llmc
    build`` writes ``<build>/model_repo``), else its absolute path."""
    try:
        return build_path / out_dir.absolute().relative_to(build_dir.absolute())
    except ValueError:
        return out_dir.absolute()


def _tokenizer_eos(build_dir: Path) -> tuple[int, ...]:
    gen = build_dir / "tokenizer" / "generation_config.json"
    if not gen.is_file():
        raise BuildError(f"{gen} is missing, so the eos ids are unknown; pass eos_token_ids or rebuild")
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()


def _pad_id(build_dir: Path, eos: Sequence[int]) -> int:
    """The tokenizer's pad id (generation_config.json), else the first eos id, else 0."""
    gen = build_dir / "tokenizer" / "generation_config.json"
    pad = json.loads(gen.read_text()).get("pad_token_id") if gen.is_file() else None
    return int(pad) if isinstance(pad, int) else (eos[0] if eos else 0)

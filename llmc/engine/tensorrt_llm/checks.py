"""Recipe checks specific to the tensorrt_llm backend, run before any build work.

Each failure raises ``RecipeError(file, key_path, problem, fix)``. Facts and their reference lines
(/work/shared/reference/tensorrt-llm.md) are given next to each check; docs/TENSORRT_LLM.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable

from llmc.errors import RecipeError
from llmc.recipe.checks import QK_NORM_TYPES, SUPPORTED_ARCHITECTURES, is_supported_architecture, model_family
from llmc.recipe import Recipe

ENGINE_DTYPES = ("float16", "bfloat16")  # line 23: checkpoint dtype float16 | bfloat16
# Groupwise int4 GEMM granularity: features are padded to multiples of max(64, g) (line 61), and
# TensorRT-LLM's groupwise W4A16 kernels take group sizes 64 and 128 (not in the reference: see
# docs/TENSORRT_LLM.md, "unverified").
AWQ_GROUP_SIZES = (64, 128)
INT4_METHODS = ("awq", "rtn")  # both write a W4A16_AWQ checkpoint (line 30)
INT4_REFUSED_SM = range(100, 120)  # line 80: INT4 weight-only refused on SM100-SM119


def local_compute_capability() -> int | None:
    """The local GPU's compute capability as ``major * 10 + minor`` (90 for H100), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return major * 10 + minor


def check_recipe(recipe: Recipe, hf_config: dict | None,
                 local_sm: Callable[[], int | None] = local_compute_capability) -> None:
    """Refuse recipes TensorRT-LLM 1.0 - 1.2 cannot build, before any work.

    ``hf_config`` is the source model's HF config (None when the weights are not present: the
    model-dependent checks are then skipped). ``local_sm`` is asked for the GPU's compute capability
    only when ``recipe.tensorrt_llm.target_sm`` is null.
    """
    file = str(recipe.path) if getattr(recipe, "path", None) else None
    _check_dtype(recipe, file)
    _check_limits(recipe, file)
    _check_group_size(recipe, file)
    _check_int4_sm(recipe, file, local_sm)
    if hf_config is not None:
        _check_architecture(hf_config, file)
        _check_tensor_parallel(recipe, hf_config, file)
        _check_groupwise_features(recipe, hf_config, file)


def _check_dtype(recipe: Recipe, file: str | None) -> None:
    if recipe.model.dtype not in ENGINE_DTYPES:
        raise RecipeError(
            file, "model.dtype",
            f"{recipe.model.dtype} is not an engine dtype of TensorRT-LLM's checkpoint format "
            f"(float16 | bfloat16)",
            "set model.dtype to float16 or bfloat16, or use backend: torch for float32",
        )


def _check_limits(recipe: Recipe, file: str | None) -> None:
    limits = recipe.engine
    if limits.max_seq_len < limits.max_input_len:
        raise RecipeError(
            file, "engine.max_seq_len",
            f"max_seq_len {limits.max_seq_len} is below max_input_len {limits.max_input_len}; the engine "
            "could not hold a full-length prompt plus one generated token",
            f"raise engine.max_seq_len to at least {limits.max_input_len + 1} or lower engine.max_input_len",
        )


def _check_group_size(recipe: Recipe, file: str | None) -> None:
    quant = recipe.quantization
    if quant.method not in INT4_METHODS or quant.group_size in AWQ_GROUP_SIZES:
        return
    raise RecipeError(
        file, "quantization.group_size",
        f"group size {quant.group_size} is not one TensorRT-LLM's W4A16_AWQ (groupwise int4) GEMM accepts: "
        f"it pads groupwise layers to multiples of max(64, group_size) and its kernels take group sizes "
        f"{' or '.join(map(str, AWQ_GROUP_SIZES))}",
        "set quantization.group_size to 128 (or 64), or use backend: torch, which runs any group size",
    )


def _check_int4_sm(recipe: Recipe, file: str | None, local_sm: Callable[[], int | None]) -> None:
    if recipe.quantization.method not in INT4_METHODS:
        return
    target = recipe.tensorrt_llm.target_sm
    sm = int(target) if target is not None else local_sm()
    if sm is None or sm not in INT4_REFUSED_SM:
        return
    source = "tensorrt_llm.target_sm" if target is not None else "the local GPU"
    raise RecipeError(
        file, "quantization.method" if target is None else "tensorrt_llm.target_sm",
        f"INT4 weight-only (W4A16_AWQ) engines are refused by TensorRT-LLM 1.0 - 1.2 on SM100-SM119, and "
        f"{source} is SM{sm}; INT4 weight-only is supported on SM80/SM89/SM90",
        "build for an SM80/SM89/SM90 GPU, set quantization.method: none (16-bit engine), "
        "or use backend: torch",
    )


def _check_architecture(hf_config: dict, file: str | None) -> None:
    # line 23: Llama-layout sources are written as LlamaForCausalLM; Qwen2 as Qwen2ForCausalLM, which TensorRT-LLM's
    # MODEL_MAP builds as QWenForCausalLM (tensorrt_llm/models/__init__.py; docs/TENSORRT_LLM.md cites the commits)
    archs = hf_config.get("architectures") or []
    if not is_supported_architecture(hf_config):
        raise RecipeError(
            file, "model.source",
            f"architecture {archs or 'unknown'} is not supported by llmc's tensorrt_llm backend "
            f"(supported: {', '.join(sorted(set(SUPPORTED_ARCHITECTURES) - {'Qwen3ForCausalLM'}))})",
            "use a Llama-family model, or backend: torch",
        )
    if model_family(hf_config) in QK_NORM_TYPES:
        raise RecipeError(
            file, "model.source",
            "Qwen3 (per-head q / k norms) is not built by llmc's tensorrt_llm backend: no upstream TensorRT-LLM "
            "source read shows those norms in its TensorRT-engine Qwen model (docs/TENSORRT_LLM.md, U16)",
            "use backend: torch for Qwen3 (Qwen2 and Llama-family models build with either backend)",
        )


def _check_tensor_parallel(recipe: Recipe, hf_config: dict, file: str | None) -> None:
    tp = recipe.engine.tp_size
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    # line 49-50: qkv is split per head; kv heads are duplicated when nkv < tp
    kv_ok = kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0
    if heads % tp == 0 and kv_ok:
        return
    divisors = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
    raise RecipeError(
        file, "engine.tp_size",
        f"tp_size {tp} does not split the model's {heads} attention heads / {kv_heads} kv heads evenly "
        "across ranks",
        f"set engine.tp_size to one of {divisors}",
    )


def _check_groupwise_features(recipe: Recipe, hf_config: dict, file: str | None) -> None:
    """line 60-61: groupwise layers need features that are multiples of max(64, g) * tp. The exporter can
    pad intermediate_size; hidden and attention features cannot be padded without changing the model."""
    quant = recipe.quantization
    if quant.method not in INT4_METHODS:
        return
    tp, hidden = recipe.engine.tp_size, int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    multiple = max(64, quant.group_size) * tp
    features = {"hidden_size": hidden, "attention features": heads * head_dim,
                "qkv output features": (heads + 2 * kv_heads) * head_dim}
    bad = {k: v for k, v in features.items() if v % multiple}
    if not bad:
        return
    raise RecipeError(
        file, "quantization.group_size",
        f"TensorRT-LLM's groupwise int4 layers need features that are multiples of max(64, group_size) * tp_size "
        f"= {multiple}, and this model's {', '.join(f'{k} {v}' for k, v in bad.items())} are not",
        "choose a smaller group_size or tp_size, set quantization.method: none, or use backend: torch",
    )

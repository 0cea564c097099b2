"""Model-dependent recipe checks, run against the model's HF-style config before any build work.

``check_recipe_against_model`` needs only the config dict (HF field names: ``hidden_size``,
``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
``max_position_embeddings``, ``architectures``, ``model_type``, ``rope_scaling``/``rope_parameters``).
``kv_cache_bytes_per_token`` is the KV-cache plan's one formula.
"""

from __future__ import annotations

from typing import Any, get_args, get_type_hints

from llmc.errors import RecipeError
from llmc.recipe.schema import QuantSpec, Recipe

# Architectures whose layout is Llama's (RMSNorm, RoPE, GQA, SiLU-gated MLP) -> their model_type. Qwen2 adds a bias
# to q, k and v; Qwen3 an RMSNorm over each query and key head before RoPE (QK_NORM_TYPES).
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
QWEN_TYPES = ("qwen2", "qwen3")  # TensorRT-LLM's ``qwen_type`` of the Qwen architectures llmc converts
QK_NORM_TYPES = ("qwen3",)
GROUP_SIZES: tuple[int, ...] = get_args(get_type_hints(QuantSpec)["group_size"])
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}


def _error(recipe: Recipe, key_path: str, problem: str, fix: str) -> RecipeError:
    return RecipeError(str(recipe.path) if recipe.path else None, key_path, problem, fix)


def check_recipe_against_model(recipe: Recipe, hf_config: dict[str, Any]) -> None:
    """Raise RecipeError when the recipe cannot work for the model described by ``hf_config``.

    Checks: a Llama-family decoder; quantization group size divides every quantized layer's input features
    (per tensor-parallel rank for row-parallel layers); tp_size fits the head counts and intermediate size;
    max_seq_len (and the calibration length) within max_position_embeddings unless RoPE scaling is configured.
    """
    _check_architecture(recipe, hf_config)
    _check_tensor_parallel(recipe, hf_config)
    if recipe.quantization.method != "none":
        _check_group_size(recipe, hf_config)
    _check_lengths(recipe, hf_config)


def model_shape(hf_config: dict[str, Any]) -> dict[str, int]:
    """hidden, intermediate, heads, kv_heads, head_dim and layers of a config (HF defaults applied)."""
    heads = int(hf_config["num_attention_heads"])
    hidden = int(hf_config["hidden_size"])
    kv_heads = hf_config.get("num_key_value_heads")
    head_dim = hf_config.get("head_dim")
    return {
        "hidden": hidden,
        "intermediate": int(hf_config["intermediate_size"]),
        "heads": heads,
        "kv_heads": int(kv_heads) if kv_heads is not None else heads,
        "head_dim": int(head_dim) if head_dim is not None else hidden // heads,
        "layers": int(hf_config.get("num_hidden_layers", 0)),
    }


def is_supported_architecture(cfg: dict[str, Any]) -> bool:
    """True for a HF config of one of SUPPORTED_ARCHITECTURES: by ``architectures``, else by ``model_type``."""
    archs = [a for a in (cfg.get("architectures") or []) if isinstance(a, str)]
    if archs:
        return any(a in SUPPORTED_ARCHITECTURES for a in archs)
    return cfg.get("model_type") in SUPPORTED_ARCHITECTURES.values()


def model_family(cfg: dict[str, Any]) -> str:
    """``llama`` (Llama, Mistral: the same layout), ``qwen2`` or ``qwen3`` for a supported HF config."""
    archs = [a for a in (cfg.get("architectures") or []) if isinstance(a, str)]
    model_type = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                      cfg.get("model_type"))
    return model_type if model_type in QWEN_TYPES else "llama"


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """The attention window a HF config applies, None for full attention. Qwen2 configs name a window even when
    ``use_sliding_window`` is false (transformers then ignores it, as TensorRT-LLM does)."""
    if cfg.get("use_sliding_window") is False or cfg.get("sliding_window") is None:
        return None
    return int(cfg["sliding_window"])


def architecture_name(cfg: dict[str, Any]) -> str:
    """How error messages name a config's architecture: its ``architectures``, else its ``model_type``."""
    archs = [a for a in (cfg.get("architectures") or []) if isinstance(a, str)]
    return ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"


def _check_architecture(recipe: Recipe, cfg: dict[str, Any]) -> None:
    if not is_supported_architecture(cfg):
        raise _error(recipe, "model.source", f"unsupported architecture {architecture_name(cfg)}",
                     f"llmc compiles Llama-family decoders ({', '.join(sorted(SUPPORTED_ARCHITECTURES))}); point "
                     f"model.source at one (e.g. SmolLM2, Llama 3, Qwen2.5, Qwen3)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _error(recipe, "model.source", f"unsupported activation {cfg.get('hidden_act')!r} (Llama uses silu)",
                     "use a Llama-family model with a SiLU-gated MLP")
    if model_family(cfg) == "qwen3" and cfg.get("attention_bias"):
        raise _error(recipe, "model.source", "the Qwen3 model has attention biases (attention_bias: true), which "
                     "TensorRT-LLM's Qwen3 layers do not hold (no bias on the output projection)",
                     "use a Qwen3 checkpoint without attention biases (every released Qwen3 model)")
    window = sliding_window(cfg)
    if window is not None and window < recipe.engine.max_seq_len:
        raise _error(recipe, "model.source",
                     f"the model uses sliding-window attention (window {window}), which llmc does not implement",
                     f"lower engine.max_seq_len to {window} or less, or use a model with full attention")
    if not all(k in cfg for k in ("hidden_size", "intermediate_size", "num_attention_heads")):
        raise _error(recipe, "model.source", "the model config lacks hidden_size, intermediate_size or "
                     "num_attention_heads", "point model.source at a complete Hugging Face Llama config")


def _check_tensor_parallel(recipe: Recipe, cfg: dict[str, Any]) -> None:
    tp = recipe.engine.tp_size
    shape = model_shape(cfg)
    if shape["heads"] % tp:
        raise _error(recipe, "engine.tp_size",
                     f"tp_size {tp} does not divide num_attention_heads {shape['heads']}",
                     f"use a tp_size that divides {shape['heads']}: {_divisors(shape['heads'])}")
    kv = shape["kv_heads"]
    if kv % tp and tp % kv:
        raise _error(recipe, "engine.tp_size",
                     f"num_key_value_heads {kv} and tp_size {tp}: neither divides the other",
                     "KV heads are split across ranks or duplicated on them; use a tp_size that divides "
                     f"{kv} or is a multiple of it")
    if shape["intermediate"] % tp:
        raise _error(recipe, "engine.tp_size",
                     f"tp_size {tp} does not divide intermediate_size {shape['intermediate']}",
                     f"use a tp_size that divides {shape['intermediate']}")


def quantized_input_features(hf_config: dict[str, Any], tp_size: int = 1) -> dict[str, int]:
    """Input features K of each quantized linear layer as one rank holds it.

    qkv/fc/gate (column-parallel) read the full hidden size; dense and proj (row-parallel) hold K / tp.
    """
    shape = model_shape(hf_config)
    return {
        "qkv, fc, gate (hidden_size)": shape["hidden"],
        "dense (num_attention_heads x head_dim / tp_size)": shape["heads"] * shape["head_dim"] // tp_size,
        "proj (intermediate_size / tp_size)": shape["intermediate"] // tp_size,
    }


def _check_group_size(recipe: Recipe, cfg: dict[str, Any]) -> None:
    g = recipe.quantization.group_size
    features = quantized_input_features(cfg, recipe.engine.tp_size)
    bad = {layer: k for layer, k in features.items() if k % g}
    if not bad:
        return
    layer, k = next(iter(bad.items()))
    fitting = [s for s in GROUP_SIZES if all(v % s == 0 for v in features.values())]
    advice = (f"use quantization.group_size: {max(fitting)}" if fitting
              else "no supported group size divides every layer; use quantization.method: none")
    raise _error(recipe, "quantization.group_size",
                 f"group size {g} does not divide the input features of {layer} = {k} "
                 f"({k} % {g} = {k % g})",
                 f"{advice}. llmc does not pad groupwise layers (TensorRT-LLM would pad them to multiples of "
                 f"max(64, group_size) x tp_size), so the group size must divide every quantized layer's input "
                 f"features")


def has_rope_scaling(cfg: dict[str, Any]) -> bool:
    """True when the config extends the context with RoPE scaling (``rope_scaling`` or transformers-5
    ``rope_parameters`` with a ``rope_type`` other than ``default``)."""
    for key in ("rope_scaling", "rope_parameters"):
        params = cfg.get(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type", "default")) != "default":
            return True
    return False


def _check_lengths(recipe: Recipe, cfg: dict[str, Any]) -> None:
    eng = recipe.engine
    if eng.max_input_len > eng.max_seq_len:
        raise _error(recipe, "engine.max_input_len", f"max_input_len {eng.max_input_len} exceeds max_seq_len "
                     f"{eng.max_seq_len}", "lower engine.max_input_len or raise engine.max_seq_len")
    limit = cfg.get("max_position_embeddings")
    if limit is None or has_rope_scaling(cfg):
        return
    if eng.max_seq_len > int(limit):
        raise _error(recipe, "engine.max_seq_len",
                     f"max_seq_len {eng.max_seq_len} exceeds the model's max_position_embeddings {limit} "
                     f"(no RoPE scaling configured)", f"set engine.max_seq_len to {limit} or less")
    cal = recipe.quantization.calibration
    if recipe.quantization.method == "awq" and cal.seq_len > int(limit):
        raise _error(recipe, "quantization.calibration.seq_len",
                     f"seq_len {cal.seq_len} exceeds the model's max_position_embeddings {limit}",
                     f"set quantization.calibration.seq_len to {limit} or less")


def kv_cache_bytes_per_token(recipe: Recipe, hf_config: dict[str, Any]) -> int:
    """KV-cache bytes per token for the whole model: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes.

    ``kv_cache.dtype: auto`` means the model dtype. For the model as a whole: KV heads duplicated across
    tensor-parallel ranks (kv_heads < tp_size) are not counted twice.
    """
    shape = model_shape(hf_config)
    dtype = recipe.model.dtype if recipe.kv_cache.dtype == "auto" else recipe.kv_cache.dtype
    return 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * DTYPE_BYTES[dtype]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)

"""Recipe -> TensorRT-LLM BuildConfig / PluginConfig dicts, the FP8 KV quantization block, and the
equivalent ``trtllm-build`` command line.

Everything is plain data (dicts, lists of strings): nothing here imports ``tensorrt_llm``, so the
mapping is checked by CPU contract tests. Field names and defaults come from
/work/shared/reference/tensorrt-llm.md lines 73-80 (BuildConfig, PluginConfig); each constant
below names its line.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from llmc.checkpoint import kv_scales
from llmc.checkpoint.config import KV_FP8, W4A16_AWQ
from llmc.errors import CheckpointError
from llmc.recipe import Recipe

FP8_KV_ALGO = KV_FP8  # line 32: kv_cache_quant_algo for an FP8 KV cache
KV_SCALE_SUFFIX = "attention.kv_cache_scaling_factor"  # line 32: per-layer fp32 tensor of shape [1]
PLUGIN_DTYPES = ("float16", "bfloat16")  # line 23: checkpoint/engine dtypes
MAX_BEAM_WIDTH = 1  # line 73: BuildConfig max_beam_width (default 1); llmc does not beam-search

# The exact key sets llmc writes (lines 73-78). Tests compare against these literally.
BUILD_CONFIG_KEYS = (
    "max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width",
    "kv_cache_type", "plugin_config",
)
PLUGIN_CONFIG_KEYS = (
    "gpt_attention_plugin", "gemm_plugin", "context_fmha", "use_paged_context_fmha",
    "remove_input_padding", "tokens_per_block", "use_fused_mlp", "multiple_profiles",
)


def resolve_plugin_dtype(value: str | None, model_dtype: str) -> str | None:
    """A recipe plugin setting -> the PluginConfig value.

    ``"auto"`` = the model dtype (line 76 documents this for gpt_attention_plugin; llmc resolves
    gemm_plugin the same way so the written build_config.json is explicit). ``"disable"``/None -> None
    (plugin off). Any other value is passed through (a dtype name).
    """
    if value is None or value == "disable":
        return None
    if value == "auto":
        return model_dtype
    return value


def use_fused_mlp_allowed(quant_algo: str | None) -> bool:
    """False for W4A16_AWQ: llmc's own conservative choice.

    trtllm-build does NOT force it off: its ``main`` sets ``kwargs['use_fused_mlp'] = False`` for quantized
    checkpoints, but ``build_model`` never reads that kwarg; the engine follows
    ``plugin_config.use_fused_mlp`` (``optimize_model_with_config``; docs/TENSORRT_LLM.md names the commits).
    Whether the fused gate-up GEMM takes the groupwise int4 weights of W4A16_AWQ is unverified here, so llmc
    keeps the unfused MLP for AWQ and writes False, so build_config.json shows what is actually built.
    """
    return quant_algo != W4A16_AWQ  # line 30: quant_algo of the AWQ int4 weight-only checkpoint


def build_config_dict(recipe: Recipe, checkpoint_config: dict) -> dict:
    """The BuildConfig (with its nested PluginConfig) for ``recipe`` over this checkpoint IR.

    ``checkpoint_config`` is the IR's config.json (its ``dtype`` and ``quantization`` decide the
    plugin dtypes and use_fused_mlp). Returns exactly :data:`BUILD_CONFIG_KEYS` with a
    ``plugin_config`` of exactly :data:`PLUGIN_CONFIG_KEYS`; JSON-able.
    """
    dtype = checkpoint_config["dtype"]
    quant = checkpoint_config.get("quantization") or {}
    trt = recipe.tensorrt_llm
    plugin = {
        "gpt_attention_plugin": resolve_plugin_dtype(trt.gpt_attention_plugin, dtype),
        "gemm_plugin": resolve_plugin_dtype(trt.gemm_plugin, dtype),
        "context_fmha": bool(trt.context_fmha),
        "use_paged_context_fmha": bool(trt.use_paged_context_fmha),
        "remove_input_padding": bool(trt.remove_input_padding),
        "tokens_per_block": int(recipe.kv_cache.tokens_per_block),
        "use_fused_mlp": bool(trt.use_fused_mlp) and use_fused_mlp_allowed(quant.get("quant_algo")),
        "multiple_profiles": bool(trt.multiple_profiles),
    }
    limits = recipe.engine
    return {
        "max_batch_size": int(limits.max_batch_size),
        "max_input_len": int(limits.max_input_len),
        "max_seq_len": int(limits.max_seq_len),
        "max_num_tokens": int(limits.max_num_tokens),
        "max_beam_width": MAX_BEAM_WIDTH,
        # line 74: paged | continuous | disabled; llmc never disables the KV cache
        "kv_cache_type": "paged" if recipe.kv_cache.paged else "continuous",
        "plugin_config": plugin,
    }


def kv_cache_quantization(quant_block: dict | None, kv_dtype: str) -> dict | None:
    """The IR ``quantization`` block updated for the recipe's KV-cache dtype (returns a new dict).

    ``kv_dtype == "fp8"`` -> ``kv_cache_quant_algo: "FP8"`` (line 32), added to the existing block
    (AWQ keeps its fields) or to a fresh ``{"quant_algo": None, ...}`` block for a 16-bit IR.
    Any other dtype returns the block unchanged (copied).
    """
    if kv_dtype != "fp8":
        return dict(quant_block) if quant_block is not None else None
    updated = dict(quant_block) if quant_block else {"quant_algo": None}
    updated["kv_cache_quant_algo"] = FP8_KV_ALGO
    return updated


def missing_kv_cache_scales(num_layers: int, tensor_names: set[str]) -> list[str]:
    """Names of the per-layer FP8 KV scales (line 32) that ``tensor_names`` lacks."""
    return kv_scales.missing(num_layers, tensor_names)


def require_kv_cache_scales(num_layers: int, rank_tensor_names: list[set[str]]) -> None:
    """Raise :class:`CheckpointError` unless every rank has all per-layer FP8 KV scales.

    ``llmc build`` calibrates them (:mod:`llmc.builder.kv_scales`); a checkpoint from elsewhere must bring its
    own, since a scale of 1.0 is only right when the K/V activations already fit FP8's range. A missing tensor is
    also a hard error in TensorRT-LLM's own build (line 61).
    """
    for rank, names in enumerate(rank_tensor_names):
        missing = missing_kv_cache_scales(num_layers, names)
        if missing:
            raise CheckpointError(
                f"kv_cache.dtype fp8 needs a per-layer fp32 {KV_SCALE_SUFFIX} tensor of shape [1] in "
                f"every rank of the checkpoint; rank {rank} lacks {len(missing)} (first: {missing[0]}). "
                "Fix: rebuild with `llmc build --force` (llmc calibrates them), set kv_cache.dtype to auto "
                "(16-bit KV cache), or provide a checkpoint whose KV scales were calibrated (e.g. by NVIDIA's "
                "ModelOpt quantization)"
            )


def _flag(value: bool) -> str:
    return "enable" if value else "disable"


def trtllm_build_command(checkpoint_dir: str | Path, engine_dir: str | Path, build_config: dict) -> list[str]:
    """The ``trtllm-build`` command line equivalent to ``build_config`` (argv list, no shell).

    Uses only trtllm-build 1.x flags named after the BuildConfig/PluginConfig fields (lines 70-78);
    a plugin set to None is written as ``disable``.
    """
    plugin = build_config["plugin_config"]
    argv = ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir)]
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width"):
        argv += [f"--{key}", str(build_config[key])]
    argv += ["--kv_cache_type", build_config["kv_cache_type"]]
    for key in ("gpt_attention_plugin", "gemm_plugin"):
        argv += [f"--{key}", plugin[key] if plugin[key] is not None else "disable"]
    for key in ("context_fmha", "use_paged_context_fmha", "remove_input_padding"):
        argv += [f"--{key}", _flag(plugin[key])]
    argv += ["--tokens_per_block", str(plugin["tokens_per_block"])]
    for key in ("use_fused_mlp", "multiple_profiles"):
        argv += [f"--{key}", _flag(plugin[key])]
    return argv


def trtllm_build_file_command(checkpoint_dir: str | Path, engine_dir: str | Path,
                              build_config_file: str | Path) -> list[str]:
    """The robust alternative: ``trtllm-build ... --build_config build_config.json`` (line 71)."""
    return ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir),
            "--build_config", str(build_config_file)]


def build_script(checkpoint_dir: Path, engine_dir: Path, build_config: dict) -> str:
    """The text of ``trtllm-build.sh``: rebuild the engines by hand, run from anywhere.

    Paths are relative to the script's folder (the engine folder), because the build folder is
    renamed after the build (docs/ARCHITECTURE.md).
    """
    ckpt = os.path.relpath(checkpoint_dir, engine_dir)
    argv = [shlex.quote(a) for a in trtllm_build_command(ckpt, ".", build_config)]
    lines = [argv[0]] + [f"{flag} {value}" for flag, value in zip(argv[1::2], argv[2::2])]  # one flag per line
    flags = " \\\n    ".join(lines)
    alt = " ".join(shlex.quote(a) for a in trtllm_build_file_command(ckpt, ".", "build_config.json"))
    return (
        "#!/usr/bin/env bash\n"
        "# Written by `llmc build`: the trtllm-build command equivalent to this engine's build.\n"
        "# Needs TensorRT-LLM 1.0 - 1.2 (see docs/TENSORRT_LLM.md). Equivalent alternative:\n"
        f"#   {alt}\n"
        "set -euo pipefail\n"
        'cd "$(dirname "$0")"\n'
        f"{flags}\n"
    )

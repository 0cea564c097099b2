"""Export a model source to the TensorRT-LLM checkpoint IR (``build/<name>/checkpoint/``).

``export_checkpoint`` writes the 16-bit IR (recipe ``quantization.method: none``); the quantizer calls
``write_w4a16_checkpoint`` with its int4 results. Both shard for ``recipe.engine.tp_size`` and return a
small report dict for the manifest / build report.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from llmc.checkpoint.config import W4A16_AWQ, trtllm_config_from_hf, with_tp_size
from llmc.checkpoint.convert import QuantizedLinear, hf_to_trtllm, pad_for_groupwise, shard
from llmc.checkpoint.io import write_checkpoint
from llmc.errors import BuildError
from llmc.recipe import Recipe
from llmc.source.load import SourceModel, load_state_dict


def kv_cache_quant_algo(kv_cache_dtype: str) -> str | None:
    """The IR's kv_cache_quant_algo for a recipe ``kv_cache.dtype`` ("fp8" -> "FP8", else None)."""
    return "FP8" if kv_cache_dtype == "fp8" else None


def export_checkpoint(source: SourceModel, recipe: Recipe, checkpoint_dir: str | Path) -> dict[str, Any]:
    """Write the 16-bit IR of ``source`` (a SourceModel) for ``recipe`` into ``checkpoint_dir``.

    Returns {"tensors", "bytes", "seconds", "tp_size", "dtype"}. BuildError if the recipe asks for int4
    (that goes through ``llmc.builder.quantize.quantize_checkpoint``).
    """
    if recipe.quantization.method != "none":
        raise BuildError(
            f"export_checkpoint writes 16-bit checkpoints, but quantization.method is "
            f"{recipe.quantization.method!r}; use llmc.builder.quantize.quantize_checkpoint for awq/rtn"
        )
    start = time.perf_counter()
    quantization = {"quant_algo": None, "kv_cache_quant_algo": kv_cache_quant_algo(recipe.kv_cache.dtype)}
    config = trtllm_config_from_hf(source.hf_config, recipe.model.dtype, recipe.engine.tp_size, quantization)
    weights = hf_to_trtllm(load_state_dict(source.hf_dir), config)
    ranks = [shard(weights, config, r) for r in range(recipe.engine.tp_size)]
    write_checkpoint(checkpoint_dir, config, ranks)
    return _report(ranks, config, start, padding={})


def write_w4a16_checkpoint(
    hf_config: dict[str, Any],
    dtype: str,
    plain_weights: Mapping[str, torch.Tensor],
    quantized: Mapping[str, QuantizedLinear],
    group_size: int,
    tp_size: int,
    out_dir: str | Path,
    kv_cache_quant_algo: str | None = None,
) -> dict[str, Any]:
    """Write a W4A16_AWQ IR: 16-bit embedding/norms/lm_head plus packed int4 decoder linears.

    ``plain_weights`` is a HF-named state dict (its linear weights, if present, are ignored);
    ``quantized`` maps each HF linear module path (``model.layers.N.mlp.up_proj``) to
    (q int8 [O, K] in [-8, 7], scales [O, K/g], prequant [K]). The intermediate size is padded for
    TensorRT-LLM's groupwise kernels when needed (recorded in the report's ``padding``).
    Returns {"tensors", "bytes", "seconds", "tp_size", "dtype", "padding"}.
    """
    start = time.perf_counter()
    quantization = {"quant_algo": W4A16_AWQ, "group_size": group_size, "kv_cache_quant_algo": kv_cache_quant_algo}
    config = trtllm_config_from_hf(hf_config, dtype, 1, quantization)
    weights = hf_to_trtllm(plain_weights, config, quantized)
    weights, config, padding = pad_for_groupwise(weights, config, tp_size, group_size)
    config = with_tp_size(config, tp_size)
    ranks = [shard(weights, config, r) for r in range(tp_size)]
    write_checkpoint(out_dir, config, ranks)
    return _report(ranks, config, start, padding)


def _report(ranks: list[dict[str, torch.Tensor]], config: dict[str, Any], start: float, padding: dict) -> dict:
    return {
        "tensors": sum(len(r) for r in ranks),
        "bytes": sum(t.numel() * t.element_size() for r in ranks for t in r.values()),
        "seconds": round(time.perf_counter() - start, 3),
        "tp_size": config["mapping"]["tp_size"],
        "dtype": config["dtype"],
        "padding": padding,
    }

"""The FP8 KV cache's scales in the IR: ``kv_cache_quant_algo: "FP8"`` in config.json's ``quantization`` block and,
in every rank, a float32 ``transformer.layers.N.attention.kv_cache_scaling_factor`` of shape [1] per layer
(../shared/reference/tensorrt-llm.md line 32; TensorRT-LLM's ``kv_cache_scaling_factor``: one scale for a layer's
keys and values). The cache holds ``x / scale`` as float8 e4m3; ``llmc build`` sets the scale to the largest
magnitude of the layer's keys and values over its calibration text, divided by 448 (:mod:`llmc.builder.kv_scales`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from llmc.checkpoint import names
from llmc.checkpoint.config import KV_FP8
from llmc.errors import CheckpointError

MODULE = "attention"


def scale_name(layer: int) -> str:
    """The IR name of decoder layer ``layer``'s KV-cache scale."""
    return names.trt_layer(layer, MODULE, names.KV_CACHE_SCALING_FACTOR)


def is_scale(name: str) -> bool:
    """Whether the IR tensor ``name`` is a layer's KV-cache scale."""
    return name.endswith(f".{MODULE}.{names.KV_CACHE_SCALING_FACTOR}")


def fp8_kv(config: Mapping) -> bool:
    """Whether the IR config asks for an FP8 KV cache."""
    return (config.get("quantization") or {}).get("kv_cache_quant_algo") == KV_FP8


def missing(num_layers: int, tensor_names: set[str]) -> list[str]:
    """The layers' scale names that ``tensor_names`` lacks."""
    return [scale_name(n) for n in range(num_layers) if scale_name(n) not in tensor_names]


def read(config: Mapping, rank0: Mapping[str, torch.Tensor], num_layers: int) -> list[float] | None:
    """Each layer's KV-cache scale from rank 0's tensors, or None where the config asks for no FP8 KV cache.
    CheckpointError for a missing scale or one that is not a positive finite number."""
    if not fp8_kv(config):
        return None
    absent = missing(num_layers, set(rank0))
    if absent:
        raise CheckpointError(
            f"the checkpoint's config asks for an FP8 KV cache but lacks {len(absent)} of its per-layer "
            f"{names.KV_CACHE_SCALING_FACTOR} tensors (first: {absent[0]}). Fix: rebuild it with `llmc build --force` "
            f"(llmc calibrates them), or set kv_cache.dtype to auto"
        )
    scales = [float(rank0[scale_name(n)].float().reshape(-1)[0]) for n in range(num_layers)]
    bad = [(n, s) for n, s in enumerate(scales) if not (s > 0 and s < float("inf"))]
    if bad:
        raise CheckpointError(f"layer {bad[0][0]}'s {names.KV_CACHE_SCALING_FACTOR} is {bad[0][1]}, not a positive "
                              f"finite number. Fix: rebuild the checkpoint with `llmc build --force`")
    return scales


def tensors(scales: list[float]) -> dict[str, torch.Tensor]:
    """The IR tensors of ``scales`` (one per layer)."""
    return {scale_name(n): torch.tensor([s], dtype=torch.float32) for n, s in enumerate(scales)}

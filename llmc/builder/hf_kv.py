"""An fp8 KV cache inside transformers' models: an attention function that emulates it (keys and values stored
and read back as the engines do) or tracks each layer's largest key and value magnitudes. Used by the FP8
KV-cache calibration (:mod:`llmc.builder.kv_scales`) and the accuracy gate (:mod:`llmc.builder.verify`)."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from llmc.engine.torch.kv_store import FP8, from_cache, to_cache

ATTENTION = "llmc_kv"  # the transformers attention function's name


@dataclass
class LayerState:
    """What the attention function does in one layer: track key / value magnitudes, emulate an fp8 cache."""

    amax: torch.Tensor | None = None  # [2]: largest |key|, |value| seen (observing) or None
    scale: float | None = None  # emulate an fp8 cache of this scale, or None


def fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as the engine's fp8 cache stores and returns it (:mod:`llmc.engine.torch.kv_store`)."""
    return from_cache(to_cache(x, FP8, scale), x.dtype, scale)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state: LayerState | None = getattr(module, "llmc_kv", None)
    if state is not None and state.amax is not None:
        seen = torch.stack([key.detach().abs().amax().float(), value.detach().abs().amax().float()]).cpu()
        state.amax = torch.maximum(state.amax, seen)
    if state is not None and state.scale is not None:
        key, value = fp8_round_trip(key, state.scale), fp8_round_trip(value, state.scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@functools.cache
def register() -> str:
    """Register the attention function with transformers (SDPA's masks); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


def install(model: torch.nn.Module) -> None:
    """Make ``model`` attend through the attention function (once: later calls only check)."""
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(register())


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers' attention modules of a transformers causal LM, in order."""
    return [layer.self_attn for layer in model.model.layers]


def use_fp8_cache(model: torch.nn.Module, scales: list[float] | None) -> None:
    """From now on ``model`` computes as with an fp8 cache of ``scales`` (one per layer), or a 16-bit one (None)."""
    install(model)
    for n, attention in enumerate(attention_layers(model)):
        attention.llmc_kv = LayerState(scale=None if scales is None else scales[n])


@contextmanager
def observing(model: torch.nn.Module) -> Iterator[list[LayerState]]:
    """Track each layer's largest key and value magnitudes while inside (16-bit cache)."""
    install(model)
    states = [LayerState(amax=torch.zeros(2)) for _ in attention_layers(model)]
    for attention, state in zip(attention_layers(model), states):
        attention.llmc_kv = state
    try:
        yield states
    finally:
        for attention in attention_layers(model):
            attention.llmc_kv = None

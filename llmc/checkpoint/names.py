"""The one place that knows Hugging Face <-> TensorRT-LLM tensor names for Llama-family models.

TensorRT-LLM checkpoint names (per rank, see shared/reference/tensorrt-llm.md):

    transformer.vocab_embedding.weight                 <- model.embed_tokens.weight
    transformer.layers.N.input_layernorm.weight        <- model.layers.N.input_layernorm.weight
    transformer.layers.N.attention.qkv.weight          <- q_proj, k_proj, v_proj rows stacked in that order
    transformer.layers.N.attention.dense.weight        <- self_attn.o_proj
    transformer.layers.N.post_layernorm.weight         <- model.layers.N.post_attention_layernorm.weight
    transformer.layers.N.mlp.fc.weight                 <- mlp.gate_proj (the branch that goes through SiLU)
    transformer.layers.N.mlp.gate.weight               <- mlp.up_proj
    transformer.layers.N.mlp.proj.weight               <- mlp.down_proj
    transformer.layers.N.attention.q_layernorm.weight  <- self_attn.q_norm (Qwen3: RMSNorm of each query head)
    transformer.layers.N.attention.k_layernorm.weight  <- self_attn.k_norm (Qwen3: RMSNorm of each key head)
    transformer.ln_f.weight                            <- model.norm.weight
    lm_head.weight                                     <- lm_head.weight (the embedding when tied)

Linear modules are column-parallel (qkv, fc, gate: the output dim is split) or row-parallel (dense, proj: the
input dim is split). The same five are the quantizable ones; lm_head stays 16-bit (``exclude_modules``).
Biases (``.bias``, 16-bit beside a W4A16 triple) follow ``ModelShape.has_bias``: Qwen2's q, k and v.
Qwen2 and Qwen3 use these names too (TensorRT-LLM's ``tensorrt_llm/models/qwen/convert.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Parallel = Literal["column", "row"]

VOCAB_EMBEDDING = "transformer.vocab_embedding.weight"
LN_F = "transformer.ln_f.weight"
LM_HEAD = "lm_head.weight"

HF_EMBED = "model.embed_tokens.weight"
HF_NORM = "model.norm.weight"
HF_LM_HEAD = "lm_head.weight"

# Suffixes of a W4A16_AWQ linear (``.weight`` is then the packed int8 tensor).
WEIGHT = "weight"
BIAS = "bias"
WEIGHTS_SCALING_FACTOR = "weights_scaling_factor"
PREQUANT_SCALING_FACTOR = "prequant_scaling_factor"
KV_CACHE_SCALING_FACTOR = "kv_cache_scaling_factor"


@dataclass(frozen=True)
class LinearSpec:
    """One TensorRT-LLM linear module of a decoder layer and the HF modules it is built from."""

    trt: str  # module path inside ``transformer.layers.N``, e.g. "attention.qkv"
    hf: tuple[str, ...]  # module paths inside ``model.layers.N``, stacked along the output dim in this order
    parallel: Parallel


QKV = LinearSpec("attention.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "column")
DENSE = LinearSpec("attention.dense", ("self_attn.o_proj",), "row")
FC = LinearSpec("mlp.fc", ("mlp.gate_proj",), "column")
GATE = LinearSpec("mlp.gate", ("mlp.up_proj",), "column")
PROJ = LinearSpec("mlp.proj", ("mlp.down_proj",), "row")

LINEARS: tuple[LinearSpec, ...] = (QKV, DENSE, FC, GATE, PROJ)
QUANTIZABLE: tuple[str, ...] = tuple(spec.trt for spec in LINEARS)
LINEAR_BY_TRT: dict[str, LinearSpec] = {spec.trt: spec for spec in LINEARS}

# TensorRT-LLM norm module -> HF norm module, inside a decoder layer.
LAYER_NORMS: dict[str, str] = {
    "input_layernorm": "input_layernorm",
    "post_layernorm": "post_attention_layernorm",
}

# Qwen3's per-head norms (``[head_size]``, every rank holds them whole): TensorRT-LLM module -> HF module.
QK_NORMS: dict[str, str] = {
    "attention.q_layernorm": "self_attn.q_norm",
    "attention.k_layernorm": "self_attn.k_norm",
}

# HF tensors that carry no weights of their own (recomputed buffers) and are ignored on conversion.
HF_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$|^model\.rotary_emb\.inv_freq$")

_TRT_LAYER = re.compile(r"^transformer\.layers\.(\d+)\.(.+)\.([a-z_]+)$")


def trt_layer(layer: int, module: str, suffix: str = WEIGHT) -> str:
    """TensorRT-LLM name of ``suffix`` of ``module`` in decoder layer ``layer``."""
    return f"transformer.layers.{layer}.{module}.{suffix}"


def hf_layer(layer: int, module: str, suffix: str = WEIGHT) -> str:
    """Hugging Face name of ``suffix`` of ``module`` in decoder layer ``layer``."""
    return f"model.layers.{layer}.{module}.{suffix}"


def hf_module(layer: int, module: str) -> str:
    """Hugging Face module path (no suffix), the key of quantized-layer dicts: ``model.layers.3.mlp.up_proj``."""
    return f"model.layers.{layer}.{module}"


def parse_trt_layer_name(name: str) -> tuple[int, str, str] | None:
    """Split ``transformer.layers.N.<module>.<suffix>`` into (N, module, suffix); None for non-layer names."""
    match = _TRT_LAYER.match(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2), match.group(3)


def linear_of(name: str) -> LinearSpec | None:
    """The linear module a TensorRT-LLM tensor name belongs to, or None (norms, embedding, lm_head)."""
    parsed = parse_trt_layer_name(name)
    if parsed is None:
        return None
    return LINEAR_BY_TRT.get(parsed[1])

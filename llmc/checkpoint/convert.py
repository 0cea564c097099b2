"""Hugging Face Llama state dict <-> TensorRT-LLM checkpoint tensors, and tensor-parallel sharding.

``hf_to_trtllm`` gives the unsharded IR tensors (plain 16-bit, or W4A16_AWQ when the config says so);
``shard`` cuts them for one rank; ``merge_shards`` is its exact inverse (duplicated kv heads are checked
equal and kept once). ``pad_for_groupwise`` pads the intermediate size for TensorRT-LLM's groupwise kernels.
The way back: ``dequantized_weights`` (every rank dequantized, then merged) and ``trtllm_to_hf`` (IR names and
fused layouts -> HF names), which the engine's loader and the accuracy gate share.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from llmc.checkpoint import kv_scales, names
from llmc.checkpoint.config import ModelShape
from llmc.checkpoint.int4 import dequantize_rank, pack_int4
from llmc.errors import CheckpointError, SourceError

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# A quantized HF linear as handed over by the quantizer: (q int8 [O, K], scales [O, K/g], prequant [K]).
QuantizedLinear = Sequence[torch.Tensor]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an IR dtype name ("float16" | "bfloat16" | "float32")."""
    return TORCH_DTYPES[name]


def hf_to_trtllm(
    state_dict: Mapping[str, torch.Tensor],
    config: dict[str, Any],
    quantized: Mapping[str, QuantizedLinear] | None = None,
) -> dict[str, torch.Tensor]:
    """Unsharded IR tensors from a HF Llama state dict, cast to the config's dtype.

    For a W4A16_AWQ config, ``quantized`` maps every HF linear module path (``model.layers.N.self_attn.q_proj``)
    to its (q, scales, prequant); q/k/v are stacked into qkv (their prequant must be equal: they share an
    input). ``lm_head.weight`` is always written; for tied models it is the embedding (same tensor).
    Raises SourceError for a missing HF tensor, CheckpointError for inconsistent quantized inputs.
    """
    shape = ModelShape.from_config(config)
    dtype = torch_dtype(shape.dtype)
    quantized = dict(quantized or {})
    if quantized and not shape.is_w4a16:
        raise CheckpointError("quantized layers were given but the config's quant_algo is not W4A16_AWQ")
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in state_dict:
            raise SourceError(f"the model's weights have no tensor {name!r}; the checkpoint is incomplete")
        used.add(name)
        return _cast(state_dict[name], dtype)

    out = {names.VOCAB_EMBEDDING: take(names.HF_EMBED), names.LN_F: take(names.HF_NORM)}
    if names.HF_LM_HEAD in state_dict or not shape.tie_word_embeddings:
        out[names.LM_HEAD] = take(names.HF_LM_HEAD)
    else:
        out[names.LM_HEAD] = out[names.VOCAB_EMBEDDING]
    for layer in range(shape.num_layers):
        for trt_norm, hf_norm in names.LAYER_NORMS.items():
            out[names.trt_layer(layer, trt_norm)] = take(names.hf_layer(layer, hf_norm))
        for spec in names.LINEARS:
            out.update(_convert_linear(shape, layer, spec, take, quantized, used))
        for trt_norm, hf_norm in names.QK_NORMS.items() if shape.qk_norm else ():
            out[names.trt_layer(layer, trt_norm)] = take(names.hf_layer(layer, hf_norm))
        if shape.kv_cache_quant_algo == "FP8":
            # A placeholder: llmc build's fp8 KV-cache step writes the calibrated scales (builder/kv_scales.py).
            out[kv_scales.scale_name(layer)] = torch.ones(1)
    unused = [k for k in state_dict if k not in used and not names.HF_IGNORED.match(k)]
    if unused:
        log.warning("ignored %d HF tensors not used by the Llama IR: %s", len(unused), ", ".join(unused[:8]))
    return out


def trtllm_to_hf(weights: Mapping[str, torch.Tensor], hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_trtllm` for unsharded float IR tensors: a HF Llama state dict.

    qkv is split back into q, k and v rows; the groupwise kernels' row padding of fc / gate and column padding of
    proj is cut to ``hf_config``'s ``intermediate_size``; a tied model gets no ``lm_head.weight``.
    """
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    inter = hf_config["intermediate_size"]
    out = {names.HF_EMBED: weights[names.VOCAB_EMBEDDING], names.HF_NORM: weights[names.LN_F]}
    if not hf_config.get("tie_word_embeddings", False):
        out[names.HF_LM_HEAD] = weights[names.LM_HEAD]
    rows = {"self_attn.q_proj": heads * head_dim, "self_attn.k_proj": kv_heads * head_dim,
            "self_attn.v_proj": kv_heads * head_dim, "mlp.gate_proj": inter, "mlp.up_proj": inter}
    for layer in range(hf_config["num_hidden_layers"]):
        for trt_norm, hf_norm in (*names.LAYER_NORMS.items(), *names.QK_NORMS.items()):
            if names.trt_layer(layer, trt_norm) in weights:  # the q / k norms: Qwen3 only
                out[names.hf_layer(layer, hf_norm)] = weights[names.trt_layer(layer, trt_norm)]
        for spec in names.LINEARS:
            for suffix in (names.WEIGHT, names.BIAS):
                if suffix == names.WEIGHT or names.trt_layer(layer, spec.trt, suffix) in weights:
                    out.update(_linear_to_hf(weights[names.trt_layer(layer, spec.trt, suffix)], layer, spec,
                                             suffix, rows, inter))
    return out


def _linear_to_hf(t: torch.Tensor, layer: int, spec: names.LinearSpec, suffix: str, rows: dict[str, int],
                  inter: int) -> dict[str, torch.Tensor]:
    """The HF tensors of one IR linear's weight ``[O (padded), K (padded)]`` or bias ``[O]``."""
    if spec is names.PROJ and suffix == names.WEIGHT:
        t = t[:, :inter]
    if len(spec.hf) > 1:  # qkv: q, k, v rows stacked in that order
        parts = torch.split(t, [rows[m] for m in spec.hf], dim=0)
    else:  # fc / gate rows may be padded for the groupwise kernels; dense / proj have no row padding
        parts = (t[: rows.get(spec.hf[0], t.shape[0])],)
    return {names.hf_layer(layer, module, suffix): part.contiguous() for module, part in zip(spec.hf, parts)}


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.dtype.is_floating_point else t


def _convert_linear(
    shape: ModelShape,
    layer: int,
    spec: names.LinearSpec,
    take: Callable[[str], torch.Tensor],
    quantized: Mapping[str, QuantizedLinear],
    used: set[str],
) -> dict[str, torch.Tensor]:
    """IR tensors of one decoder linear (weight or W4A16 triple, plus bias when the config has one)."""
    out_f, in_f = shape.linear_dims(spec.trt)
    prefix = f"transformer.layers.{layer}.{spec.trt}"
    dtype = torch_dtype(shape.dtype)
    result: dict[str, torch.Tensor] = {}
    if shape.is_w4a16:
        q, scales, prequant = _stack_quantized(layer, spec, quantized)
        used.update(names.hf_layer(layer, m) for m in spec.hf)
        expected = {"q": (out_f, in_f), "scales": (out_f, in_f // shape.group_size), "prequant": (in_f,)}
        for label, tensor in (("q", q), ("scales", scales), ("prequant", prequant)):
            if tuple(tensor.shape) != expected[label]:
                raise CheckpointError(
                    f"quantized {prefix} {label} has shape {tuple(tensor.shape)}, expected {expected[label]}"
                )
        result[f"{prefix}.weight"] = pack_int4(q)  # [O/2, K] int8
        result[f"{prefix}.{names.WEIGHTS_SCALING_FACTOR}"] = scales.to(dtype).contiguous()
        result[f"{prefix}.{names.PREQUANT_SCALING_FACTOR}"] = prequant.to(dtype).contiguous()
    else:
        weight = torch.cat([take(names.hf_layer(layer, m)) for m in spec.hf], dim=0)  # [O, K]
        if tuple(weight.shape) != (out_f, in_f):
            raise SourceError(
                f"{prefix} built from {spec.hf} has shape {tuple(weight.shape)}, expected {(out_f, in_f)}"
            )
        result[f"{prefix}.weight"] = weight
    if shape.has_bias(spec.trt):
        result[f"{prefix}.bias"] = torch.cat([take(names.hf_layer(layer, m, "bias")) for m in spec.hf], dim=0)
    return result


def _stack_quantized(
    layer: int, spec: names.LinearSpec, quantized: Mapping[str, QuantizedLinear]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [O, K], scales [O, K/g], prequant [K]) of a module, stacking q/k/v along O."""
    parts = []
    for module in spec.hf:
        key = names.hf_module(layer, module)
        if key not in quantized:
            raise CheckpointError(f"W4A16_AWQ checkpoint: no quantized tensors for {key!r}; quantize every linear")
        parts.append(tuple(quantized[key]))
    prequant = parts[0][2]
    if any(not torch.equal(p[2], prequant) for p in parts[1:]):
        raise CheckpointError(
            f"layer {layer}: {', '.join(spec.hf)} have different prequant scales but share one input; "
            "smooth them with one scale (AWQ balances q/k/v together)"
        )
    q = torch.cat([p[0] for p in parts], dim=0)
    scales = torch.cat([p[1] for p in parts], dim=0)
    return q, scales, prequant


def _feature_slices(shape: ModelShape, spec: names.LinearSpec, rank: int) -> list[tuple[int, int]]:
    """Index ranges of the split dim (out features for column-, in features for row-parallel) for ``rank``."""
    tp = shape.tp_size
    if spec is names.QKV:
        hd, nh, nkv = shape.head_size, shape.num_heads, shape.num_kv_heads
        q0 = rank * shape.heads_per_rank * hd
        # kv heads are split when nkv >= tp, otherwise each group of tp/nkv ranks shares (duplicates) one.
        kv_head = rank * nkv // tp if nkv >= tp else rank // (tp // nkv)
        k0 = nh * hd + kv_head * hd
        v0 = (nh + nkv) * hd + kv_head * hd
        kv_len = shape.kv_heads_per_rank * hd
        return [(q0, q0 + shape.heads_per_rank * hd), (k0, k0 + kv_len), (v0, v0 + kv_len)]
    out_f, in_f = shape.linear_dims(spec.trt)
    total = out_f if spec.parallel == "column" else in_f
    chunk = total // tp
    return [(rank * chunk, (rank + 1) * chunk)]


def _split_plan(shape: ModelShape, name: str) -> tuple[names.LinearSpec, int, int] | None:
    """(linear, axis, unit) for a tensor split by tp, None if replicated. ``unit`` = features per index."""
    spec = names.linear_of(name)
    if spec is None:
        return None
    suffix = name.rsplit(".", 1)[1]
    if spec.parallel == "column":
        if suffix == names.PREQUANT_SCALING_FACTOR:
            return None
        packed = suffix == names.WEIGHT and shape.is_w4a16
        return spec, 0, 2 if packed else 1
    if suffix == names.BIAS:
        return None  # row-parallel bias is added once, after the all-reduce: every rank holds it whole
    if suffix == names.WEIGHTS_SCALING_FACTOR:
        return spec, 1, shape.group_size
    return spec, (0 if suffix == names.PREQUANT_SCALING_FACTOR else 1), 1


def shard(weights: Mapping[str, torch.Tensor], config: dict[str, Any], rank: int) -> dict[str, torch.Tensor]:
    """The tensors of one tensor-parallel ``rank`` (0 <= rank < tp_size) from unsharded IR tensors."""
    shape = ModelShape.from_config(config)
    if not 0 <= rank < shape.tp_size:
        raise CheckpointError(f"rank {rank} is outside 0..{shape.tp_size - 1} for tp_size {shape.tp_size}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name == names.LM_HEAD:
            padded = _pad_rows(tensor, shape.padded_vocab_size)  # [V_pad, H]
            rows = shape.padded_vocab_size // shape.tp_size
            out[name] = padded[rank * rows : (rank + 1) * rows].contiguous()
            continue
        plan = _split_plan(shape, name)
        if plan is None or shape.tp_size == 1:
            out[name] = tensor
            continue
        spec, axis, unit = plan
        pieces = [tensor.narrow(axis, s // unit, (e - s) // unit) for s, e in _unit_slices(shape, spec, rank, unit)]
        out[name] = torch.cat(pieces, dim=axis).contiguous()
    return out


def _unit_slices(shape: ModelShape, spec: names.LinearSpec, rank: int, unit: int) -> list[tuple[int, int]]:
    slices = _feature_slices(shape, spec, rank)
    for s, e in slices:
        if s % unit or e % unit:
            raise CheckpointError(
                f"{spec.trt}: the rank-{rank} slice [{s}, {e}) does not fall on a boundary of {unit} "
                "(packed row pair or quantization group); choose a tp_size / group_size that aligns"
            )
    return slices


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=0)


def merge_shards(shards: Sequence[Mapping[str, torch.Tensor]], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard`: unsharded IR tensors from all ranks' tensors (in rank order).

    Duplicated kv heads must be equal across the ranks that share them (CheckpointError otherwise).
    """
    shape = ModelShape.from_config(config)
    if len(shards) != shape.tp_size:
        raise CheckpointError(f"merge_shards got {len(shards)} shards for tp_size {shape.tp_size}")
    out: dict[str, torch.Tensor] = {}
    for name, first in shards[0].items():
        if name == names.LM_HEAD:
            out[name] = torch.cat([s[name] for s in shards], dim=0)[: shape.vocab_size]
            continue
        plan = _split_plan(shape, name)
        if plan is None or shape.tp_size == 1:
            out[name] = first
            continue
        out[name] = _merge_split(shape, name, [s[name] for s in shards], *plan)
    return out


def dequantized_weights(config: dict[str, Any], rank_weights: Sequence[Mapping[str, torch.Tensor]],
                        dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The IR's unsharded float tensors: each rank's W4A16_AWQ linears dequantized to ``dtype`` first
    (:func:`~llmc.checkpoint.int4.dequantize_rank`), then the tensor-parallel shards merged as plain tensors."""
    shape = ModelShape.from_config(config)
    if shape.is_w4a16:
        rank_weights = [dequantize_rank(w, int(shape.group_size or 0), dtype) for w in rank_weights]
    if len(rank_weights) == 1:
        return dict(rank_weights[0])
    plain = {**config, "quantization": {"quant_algo": None, "kv_cache_quant_algo": None}}
    return merge_shards(rank_weights, plain)


def _merge_split(
    shape: ModelShape, name: str, parts: list[torch.Tensor], spec: names.LinearSpec, axis: int, unit: int
) -> torch.Tensor:
    """One unsharded tensor from its per-rank parts, placing each rank's slices back where they came from."""
    out_f, in_f = shape.linear_dims(spec.trt)
    total = (out_f if spec.parallel == "column" else in_f) // unit
    size = list(parts[0].shape)
    size[axis] = total
    full = torch.empty(size, dtype=parts[0].dtype, device=parts[0].device)
    filled = torch.zeros(total, dtype=torch.bool)
    for rank, part in enumerate(parts):
        offset = 0
        for s, e in _unit_slices(shape, spec, rank, unit):
            n = (e - s) // unit
            piece = part.narrow(axis, offset, n)
            target = full.narrow(axis, s // unit, n)
            if bool(filled[s // unit : s // unit + n].any()):
                if not torch.equal(target, piece):
                    raise CheckpointError(f"{name}: duplicated kv heads differ between ranks; the shards disagree")
            else:
                target.copy_(piece)
                filled[s // unit : s // unit + n] = True
            offset += n
    if not bool(filled.all()):
        raise CheckpointError(f"{name}: the shards do not cover the whole tensor; a rank is missing")
    return full


def pad_for_groupwise(
    weights: Mapping[str, torch.Tensor], config: dict[str, Any], tp: int, group_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Pad unsharded IR tensors so groupwise layers have features that are multiples of max(64, g) * tp.

    Only the intermediate size can be padded without changing the model: zero rows of fc/gate give
    silu(0) * 0 = 0 and the matching zero columns of proj add nothing (prequant 1, scales 1 there).
    Returns (weights, config with the padded intermediate_size, record); the record is {} when no padding
    was needed, else {"multiple", "intermediate_size": {"original", "padded"}} for the build report.
    Raises CheckpointError when hidden or attention features are not multiples (those cannot be padded).
    """
    shape = ModelShape.from_config(config)
    multiple = max(64, group_size) * tp
    for label, features in (("hidden_size", shape.hidden_size), ("attention features", shape.attn_in),
                            ("qkv output features", shape.qkv_out)):  # fmt: skip
        if features % multiple:
            raise CheckpointError(
                f"{label} {features} is not a multiple of max(64, group_size {group_size}) * tp {tp} = {multiple}, "
                "which TensorRT-LLM's groupwise int4 kernels need; use a smaller group_size or tp_size"
            )
    original = shape.intermediate_size
    padded = -(-original // multiple) * multiple
    if padded == original:
        return dict(weights), config, {}
    out = {name: _pad_intermediate(name, t, shape, padded, group_size) for name, t in weights.items()}
    new_config = copy.deepcopy(config)
    new_config["intermediate_size"] = padded
    record = {"multiple": multiple, "intermediate_size": {"original": original, "padded": padded}}
    return out, new_config, record


def _pad_intermediate(name: str, t: torch.Tensor, shape: ModelShape, padded: int, group_size: int) -> torch.Tensor:
    """One tensor with the intermediate dim grown to ``padded`` (unchanged if it has no such dim)."""
    spec = names.linear_of(name)
    if spec not in (names.FC, names.GATE, names.PROJ):
        return t
    suffix = name.rsplit(".", 1)[1]
    extra = padded - shape.intermediate_size
    packed = suffix == names.WEIGHT and shape.is_w4a16
    if spec is names.PROJ:  # row-parallel: the intermediate dim is the input (last) dim
        if suffix == names.BIAS:
            return t
        axis, amount = t.dim() - 1, extra // group_size if suffix == names.WEIGHTS_SCALING_FACTOR else extra
        fill = 1.0 if suffix in (names.PREQUANT_SCALING_FACTOR, names.WEIGHTS_SCALING_FACTOR) else 0.0
    else:  # fc / gate: the intermediate dim is the output (first) dim
        if suffix == names.PREQUANT_SCALING_FACTOR:
            return t
        axis, amount = 0, extra // 2 if packed else extra
        fill = 1.0 if suffix == names.WEIGHTS_SCALING_FACTOR else 0.0
    pad_shape = list(t.shape)
    pad_shape[axis] = amount
    pad = torch.full(pad_shape, fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=axis).contiguous()

"""Load a TensorRT-LLM checkpoint IR folder into the portable engine's :class:`LlamaForCausalLM`.

Steps: read config.json + every rank's safetensors, dequantize W4A16_AWQ linears per rank (on CPU, in
float32, cast once to the compute dtype), merge the tensor-parallel shards into full weights, check every
shape, then copy into a model allocated (uninitialized, on the meta device first) on the target device.

Compute dtype: the IR dtype on CUDA; float32 on CPU unless ``dtype`` is given, because float16/bfloat16
matmuls on CPU are several times slower than float32 and less accurate.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from llmc.checkpoint import names
from llmc.checkpoint.config import W4A16_AWQ
from llmc.checkpoint.convert import dequantized_weights, merge_shards, torch_dtype
from llmc.checkpoint.int4 import unpack_int4
from llmc.checkpoint.io import read_checkpoint
from llmc.checkpoint.kv_scales import is_scale as is_kv_scale
from llmc.checkpoint.kv_scales import read as read_kv_scales
from llmc.engine.torch import cpu_ext, host_embedding, triton_support
from llmc.engine.torch.model import LlamaForCausalLM, ModelConfig, state_dict_name
from llmc.engine.torch.prefill_cpu import MixedLinear, prefill_precision
from llmc.errors import CheckpointError

logger = logging.getLogger(__name__)

CUDA_KERNELS_ENV = "LLMC_CUDA_KERNELS"  # "0": dequantize int4 layers and skip the fused kernels on CUDA (A/B)


def compute_dtype(ir_dtype: str, device: torch.device | str, dtype: torch.dtype | str | None = None) -> torch.dtype:
    """The dtype the engine computes in: ``dtype`` if given, else the IR dtype on CUDA and float32 on CPU."""
    if dtype is not None:
        return torch_dtype(dtype) if isinstance(dtype, str) else dtype
    if torch.device(device).type == "cpu":
        return torch.float32
    return torch_dtype(ir_dtype)


def load_model(
    checkpoint_dir: str | Path, device: torch.device | str, dtype: torch.dtype | str | None = None,
    cpu_kernels: bool = False, cuda_kernels: bool = True, fold_prequant: bool = True, triton_on_cpu: bool = False,
) -> LlamaForCausalLM:
    """Build the model from the IR in ``checkpoint_dir`` on ``device`` (eval mode, no grad).

    ``cuda_kernels`` (default), on CUDA with Triton:

    - W4A16_AWQ linears stay packed int4 and run llmc's W4A16 kernels (:mod:`llmc.engine.torch.int4_cuda`):
      a quarter of the bf16 weight bytes on the device and per decode step. ``fold_prequant`` folds AWQ's input
      scales into the preceding norm weights where every reader of that norm shares them;
    - residual add + RMSNorm, RoPE + KV-cache write and SiLU x gate run as fused Triton kernels
      (:meth:`LlamaForCausalLM.use_cuda_fused`). ``LLMC_CUDA_KERNELS=0`` turns both off (A/B measurements).

    ``triton_on_cpu`` (tests): take that CUDA path on CPU tensors, through Triton's interpreter
    (``TRITON_INTERPRET=1``, set before Triton is first imported).

    ``cpu_kernels`` (the runner's default), on CPU:

    - keep W4A16_AWQ linears packed and multiply with an int4 kernel (:mod:`llmc.engine.torch.int4_cpu`)
      instead of dequantized float weights, where the op and shape allow (single-rank checkpoints); every other
      layer, and every other case, is dequantized as before;
    - with a 16-bit IR, multiply the logits layer (:meth:`LlamaForCausalLM.use_16bit_logits`) and, unquantized,
      every decoder linear (:class:`~llmc.engine.torch.dense16_cpu.Dense16Linear`) in decode steps with llmc's
      kernel over the exact 16-bit copy of the weight: half the bytes per token.

    An IR with an FP8 KV cache gives each layer's ``kv_cache_scaling_factor`` to its attention (``kv_scale``).

    Raises CheckpointError for a missing/unreadable folder, an unsupported config, a missing tensor or a
    shape that does not match the config (extra tensors are ignored with a warning, as TensorRT-LLM does).
    """
    raw_config, rank_weights = read_checkpoint(Path(checkpoint_dir))
    config = ModelConfig.from_checkpoint_config(raw_config)
    scales = read_kv_scales(raw_config, rank_weights[0], config.num_layers)  # None without an FP8 KV cache
    if scales is not None:
        rank_weights = [{k: v for k, v in rank.items() if not is_kv_scale(k)} for rank in rank_weights]
    model = _load(raw_config, rank_weights, config, device, dtype, cpu_kernels, cuda_kernels, fold_prequant,
                  triton_on_cpu)
    for layer, scale in zip(model.transformer.layers, scales or ()):
        layer.attention.kv_scale = scale  # used where the cache is fp8 (kv_alloc.runtime_kv_dtype)
    return model


def _load(raw_config: dict, rank_weights: list[dict[str, torch.Tensor]], config: ModelConfig,
          device: torch.device | str, dtype: torch.dtype | str | None, cpu_kernels: bool, cuda_kernels: bool,
          fold_prequant: bool, triton_on_cpu: bool) -> LlamaForCausalLM:
    raw_ranks, raw_checkpoint_rank0 = rank_weights, rank_weights[0]
    quant = raw_config.get("quantization") or {}
    if quant.get("quant_algo") not in (None, W4A16_AWQ):
        raise CheckpointError(
            f"quant_algo {quant.get('quant_algo')!r} is not supported by the torch engine; "
            f"Fix: build with quantization.method none, awq or rtn"
        )
    target_dtype = compute_dtype(config.dtype, device, dtype)
    on_cuda = (cuda_kernels and triton_support.modules() is not None and os.environ.get(CUDA_KERNELS_ENV, "1") != "0"
               and (torch.device(device).type == "cuda" or (triton_on_cpu and triton_support.interpreting())))
    if on_cuda and quant.get("quant_algo") == W4A16_AWQ:
        model = _load_int4_cuda(raw_config, rank_weights, config, target_dtype, device, int(quant["group_size"]),
                                fold_prequant)
        return _finish_cuda(model)
    weights = dequantized_weights(raw_config, rank_weights, target_dtype)  # W4A16_AWQ dequantized, TP merged
    weights = _select_model_weights(weights, config)
    _check_shapes(weights, config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=target_dtype)
    model.to_empty(device=device)
    model.load_state_dict(_model_names(weights), strict=True)
    model.reset_buffers()
    on_cpu = cpu_kernels and torch.device(device).type == "cpu"
    prefill = prefill_precision(config.dtype) if on_cpu and target_dtype == torch.float32 else "float32"
    if on_cpu and quant.get("quant_algo") == W4A16_AWQ:
        _use_int4_kernel(model, raw_checkpoint_rank0, int(quant["group_size"]), len(raw_ranks), prefill)
    for layer in model.transformer.layers:
        layer.mlp.fuse_fc_gate()  # one GEMM for fc + gate (plain float layers only)
    if on_cpu and config.dtype in ("float16", "bfloat16") and cpu_ext.load() is not None:
        model.use_16bit_logits(torch_dtype(config.dtype))
        if quant.get("quant_algo") is None:
            _use_dense16_kernel(model, torch_dtype(config.dtype), prefill)
    if on_cuda:
        return _finish_cuda(model)
    if prefill == "bfloat16":
        _use_bf16_prefill(model)
    return model.eval().requires_grad_(False)


def _load_int4_cuda(raw_config: dict, rank_weights: list[dict[str, torch.Tensor]], config: ModelConfig,
                    dtype: torch.dtype, device: torch.device | str, group_size: int, fold_prequant: bool
                    ) -> LlamaForCausalLM:
    """The model with its W4A16 linears as packed :class:`~llmc.engine.torch.int4_cuda.Int4CudaLinear` layers: the
    float linears are removed while the model is still on the meta device, so no float copy is ever allocated."""
    from llmc.engine.torch import int4_install

    merged = rank_weights[0] if len(rank_weights) == 1 else merge_shards(rank_weights, raw_config)
    quantized, rest = int4_install.split_quantized(merged)
    rest = _select_model_weights(rest, config)
    _check_shapes(rest, config, skip=set(quantized))
    expected = _expected_shapes(config)
    for prefix, (packed, scales, prequant) in quantized.items():
        logical = (2 * packed.shape[0], packed.shape[1])
        if expected.get(f"{prefix}.{names.WEIGHT}") != logical:
            raise CheckpointError(f"packed weight {prefix}.{names.WEIGHT} holds a {logical} matrix, the config implies "
                                  f"{expected.get(f'{prefix}.{names.WEIGHT}')}. Fix: re-export the checkpoint with "
                                  f"`llmc build --force`")
        _check_quantized_shapes(prefix, packed, scales, prequant, group_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=dtype)
    int4_install.remove_linears(model, set(quantized))
    model.to_empty(device=device)
    model.load_state_dict(_model_names(rest), strict=True)
    model.reset_buffers()
    counts = int4_install.install(model, quantized, group_size, fold_prequant)
    logger.info("int4 CUDA layers: %s", counts)
    return model


def _finish_cuda(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Fused CUDA kernels where the shape allows them; an untied input embedding in page-locked host memory
    (:mod:`llmc.engine.torch.host_embedding`, ``LLMC_EMBEDDING``); the allocator's cache of load-time temporaries
    and the device table are returned to the device, so the KV cache planned next gets that memory."""
    head_size = model.config.head_size
    model.use_cuda_fused(head_size >= 16 and head_size & (head_size - 1) == 0)
    if host_embedding.move_to_host(model):
        logger.info("input embedding in page-locked host memory (%s=device keeps it on the GPU)", host_embedding.ENV)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model.eval().requires_grad_(False)


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's weights on its device by dtype name (parameters and persistent + packed buffers;
    the RoPE table is not a weight)."""
    tensors = [p for p in model.parameters()] + [b for name, b in model.named_buffers() if name != "inv_freq"]
    return _bytes_by_dtype(tensors)


def host_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's weights held in host memory by dtype name (a
    :class:`~llmc.engine.torch.host_embedding.HostEmbedding`'s table)."""
    return _bytes_by_dtype([m.weight for m in model.modules() if isinstance(m, host_embedding.HostEmbedding)])


def _bytes_by_dtype(tensors: list[torch.Tensor | None]) -> dict[str, int]:
    """``{dtype name: bytes}`` of ``tensors``, each storage counted once (fused fc/gate views share storage with
    their stacked weight)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for t in tensors:
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def _use_int4_kernel(model: LlamaForCausalLM, weights: dict[str, torch.Tensor], group_size: int,
                     num_ranks: int, prefill: str) -> None:
    """Swap each quantized nn.Linear for an :class:`Int4Linear` built from the packed IR tensors."""
    from llmc.engine.torch.int4_cpu import Int4Linear, int4_kernel_available, supports_shape

    if num_ranks != 1 or not int4_kernel_available():
        logger.info("int4 CPU kernel not used (ranks=%d, op available=%s)", num_ranks, int4_kernel_available())
        return

    def int4_tensors(name: str, module: torch.nn.Module) -> tuple[torch.Tensor, ...] | None:
        packed = weights.get(f"{name}.{names.WEIGHT}")
        if not isinstance(module, torch.nn.Linear) or packed is None or packed.dtype != torch.int8:
            return None
        if not supports_shape(module.out_features, module.in_features, group_size):
            return None
        return (unpack_int4(packed), weights[f"{name}.{names.WEIGHTS_SCALING_FACTOR}"],
                weights[f"{name}.{names.PREQUANT_SCALING_FACTOR}"])

    fused = set()
    for i, layer in enumerate(model.transformer.layers):  # fc + gate: one int4 GEMM over the stacked rows
        fc = int4_tensors(f"transformer.layers.{i}.mlp.fc", layer.mlp.fc)
        gate = int4_tensors(f"transformer.layers.{i}.mlp.gate", layer.mlp.gate)
        if fc is None or gate is None or not torch.equal(fc[2], gate[2]) or not layer.mlp.fuse_fc_gate():
            continue
        layer.mlp.use_fc_gate_kernel(Int4Linear(torch.cat([fc[0], gate[0]]), torch.cat([fc[1], gate[1]]), fc[2],
                                              group_size, dense=layer.mlp.fc_gate, prefill=prefill))
        fused.update({f"transformer.layers.{i}.mlp.fc", f"transformer.layers.{i}.mlp.gate"})
    for name, module in list(model.named_modules()):  # module names are the IR's tensor-name prefixes
        tensors = None if name in fused else int4_tensors(name, module)
        if tensors is None:
            continue
        parent_name, _, child = name.rpartition(".")
        fast = Int4Linear(*tensors, group_size, dense=module.weight.detach(), prefill=prefill)
        setattr(model.get_submodule(parent_name), child, fast)


def _use_dense16_kernel(model: LlamaForCausalLM, dtype: torch.dtype, prefill: str) -> None:
    """Swap each float linear of the decoder (and each stacked fc + gate) for a :class:`Dense16Linear` over the
    exact ``dtype`` copy of its weight; a weight without one stays as it is."""
    from llmc.engine.torch.dense16_cpu import Dense16Linear

    for layer in model.transformer.layers:
        if layer.mlp.fc_gate is not None and layer.mlp.fc_gate_kernel is None:
            fast = Dense16Linear.over(layer.mlp.fc_gate, dtype, prefill)
            if fast is not None:
                layer.mlp.use_fc_gate_kernel(fast)
        for parent, child in _decoder_linears(layer):
            module = getattr(parent, child)
            fast = Dense16Linear.over(module.weight, dtype, prefill) if type(module) is torch.nn.Linear else None
            if fast is not None:
                setattr(parent, child, fast)


def _use_bf16_prefill(model: LlamaForCausalLM) -> None:
    """Attend prefill chunks in bfloat16 products (``Attention.use_bf16_prefill``), and give every decoder linear
    that is still a plain ``nn.Linear`` (no CPU decode kernel took it: a multi-rank AWQ checkpoint, an odd shape)
    bfloat16 prefill GEMMs too (:class:`MixedLinear`), an MLP whose fc + gate run as one plain GEMM the same. An
    MLP whose fc + gate kernel keeps no float32 weight drops the stacked float32 one."""
    for layer in model.transformer.layers:
        layer.attention.use_bf16_prefill()
        kernel = layer.mlp.fc_gate_kernel
        if layer.mlp.fc_gate is not None and kernel is None:
            layer.mlp.use_fc_gate_kernel(MixedLinear(layer.mlp.fc_gate, "bfloat16"))
        elif kernel is not None and kernel.prefill.weight is None:
            layer.mlp.drop_float_fc_gate()  # nothing multiplies the float32 [fc; gate] any more
        unfused = ((layer.mlp, "fc"), (layer.mlp, "gate")) if layer.mlp.fc_gate is None else ()
        for parent, child in _decoder_linears(layer) + unfused:
            module = getattr(parent, child)
            if type(module) is torch.nn.Linear:
                setattr(parent, child, MixedLinear(module.weight, "bfloat16"))


def _decoder_linears(layer: torch.nn.Module) -> tuple[tuple[torch.nn.Module, str], ...]:
    """(parent, attribute) of the linears of a decoder layer that run on their own (fc and gate run stacked)."""
    return ((layer.attention, "qkv"), (layer.attention, "dense"), (layer.mlp, "proj"))


def _select_model_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Drop what the model does not hold: a tied lm_head, the lm_head's vocab padding rows, unused scales."""
    if config.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if k != names.LM_HEAD}  # the embedding is used instead
    elif names.LM_HEAD in weights:
        weights = {**weights, names.LM_HEAD: weights[names.LM_HEAD][: config.vocab_size]}
    expected = _expected_shapes(config)
    extra = sorted(set(weights) - set(expected))
    if extra:
        # As in TensorRT-LLM: extra tensors (e.g. kv-cache scales) are ignored with a warning.
        logger.warning("ignoring %d checkpoint tensors the torch engine does not use, e.g. %s", len(extra), extra[:3])
    return {name: weights[name] for name in expected if name in weights}


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        names.VOCAB_EMBEDDING: (config.vocab_size, h),
        names.LN_F: (h,),
    }
    if not config.tie_word_embeddings:
        shapes[names.LM_HEAD] = (config.vocab_size, h)
    per_layer = {
        "input_layernorm": (h,),
        "post_layernorm": (h,),
        "attention.qkv": (config.qkv_size, h),
        "attention.dense": (h, config.num_heads * config.head_size),
        "mlp.fc": (i, h),
        "mlp.gate": (i, h),
        "mlp.proj": (h, i),
    }
    for layer in range(config.num_layers):
        for module, shape in per_layer.items():
            shapes[names.trt_layer(layer, module)] = shape
        if config.qkv_bias:
            shapes[names.trt_layer(layer, "attention.qkv", names.BIAS)] = (config.qkv_size,)
        for norm in names.QK_NORMS if config.qk_norm else ():
            shapes[names.trt_layer(layer, norm)] = (config.head_size,)
    return shapes


def _model_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """IR tensors keyed by the model's state-dict names (:func:`~llmc.engine.torch.model.state_dict_name`)."""
    return {state_dict_name(name): tensor for name, tensor in weights.items()}


def _check_quantized_shapes(prefix: str, packed: torch.Tensor, scales: torch.Tensor, prequant: torch.Tensor | None,
                            group_size: int) -> None:
    out2, k = packed.shape
    expected = {"weights_scaling_factor": (tuple(scales.shape), (2 * out2, k // group_size))}
    if prequant is not None:
        expected["prequant_scaling_factor"] = (tuple(prequant.shape), (k,))
    for suffix, (got, want) in expected.items():
        if got != want:
            raise CheckpointError(f"checkpoint tensor {prefix}.{suffix} has shape {got}, the packed weight "
                                  f"{tuple(packed.shape)} and group size {group_size} imply {want}. "
                                  f"Fix: re-export the checkpoint with `llmc build --force`")


def _check_shapes(weights: dict[str, torch.Tensor], config: ModelConfig, skip: set[str] = frozenset()) -> None:
    """CheckpointError for a missing tensor or a shape the config does not imply; ``skip``: module prefixes held
    elsewhere (the packed int4 layers, checked by :func:`_check_quantized_shapes`)."""
    expected = {k: v for k, v in _expected_shapes(config).items()
                if not (k.endswith(f".{names.WEIGHT}") and k.rsplit(".", 1)[0] in skip)}  # a bias is checked
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(
            f"checkpoint lacks {len(missing)} tensors its config needs, e.g. {missing[:3]}. "
            f"Fix: re-export the checkpoint with `llmc build --force`"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(
                f"checkpoint tensor {name!r} has shape {tuple(weights[name].shape)}, the config implies {shape}. "
                f"Fix: re-export the checkpoint with `llmc build --force`"
            )

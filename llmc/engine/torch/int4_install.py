"""Putting W4A16_AWQ linears into a loaded model on CUDA as :class:`~llmc.engine.torch.int4_cuda.Int4CudaLinear`
layers (the loader's int4 path), and the bytes such an engine holds on the GPU (what ``llmc inspect`` reports)."""

from __future__ import annotations

import torch
from torch import nn

from llmc.checkpoint import names
from llmc.engine.torch.int4_configs import shape_key
from llmc.engine.torch.int4_cuda import Int4CudaLinear, Scratch
from llmc.engine.torch.int4_layout import MMA_COLS, MMA_INPUTS, TILE
from llmc.errors import CheckpointError


# The layers that apply AWQ's input scale in the kernel (o, down); qkv, fc and gate fold theirs into the norms.
KERNEL_PREQUANT = (names.DENSE.trt, names.PROJ.trt)


def cuda_weight_bytes(tensors: dict[str, tuple[str, tuple[int, ...], int]], tied: bool) -> int:
    """Bytes the torch engine holds on a CUDA GPU (with Triton) for IR tensors ``{name: (dtype, shape, bytes)}``
    read from safetensors headers: packed int4 layers stay packed (shapes of whole mma tiles as they are, others
    with their input features padded to whole tiles of 128 for the Triton kernels), AWQ input scales the loader
    folds into norms (qkv, fc, gate) are dropped, a tied lm_head is the embedding."""
    total = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        if tied and name == names.LM_HEAD:
            continue
        parsed = names.parse_trt_layer_name(name)
        if parsed and parsed[2] == names.PREQUANT_SCALING_FACTOR and parsed[1] not in KERNEL_PREQUANT:
            continue  # folded into input_layernorm / post_layernorm
        if parsed and parsed[2] == names.WEIGHT and dtype == "I8":  # packed [N/2, K] -> words [Kp/8, N] int32
            n, k = 2 * shape[0], shape[1]
            if not (n % MMA_COLS == 0 and k % MMA_INPUTS == 0):
                nbytes = -(-k // TILE) * TILE // 8 * n * 4
        total += nbytes
    return total


def int4_layer_shapes(tensors: dict[str, tuple[str, tuple[int, ...], int]], group_size: int
                      ) -> list[tuple[str, int, int, int, bool, bool]]:
    """The CUDA library's int4 layers of an IR's first layer, from tensors ``{name: (dtype, shape, bytes)}`` (one
    rank's safetensors headers), as ``llmc tune`` tunes them: ``(name, columns, inputs, group,
    silu_output, input scale in the kernel)`` for qkv, o, fc + gate (one layer) and down, in that order. Layers
    without whole 16-column x 64-input tiles (the Triton kernels') are left out; the input scales of qkv and
    fc + gate are folded into the norms, as the loader does."""
    packed, prequant = {}, set()
    for name, (dtype, shape, _) in tensors.items():
        parsed = names.parse_trt_layer_name(name)
        if parsed and parsed[0] == 0 and parsed[2] == names.WEIGHT and dtype == "I8":
            packed[parsed[1]] = (2 * shape[0], shape[1])  # packed [N/2, K]
        elif parsed and parsed[0] == 0 and parsed[2] == names.PREQUANT_SCALING_FACTOR:
            prequant.add(parsed[1])
    fc, gate = packed.get(names.FC.trt), packed.get(names.GATE.trt)
    layers = [("qkv", names.QKV.trt, packed.get(names.QKV.trt)), ("o", names.DENSE.trt, packed.get(names.DENSE.trt)),
              ("fc_gate", names.FC.trt, (fc[0] + gate[0], fc[1]) if fc and gate else None),
              ("down", names.PROJ.trt, packed.get(names.PROJ.trt))]
    return [(name, nk[0], nk[1], group_size, name == "fc_gate", module in KERNEL_PREQUANT and module in prequant)
            for name, module, nk in layers if nk and nk[0] % MMA_COLS == 0 and nk[1] % MMA_INPUTS == 0]


QuantizedLinear = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # packed [N/2, K], scales [N, K/g], prequant


def split_quantized(weights: dict[str, torch.Tensor]) -> tuple[dict[str, QuantizedLinear], dict[str, torch.Tensor]]:
    """Separate the W4A16 linears of merged IR tensors: ``({module prefix: (packed, scales, prequant)}, rest)``;
    the prefix is the model's module name (``transformer.layers.3.mlp.fc``)."""
    quantized: dict[str, QuantizedLinear] = {}
    for name, tensor in weights.items():
        parsed = names.parse_trt_layer_name(name)
        if parsed and parsed[2] == names.WEIGHT and tensor.dtype == torch.int8:
            prefix = name[: -len(names.WEIGHT) - 1]
            scales = weights.get(f"{prefix}.{names.WEIGHTS_SCALING_FACTOR}")
            if scales is None:
                raise CheckpointError(f"W4A16_AWQ checkpoint lacks {prefix}.{names.WEIGHTS_SCALING_FACTOR} for the "
                                      f"packed weight {name!r}. Fix: re-run the quantization step of "
                                      f"`llmc build --force`")
            quantized[prefix] = (tensor, scales, weights.get(f"{prefix}.{names.PREQUANT_SCALING_FACTOR}"))
    consumed = {f"{p}.{s}" for p in quantized for s in
                (names.WEIGHT, names.WEIGHTS_SCALING_FACTOR, names.PREQUANT_SCALING_FACTOR)}
    return quantized, {k: v for k, v in weights.items() if k not in consumed}


def remove_linears(model: nn.Module, prefixes: set[str]) -> None:
    """Drop the (meta) float Linear modules that int4 layers will replace, so the model never allocates them."""
    for prefix in prefixes:
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent), child, None)


def install(model: nn.Module, quantized: dict[str, QuantizedLinear], group_size: int, fold_prequant: bool = True
            ) -> dict[str, int]:
    """Put :class:`Int4CudaLinear` layers into a loaded ``LlamaForCausalLM`` (its float weights on the device)
    for every quantized linear; returns counts (``layers``, ``folded`` prequant vectors, ``fused_fc_gate``).

    Per decoder layer: qkv's prequant is folded into ``input_layernorm`` (its only reader), and with the ``mma``
    backend its columns are interleaved per head for the RoPE + KV-write epilogue; fc and gate become one
    layer over their interleaved columns that returns ``silu(fc) * gate`` when their prequant vectors are equal
    (AWQ smooths them together), folded into ``post_layernorm``. ``fold_prequant=False`` applies every prequant
    in the kernels instead (for tests: the two must agree).
    """
    device = next(p.device for p in model.parameters())
    dtype = model.transformer.ln_f.weight.dtype
    scratch = Scratch(dtype, device)
    counts = {"layers": 0, "folded": 0, "fused_fc_gate": 0}

    def build(prefix: str, norm: nn.Module | None = None, parts: tuple[str, ...] | None = None,
              rope_head: int = 0) -> Int4CudaLinear:
        tensors = [quantized[p] for p in (parts or (prefix,))]
        prequant = tensors[0][2]
        if prequant is not None and norm is not None:
            with torch.no_grad():
                norm.weight.copy_((norm.weight.float() * prequant.to(device).float()).to(norm.weight.dtype))
            counts["folded"] += 1
            prequant = None
        layer = Int4CudaLinear.from_ir([(t[0].to(device), t[1].to(device, dtype)) for t in tensors],
                                       None if prequant is None else prequant.to(device, dtype), group_size,
                                       scratch, silu_output=parts is not None, rope_head=rope_head)
        counts["layers"] += 1
        counts[layer.backend] = counts.get(layer.backend, 0) + 1
        return layer

    for i, layer in enumerate(model.transformer.layers):
        base = f"transformer.layers.{i}"
        fold_in, fold_post = (layer.input_layernorm, layer.post_layernorm) if fold_prequant else (None, None)
        att, mlp = layer.attention, layer.mlp
        if f"{base}.attention.qkv" in quantized:
            att.qkv = build(f"{base}.attention.qkv", fold_in, rope_head=model.config.head_size)
        if f"{base}.attention.dense" in quantized:
            att.dense = build(f"{base}.attention.dense")
        fc, gate = quantized.get(f"{base}.mlp.fc"), quantized.get(f"{base}.mlp.gate")
        same_prequant = fc is not None and gate is not None and (
            (fc[2] is None and gate[2] is None)
            or (fc[2] is not None and gate[2] is not None and torch.equal(fc[2], gate[2])))
        if same_prequant:
            mlp.use_fc_gate_kernel(build(f"{base}.mlp.fc", fold_post, parts=(f"{base}.mlp.fc", f"{base}.mlp.gate")))
            counts["fused_fc_gate"] += 1
        else:
            for name in ("fc", "gate"):
                if f"{base}.mlp.{name}" in quantized:
                    setattr(mlp, name, build(f"{base}.mlp.{name}"))
        if f"{base}.mlp.proj" in quantized:
            mlp.proj = build(f"{base}.mlp.proj")
    scratch.allocate()
    return counts


def config_sources(model: nn.Module) -> dict[str, str]:
    """``{shape key (N x K g G): whose kernel configs}`` of the model's int4 CUDA layers (empty without any): the
    tuned GPU whose table they come from (``", shape ..."``: another shape's, the nearest tuned one), or the
    heuristics; what ``llmc bench`` reports beside its figures."""
    return {shape_key(m.columns, m.in_features, m.group_size): m.configs_from
            for m in model.modules() if isinstance(m, Int4CudaLinear)}

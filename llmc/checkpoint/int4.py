"""Signed int4 packing and the W4A16_AWQ weight convention of the TensorRT-LLM checkpoint.

Storage (shared/reference/tensorrt-llm.md): ``.weight`` is int8 [O/2, K]; byte [j, k] holds q[2j, k] in its
low nibble and q[2j+1, k] in its high nibble, both as 4-bit two's complement in [-8, 7]. Symmetric, no zero
point. A layer computes ``(x * prequant) @ (q * scale)^T``, with ``scale`` [O, K/g] per group of g inputs.

Round-to-nearest convention used by :func:`quantize_rtn` (the same as NVIDIA's int4 AWQ export):
``scale = max|w| / 7`` per group, ``q = clamp(round(w / scale), -8, 7)``; an all-zero group gets scale 0 and
q = 0. With this scale ``+max|w|`` maps to 7 exactly and -8 is never produced; the other common choice
(``max|w| / 7.5``, used by llm-compressor) clips +max|w| to 7 and uses -8 -- its outputs pack the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from llmc.checkpoint import names
from llmc.errors import CheckpointError

INT4_MIN, INT4_MAX = -8, 7


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 values q int8 [O, K] in [-8, 7] into int8 [O/2, K] (row 2j low nibble, row 2j+1 high).

    Raises CheckpointError for a non-2-D or non-integer tensor, an odd O, or values outside [-8, 7].
    """
    if q.dim() != 2 or q.dtype.is_floating_point or q.dtype.is_complex:
        raise CheckpointError(f"pack_int4 needs a 2-D integer tensor [O, K], got {q.dim()}-D {q.dtype}")
    if q.shape[0] % 2:
        raise CheckpointError(f"pack_int4 needs an even number of output rows, got {q.shape[0]}")
    if q.numel() and (int(q.min()) < INT4_MIN or int(q.max()) > INT4_MAX):
        raise CheckpointError(
            f"int4 values must lie in [{INT4_MIN}, {INT4_MAX}], got [{int(q.min())}, {int(q.max())}]"
        )
    wide = q.to(torch.int16) & 0x0F  # two's complement nibbles, [O, K]
    packed = wide[0::2] | (wide[1::2] << 4)  # [O/2, K] in [0, 255]
    return packed.to(torch.uint8).view(torch.int8).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int8 [O/2, K] -> int8 [O, K] in [-8, 7]."""
    if packed.dim() != 2 or packed.dtype not in (torch.int8, torch.uint8):
        raise CheckpointError(f"unpack_int4 needs a 2-D int8 tensor [O/2, K], got {packed.dim()}-D {packed.dtype}")
    wide = packed.view(torch.uint8).to(torch.int16)  # [O/2, K] in [0, 255]
    nibbles = torch.stack((wide & 0x0F, (wide >> 4) & 0x0F), dim=1)  # [O/2, 2, K]
    signed = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return signed.reshape(-1, packed.shape[1]).to(torch.int8)  # [O, K], row 2j then 2j+1


def quantize_rtn(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int4 of w [O, K]: returns (q int8 [O, K], scales [O, K/g]).

    ``scale_dtype`` (default w's dtype) is the dtype the scales will be stored in; q is computed against the
    scales already rounded to it, so ``q * scale`` is exactly the weight the stored checkpoint describes.
    """
    _check_groups(w.shape[1], group_size)
    out_features, in_features = w.shape
    groups = w.float().reshape(out_features, in_features // group_size, group_size)  # [O, K/g, g]
    scales = (groups.abs().amax(dim=-1) / INT4_MAX).to(scale_dtype or w.dtype)  # [O, K/g]
    s = scales.float().unsqueeze(-1)  # [O, K/g, 1]
    ratio = torch.where(s > 0, groups / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(groups))
    q = ratio.round().clamp(INT4_MIN, INT4_MAX).to(torch.int8).reshape(out_features, in_features)
    return q, scales


def dequantize_w4a16(
    packed: torch.Tensor,
    scales: torch.Tensor,
    prequant: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The effective weight W [O, K] of a W4A16_AWQ layer: ``x @ W^T == (x * prequant) @ (q * scale)^T``.

    Returns ``(q * scale) * prequant[None, :]`` computed in float32 and cast once to ``dtype``.
    packed int8 [O/2, K], scales [O, K/g], prequant [K]; CheckpointError on inconsistent shapes.
    """
    q = unpack_int4(packed)  # [O, K]
    out_features, in_features = q.shape
    _check_groups(in_features, group_size)
    if tuple(scales.shape) != (out_features, in_features // group_size):
        raise CheckpointError(
            f"weights_scaling_factor has shape {tuple(scales.shape)}, expected "
            f"{(out_features, in_features // group_size)} for weight [O={out_features}, K={in_features}], "
            f"group_size {group_size}"
        )
    if tuple(prequant.shape) != (in_features,):
        raise CheckpointError(f"prequant_scaling_factor has shape {tuple(prequant.shape)}, expected ({in_features},)")
    full_scales = scales.float().repeat_interleave(group_size, dim=1)  # [O, K]
    w = q.float() * full_scales * prequant.float()[None, :]
    return w.to(dtype)


def dequantize_rank(weights: Mapping[str, torch.Tensor], group_size: int, dtype: torch.dtype = torch.float32
                    ) -> dict[str, torch.Tensor]:
    """One rank's IR tensors with every W4A16_AWQ linear replaced by its effective weight in ``dtype``.

    A linear's packed int8 ``.weight`` and its ``weights_scaling_factor`` / ``prequant_scaling_factor`` become one
    ``.weight`` [O, K] (:func:`dequantize_w4a16`); every other tensor is kept as it is. CheckpointError names a
    scale a packed weight lacks.
    """
    out = {}
    for name, tensor in weights.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix in (names.WEIGHTS_SCALING_FACTOR, names.PREQUANT_SCALING_FACTOR):
            continue  # consumed together with their packed weight below
        if suffix == names.WEIGHT and tensor.dtype == torch.int8:
            scales, prequant = (f"{prefix}.{s}" for s in (names.WEIGHTS_SCALING_FACTOR, names.PREQUANT_SCALING_FACTOR))
            for needed in (scales, prequant):
                if needed not in weights:
                    raise CheckpointError(f"W4A16_AWQ checkpoint lacks {needed!r} for the packed weight {name!r}. "
                                          f"Fix: re-run the quantization step of `llmc build --force`")
            tensor = dequantize_w4a16(tensor, weights[scales], weights[prequant], group_size, dtype=dtype)
        out[name] = tensor
    return out


def _check_groups(in_features: int, group_size: int) -> None:
    if group_size <= 0 or in_features % group_size:
        raise CheckpointError(
            f"group_size {group_size} does not divide the {in_features} input features; use a group size "
            "that divides every quantized layer's input features"
        )

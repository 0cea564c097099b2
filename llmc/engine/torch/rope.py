"""Rotary position embeddings (GPT-NeoX layout) with the scaling variants llmc supports.

NeoX layout: the head dimension is split in two halves ``x1 = x[..., :hd/2]``, ``x2 = x[..., hd/2:]`` and
frequency ``i`` rotates the pair ``(x1[i], x2[i])``. Supported ``rotary_scaling`` types: none/``default``,
``linear`` (positions divided by ``factor``) and ``llama3`` (Llama 3.1 frequency-dependent smoothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmc.engine.torch import cpu_ext
from llmc.errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A validated ``rotary_scaling`` entry of the checkpoint config."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    @classmethod
    def from_config(cls, scaling: dict | None) -> RopeScaling | None:
        """Parse HF-style ``rope_scaling`` (``type`` or ``rope_type`` key); None or ``default`` -> None."""
        if not scaling:
            return None
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"rotary_scaling type {rope_type!r} is not supported by the torch engine; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}. Fix: use a model with one of these rope types"
            )
        try:
            if rope_type == "linear":
                return cls(rope_type="linear", factor=float(scaling["factor"]))
            return cls(
                rope_type="llama3",
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise CheckpointError(
                f"rotary_scaling of type {rope_type!r} lacks the field {e.args[0]!r}. "
                f"Fix: re-export the checkpoint from a config whose rope_scaling is complete"
            ) from None


def rope_inv_freq(head_size: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[head_size / 2]`` float32 on CPU, with ``scaling`` applied."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float32) / head_size
    inv_freq = 1.0 / (base**exponents)  # [hd/2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate in between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation tables for absolute ``positions [T]``, built once per step and shared by every layer:
    ``cos [T, 1, hd]`` (the half-size table repeated) and ``sin [T, 1, hd]`` with its first half negated,
    computed in float32 and cast to ``dtype`` (the activations' dtype, as transformers does)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = freqs.cos(), freqs.sin()
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [T, hd] each
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, hd]`` by the tables of :func:`rope_cos_sin` (NeoX halves):
    ``[x1 * cos - x2 * sin, x2 * cos + x1 * sin]``, i.e. transformers' ``x * cos + rotate_half(x) * sin``
    with the same roundings. On CPU in float32, llmc's fused kernel does it in one pass (:mod:`cpu_ext`)."""
    if cpu_ext.rope_available(x, cos):
        return cpu_ext.rope(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)  # [T, heads, hd/2] each
    return x * cos + torch.cat((x2, x1), dim=-1) * sin  # 4 ops for q and k together, whatever the head count

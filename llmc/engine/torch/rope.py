"""Rotary position embeddings (GPT-NeoX layout) with the scaling variants llmc supports.

NeoX layout: the head dimension is split in two halves ``x1 = x[..., :hd/2]``, ``x2 = x[..., hd/2:]`` and
frequency ``i`` rotates the pair ``(x1[i], x2[i])``. Supported ``rotary_scaling`` types: none/``default``,
``linear`` (positions divided by ``factor``), ``llama3`` (Llama 3.1 frequency-dependent smoothing) and ``yarn``
(YaRN, arXiv 2309.00071: the frequencies that turn fewer than ``beta_slow`` times over the original context are
divided by ``factor``, those that turn more than ``beta_fast`` times are kept, a linear ramp over the dimensions in
between; cos and sin are multiplied by the attention factor, ``0.1 ln(factor) + 1`` unless the config gives it or
``mscale`` / ``mscale_all_dim``), which Qwen2.5 and Qwen3 document for contexts past 32K tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmc.engine.torch import cpu_ext
from llmc.errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A validated ``rotary_scaling`` entry of the checkpoint config."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    beta_fast: float = 32.0  # yarn only (the defaults are the paper's)
    beta_slow: float = 1.0  # yarn only
    attention_factor: float = 1.0  # yarn only: cos and sin are multiplied by it
    truncate: bool = True  # yarn only: the correction range rounded outwards to whole dimensions

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
            if rope_type == "yarn":
                return _yarn(scaling)
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


def _yarn(scaling: dict) -> RopeScaling:
    """A ``yarn`` entry: ``factor`` and ``original_max_position_embeddings`` required, the rest defaulted."""
    factor = float(scaling["factor"])

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale(1.0)
    return RopeScaling(rope_type="yarn", factor=factor,
                       original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                       beta_fast=float(scaling.get("beta_fast") or 32.0),
                       beta_slow=float(scaling.get("beta_slow") or 1.0),
                       attention_factor=float(attention), truncate=bool(scaling.get("truncate", True)))


def rope_inv_freq(head_size: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[head_size / 2]`` float32 on CPU, with ``scaling`` applied."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).to(torch.float32) / head_size
    inv_freq = 1.0 / (base**exponents)  # [hd/2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_size, base, scaling)
    return _llama3_inv_freq(inv_freq, scaling)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    return scaling.attention_factor if scaling is not None and scaling.rope_type == "yarn" else 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, head_size: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: frequency ``i`` turns ``L / (2 pi base^(2i / hd))`` times over the original context ``L``; dimension
    pairs below the one turning ``beta_fast`` times keep their frequency, those past the one turning ``beta_slow``
    times are divided by ``factor``, and a linear ramp over the pair index blends the two in between."""
    def dim_turning(turns: float) -> float:  # the (fractional) pair dimension whose frequency turns ``turns`` times
        return head_size * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(s.beta_fast), dim_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0 keep, 1 divide
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


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
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype = torch.float32, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation tables for absolute ``positions [T]``, built once per step and shared by every layer:
    ``cos [T, 1, hd]`` (the half-size table repeated) and ``sin [T, 1, hd]`` with its first half negated,
    computed in float32 (times ``attention_factor``: :func:`rope_attention_factor`) and cast to ``dtype`` (the
    activations' dtype, as transformers does)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
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

"""What the paged KV cache stores: this step's keys and values written at their slots (:func:`write_kv`), and
for an fp8 cache (``kv_cache.dtype: fp8``) their conversion to and from float8 e4m3 over the layer's scale
(:func:`to_cache`, :func:`from_cache`: the reference paths' rounding; the Triton RoPE kernel stores the same bytes
and the Triton attention kernels read them the same way)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn  # an fp8 cache's storage dtype (TensorRT-LLM's FP8 KV cache is e4m3 too)
FP8_MAX = 448.0  # e4m3's largest finite value: a layer's scale is its keys' and values' largest magnitude / this
F16_MAX = 65504.0  # float16's largest finite value: the attention kernels clamp 16-bit queries to it (f16_dots)
F16_DOTS = True  # the Triton attention kernels' dots over an fp8 cache in float16 (False: in the queries' dtype)


def f16_dots(cache_dtype: torch.dtype, q_dtype: torch.dtype) -> bool:
    """Whether the Triton attention kernels take their dots over an fp8 cache in float16 (16-bit queries): e4m3
    converts to float16 exactly in one instruction for two values (to bfloat16 it goes through float32 value by
    value), a bfloat16 query is exact in float16 within its range (queries are clamped to +-F16_MAX, far above any
    model's), and float16 probabilities carry 3 more bits than bfloat16's."""
    return F16_DOTS and cache_dtype == FP8 and q_dtype in (torch.bfloat16, torch.float16)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """Store the new ``k, v [T, nkv, hd]`` at their flat cache slots (in the cache's dtype; an fp8 cache holds
    them divided by the layer's ``kv_scale``: :func:`to_cache`)."""
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    for cache, new in ((k_cache, k), (v_cache, v)):
        stored = to_cache(new, cache.dtype, kv_scale)
        if cache.dtype == FP8:  # index_copy_ has no float8 kernels: copy the bytes
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, stored)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Keys or values as a cache of ``cache_dtype`` stores them: fp8 holds ``x`` times float32 ``1 / kv_scale``,
    clamped to e4m3's finite range and rounded to nearest even (the Triton RoPE kernel's bits); others hold ``x``."""
    if cache_dtype != FP8:
        return x.to(cache_dtype)
    return (x.float() * (1.0 / kv_scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_cache(x: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Cached keys or values in ``dtype``: an fp8 cache's times ``kv_scale`` (in float32, then rounded)."""
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.float() * kv_scale).to(dtype)

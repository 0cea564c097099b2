"""Sizing and allocating the paged KV cache of the portable engine.

Bytes per token = 2 (k and v) x layers x kv_heads x head_size x dtype bytes. The number of blocks comes from
the recipe: on CPU ``kv_cache.cpu_budget_mb``; on CUDA ``kv_cache.memory_fraction`` of the memory that is free
after the weights are loaded.

``kv_cache.dtype: fp8`` stores keys and values as float8 e4m3 (one byte) divided by the layer's
``kv_cache_scaling_factor`` (calibrated by ``llmc build``, :mod:`llmc.builder.kv_scales`), on CUDA GPUs that convert
fp8 (compute capability 8.9+: Ada, Hopper, Blackwell) with Triton; elsewhere the cache is 16-bit and the
runner says why (:func:`fp8_why_not`): llmc's CPU attention kernels read 16- and 32-bit caches only.
"""

from __future__ import annotations

import os

import torch

from llmc.checkpoint.convert import torch_dtype
from llmc.engine.torch.kv_store import FP8
from llmc.engine.torch.model import KVCache, ModelConfig
from llmc.errors import EngineError

KV_DTYPES = ("float16", "bfloat16", "fp8")  # the recipe's kv_cache.dtype values the torch backend stores
FP8_MIN_SM = 89  # compute capability (x10) of the first GPUs with fp8 conversions: Ada


def kv_cache_dtype(recipe_kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype: ``auto`` = the checkpoint's dtype, ``fp8`` = :data:`FP8` (where the device runs it:
    :func:`fp8_why_not`)."""
    if recipe_kv_dtype == "auto":
        return model_dtype
    if recipe_kv_dtype not in KV_DTYPES:
        raise EngineError(
            f"kv_cache.dtype {recipe_kv_dtype!r} is not supported by the torch backend. "
            f"Fix: set kv_cache.dtype to auto, float16, bfloat16 or fp8"
        )
    return FP8 if recipe_kv_dtype == "fp8" else torch_dtype(recipe_kv_dtype)


def fp8_why_not(device: torch.device, block_size: int, head_size: int) -> str | None:
    """Why an fp8 cache cannot run on ``device`` (None: it can): the engine's fp8 paths are its Triton attention and
    RoPE kernels, and fp8 conversions need compute capability 8.9+."""
    from llmc.engine.torch.triton_attention import kernel_available

    if device.type != "cuda":
        return f"llmc's {device.type.upper()} attention kernels read 16- and 32-bit caches only"
    capability = torch.cuda.get_device_capability(device)
    if 10 * capability[0] + capability[1] < FP8_MIN_SM:
        return (f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]}) has no "
                f"fp8 conversions; they need 8.9+ (Ada, Hopper, Blackwell)")
    if not kernel_available(device, block_size, head_size):
        return (f"the Triton attention kernels need Triton and power-of-two block and head sizes of at least 16 "
                f"(kv_cache.tokens_per_block {block_size}, heads of {head_size})")
    return None


FP8_ENV = "LLMC_KV_FP8"  # "0": an fp8 build's cache runs at the checkpoint's 16-bit dtype (A/B measurements)


def fp8_switched_off() -> bool:
    """``LLMC_KV_FP8=0``: fp8 caches run 16-bit."""
    return os.environ.get(FP8_ENV, "1") == "0"


def runtime_kv_dtype(recipe_kv_dtype: str, model_dtype: torch.dtype, device: torch.device, block_size: int,
                     head_size: int) -> tuple[torch.dtype, str | None]:
    """The dtype the runner's cache takes on ``device`` and, where the recipe's fp8 falls back to the checkpoint's
    dtype (``model_dtype``: what ``auto`` stores), why (else None)."""
    dtype = kv_cache_dtype(recipe_kv_dtype, model_dtype)
    if dtype != FP8:
        return dtype, None
    why = f"{FP8_ENV}=0" if fp8_switched_off() else fp8_why_not(device, block_size, head_size)
    if why is None:
        return dtype, None
    return model_dtype, f"kv_cache.dtype fp8 runs as {str(model_dtype).removeprefix('torch.')} here: {why}"


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes over all layers: 2 x layers x kv_heads x head_size x dtype bytes."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_size * item


def plan_num_blocks(
    bytes_per_token: int,
    block_size: int,
    device: torch.device,
    cpu_budget_mb: int,
    memory_fraction: float,
) -> int:
    """Blocks that fit the budget: ``cpu_budget_mb`` on CPU, ``memory_fraction`` of free CUDA memory."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * memory_fraction)
        fix = "raise kv_cache.memory_fraction or use a GPU with more free memory"
    else:
        budget = cpu_budget_mb * 2**20
        fix = "raise kv_cache.cpu_budget_mb"
    num_blocks = budget // (bytes_per_token * block_size)
    if num_blocks < 1:
        raise EngineError(
            f"the KV-cache budget ({budget / 2**20:.1f} MiB) does not hold one block of {block_size} tokens "
            f"({bytes_per_token * block_size / 2**20:.2f} MiB). Fix: {fix}"
        )
    return int(num_blocks)


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    """One ``(k, v)`` pair per layer, each ``[num_blocks, block_size, num_kv_heads, head_size]``, zero-filled.

    Zero-filled (not empty) so padded or never-written slots never hold NaN bit patterns: masked scores get
    probability 0, but 0 * NaN would still poison the output.
    """
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_size)
    storage = torch.zeros(shape, dtype=dtype, device=device)  # one allocation for all layers
    return [(storage[i, 0], storage[i, 1]) for i in range(config.num_layers)]

"""Sizing and allocating the paged KV cache of the portable engine.

Bytes per token = 2 (k and v) x layers x kv_heads x head_size x dtype bytes. The number of blocks comes from
the recipe: on CPU ``kv_cache.cpu_budget_mb``; on CUDA ``kv_cache.memory_fraction`` of the memory that is free
after the weights are loaded.
"""

from __future__ import annotations

import torch

from llmc.checkpoint.convert import torch_dtype
from llmc.engine.torch.model import KVCache, ModelConfig
from llmc.errors import EngineError

KV_DTYPES = ("float16", "bfloat16")  # the recipe's kv_cache.dtype values the torch backend stores


def kv_cache_dtype(recipe_kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype: ``auto`` = the checkpoint's dtype; fp8 needs the tensorrt_llm backend."""
    if recipe_kv_dtype == "auto":
        return model_dtype
    if recipe_kv_dtype not in KV_DTYPES:
        raise EngineError(
            f"kv_cache.dtype {recipe_kv_dtype!r} is not supported by the torch backend. "
            f"Fix: set kv_cache.dtype to auto, float16 or bfloat16 (or use backend: tensorrt_llm for fp8)"
        )
    return torch_dtype(recipe_kv_dtype)


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

"""The W4A16 CUDA kernels' launch configs: the table tuned on GPUs (``int4_cuda_configs.json``, made by
``scripts/tune_int4_cuda.py`` and shipped) and the heuristics for shapes or GPUs without an entry. Nothing is
autotuned while serving.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from llmc.engine.torch import triton_support
from llmc.engine.torch.int4_layout import MMA_COLS, TILE

logger = logging.getLogger(__name__)

CONFIG_FILE = Path(__file__).with_name("int4_cuda_configs.json")
DENSE_FROM_M_DEFAULT = 512  # rows from which dequantize + cuBLAS is used when a shape has no tuned threshold


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of ``int4_triton.w4a16_matmul`` for one (shape, rows) bucket."""

    block_m: int
    block_n: int
    unroll: int
    num_warps: int
    num_stages: int
    split_k: int = 1

    def to_list(self) -> list[int]:
        return [self.block_m, self.block_n, self.unroll, self.num_warps, self.num_stages, self.split_k]

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return (-(-n // self.block_n), -(-m // self.block_m), self.split_k)

    def workspace(self, m: int, n: int) -> int:
        """float32 elements of split-K partials this config needs for ``m`` rows (0 without split-K)."""
        return 0 if self.split_k == 1 else self.split_k * -(-m // self.block_m) * self.block_m * n


TARGET_PROGRAMS = 4 * 132  # a few programs per multiprocessor of an H100/H200 keep enough loads in flight


def heuristic_config(m: int, n: int, k: int = 4096) -> KernelConfig:
    """A reasonable config where nothing was tuned: rows padded to 16..64, narrow column blocks for few rows, and
    split-K up to about TARGET_PROGRAMS programs (one program per column block leaves multiprocessors idle)."""
    block_m = min(64, triton_support.pow2_at_least(m, 16))
    block_n = 32 if m <= 16 or n <= 2048 else 64
    blocks = -(-n // block_n) * -(-m // block_m)
    tiles = -(-k // TILE)
    split = 1
    while split < 16 and blocks * split * 2 <= TARGET_PROGRAMS and tiles // (split * 2) >= 2:
        split *= 2
    return KernelConfig(block_m, block_n, 1, 4, 3, split)


@functools.cache
def _tuned_table() -> dict:
    try:
        return json.loads(CONFIG_FILE.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("int4 CUDA kernel configs unreadable (%s); using heuristics", exc)
        return {}


def tuned_device_names() -> list[str]:
    """The GPU names the shipped config table has tuned entries for."""
    return list(_tuned_table().get("devices", {}))


def shape_key(n: int, k: int, group_size: int) -> str:
    """The tuned table's key of one linear shape: ``N x K g G``."""
    return f"{n}x{k}g{group_size}"


def tuned_entry(device_name: str, n: int, k: int, group_size: int) -> dict | None:
    """The tuned entry ``{"buckets": [[m_max, *config]], "dense_from_m": int}`` of a shape on a GPU, or None."""
    return _tuned_table().get("devices", {}).get(device_name, {}).get(shape_key(n, k, group_size))


def heuristic_mma_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """``(row tiles of 8, column tiles of 16, warps, L2 prefetch)`` per block of the mma kernel where nothing was
    tuned: one column tile for few rows (more blocks), two from 9 rows on (each activation fragment then serves two
    tiles); the L2 prefetch from 9 rows on (a guess: the H200's tuning turned it off in every bucket of the 8B
    shapes and on in some of SmolLM2's)."""
    n_tiles = 1 if m <= 8 or (n // MMA_COLS) % 2 else 2
    return (1 if m <= 8 else 2 if m <= 16 else 4), n_tiles, (8 if k >= 2048 else 4), int(m > 8)

"""The W4A16 CUDA kernels' launch configs: the table tuned on GPUs (``int4_cuda_configs.json``, made by
``scripts/tune_int4_cuda.py`` and shipped), the tables read over it (this machine's, written by ``llmc tune``, then
``LLMC_INT4_CONFIGS``'s) and the heuristics for shapes or GPUs without an entry. Nothing is autotuned while
serving."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from llmc.engine.torch import cuda_ext, triton_support
from llmc.engine.torch.int4_layout import MMA_COLS, TILE
from llmc.errors import EngineError

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


TABLE_VERSION = 2  # 2: mma buckets are [m_max, row tiles, column tiles, warps, stages (0: registers; < 0: wgmma)]


CONFIGS_ENV = "LLMC_INT4_CONFIGS"  # a table of the user's (llmc tune --out), read over the shipped and local ones
LOCAL_TABLE = "int4_cuda_configs.json"  # llmc tune's table on this machine, beside the CUDA library it tuned
LOCAL_LABEL = "llmc tune's table"


def local_table_path() -> Path:
    """Where ``llmc tune`` writes this machine's configs by default: ``$LLMC_CACHE_DIR/cuda/int4_cuda_configs.json``."""
    return cuda_ext.cache_dir() / LOCAL_TABLE


def table_sources() -> list[tuple[str, Path]]:
    """The tables read over the shipped one, in order (later wins): ``(label, path)`` of the local table where it
    exists, then ``LLMC_INT4_CONFIGS``'s where it is set."""
    local, extra = local_table_path(), os.environ.get(CONFIGS_ENV)
    return ([(LOCAL_LABEL, local)] if local.is_file() else []) + ([(f"{CONFIGS_ENV}={extra}", Path(extra))]
                                                                 if extra else [])


@functools.cache
def _tuned_table() -> dict:
    try:
        table = upgrade_table(json.loads(CONFIG_FILE.read_text()))
    except (OSError, ValueError) as exc:
        logger.warning("int4 CUDA kernel configs unreadable (%s); using heuristics", exc)
        table = {}
    for label, path in table_sources():
        table = merge_tables(table, user_table(path, label), label)
    return table


def user_table(path: Path, label: str) -> dict:
    """A table of tuned configs read over the shipped one (``label``: where it comes from, for the error);
    EngineError naming the problem and the fix if it is unreadable."""
    try:
        table = json.loads(path.read_text())
        why = None
        if not isinstance(table, dict) or not isinstance(table.get("devices", {}), dict):
            why = "not a table of tuned configs (a JSON object with \"devices\")"
    except OSError as exc:
        why = f"cannot be read ({exc.strerror or exc})"
    except ValueError as exc:
        why = f"not valid JSON ({exc})"
    if why:
        if label == LOCAL_LABEL:
            said, fix = f"{LOCAL_LABEL} {path}", "move it away and run `llmc tune BUILD` again"
        elif label.startswith(CONFIGS_ENV):
            said = f"{CONFIGS_ENV}={path}"
            fix = f"point it at a table written by `llmc tune BUILD --out FILE`, or unset {CONFIGS_ENV}"
        else:
            said, fix = label, "give another file, or move this one away"
        raise EngineError(f"{said}: {why}. Fix: {fix}")
    return upgrade_table(table)


def merge_tables(shipped: dict, user: dict, label: str | None = None) -> dict:
    """``shipped`` with ``user``'s GPUs and shapes over it: a shape's kernel families (the Triton ``buckets`` and
    ``dense_from_m``, the CUDA library's ``mma``) from the user's table where it has them; ``label`` (where the
    user's table comes from) marks its entries of each family (``"mma_table"``, ``"triton_table"``), for ``llmc
    bench``'s report."""
    merged = {"version": TABLE_VERSION, "gpus": {**shipped.get("gpus", {}), **user.get("gpus", {})},
              "devices": {name: dict(shapes) for name, shapes in shipped.get("devices", {}).items()}}
    for name, shapes in user.get("devices", {}).items():
        mine = merged["devices"].setdefault(name, {})
        for key, entry in shapes.items():
            mine[key] = {**mine.get(key, {}), **entry}
            if label and "mma" in entry:
                mine[key]["mma_table"] = label
            if label and "buckets" in entry:
                mine[key]["triton_table"] = label
    return merged


def upgrade_table(table: dict) -> dict:
    """``table`` in the current format: an older table's mma entries are dropped (their configs belong to a kernel
    that no longer exists; the heuristics, or a new tuning, take over), the Triton entries stay."""
    if table.get("version", 1) < TABLE_VERSION:
        for shapes in table.get("devices", {}).values():
            for entry in shapes.values():
                entry.pop("mma", None)
        table["version"] = TABLE_VERSION
    return table


def config_devices(name: str, capability: str | None = None, multiprocessors: int = 0) -> list[str]:
    """The tuned GPUs whose configs a GPU runs, first choice first: itself where the table has it, then (given its
    ``capability``, e.g. ``"9.0"``) the tuned GPU of the same compute capability closest to it in multiprocessors
    (ties: by name): the same kernels on the same multiprocessors, so its configs transfer far better than the
    heuristics (on an H100, the H200's table ran the 8B shape's decode linears within 3 % of the H100's own and up
    to 1.5x faster than the heuristics: docs/GPU_INT4_LOG.md, 2026-12-06)."""
    table = _tuned_table()
    devices, gpus = table.get("devices", {}), table.get("gpus", {})
    own = [name] if name in devices else []
    same = sorted((abs(info.get("multiprocessors", 0) - multiprocessors), other) for other, info in gpus.items()
                  if other != name and other in devices and capability and info.get("capability") == capability)
    return own + [same[0][1]] if same else own


def shape_key(n: int, k: int, group_size: int) -> str:
    """The tuned table's key of one linear shape: ``N x K g G``."""
    return f"{n}x{k}g{group_size}"


def tuned_entry(device_name: str, n: int, k: int, group_size: int, capability: str | None = None,
                multiprocessors: int = 0) -> dict | None:
    """The tuned entry of a shape on a GPU, or None: ``{"buckets": [[m_max, *config]], "dense_from_m": int}`` (the
    Triton kernels) and ``{"mma": {...}}`` (the CUDA library's), each kernel family's from the first of
    :func:`config_devices` that has it (``capability`` None: the GPU's own entry only; ``"mma_gpu"`` and
    ``"triton_gpu"`` name whose they are). A shape nobody tuned
    takes the CUDA library's configs of the nearest tuned shape (:func:`nearest_shape`; the layer still checks
    that each fits, else the heuristic), marked ``"mma_from": its key``: left out of the tuning of those GPUs,
    each 8B and SmolLM2 shape ran at 1.15x its own best config so (geometric mean over 6 row buckets, H100
    timings of 2026-12-06) against 1.35x with the heuristics."""
    devices, key = _tuned_table().get("devices", {}), shape_key(n, k, group_size)
    chosen = config_devices(device_name, capability, multiprocessors)
    merged: dict = {}
    for name in reversed(chosen):
        entry = devices[name].get(key, {})
        if "mma" in entry:  # the CUDA library's configs, from this GPU (and table) only
            merged.pop("mma_table", None)
        if "buckets" in entry:  # the Triton kernels' likewise
            merged.pop("triton_table", None)
        merged.update(entry, **({"mma_gpu": name} if "mma" in entry else {}),
                      **({"triton_gpu": name} if "buckets" in entry else {}))
    if "mma" not in merged:
        for name in chosen:
            near = nearest_shape(n, k, group_size, [s for s, e in devices[name].items() if "mma" in e])
            if near:
                table = devices[name][near].get("mma_table")
                merged.update(mma=devices[name][near]["mma"], mma_gpu=name, mma_from=near,
                              **({"mma_table": table} if table else {}))
                break
    return merged or None


def nearest_shape(n: int, k: int, group_size: int, keys: list[str]) -> str | None:
    """The key of ``keys`` (``N x K g G``) nearest to ``n`` x ``k`` at ``group_size``: the smallest sum of the
    columns' and inputs' log2 ratios, plus 1 for another group size (ties: by key), or None if ``keys`` is empty."""
    def distance(key: str) -> tuple[float, str]:
        shape, group = key.split("g")
        other_n, other_k = (int(v) for v in shape.split("x"))
        return abs(math.log2(other_n / n)) + abs(math.log2(other_k / k)) + (int(group) != group_size), key

    return min(keys, key=distance, default=None)


MMA_STAGES = (2, 4, 8)  # depths of each warp's cp.async ring
MMA_REGISTERS = 0  # "stages" of the register kernel: no ring, each warp's tiles go straight to registers
MMA_MAX_RING = 200 * 1024  # shared memory a config's ring may take (the CUDA library's kMaxSmem)
MMA_MAX_BLOCK = 227 * 1024  # shared memory a block may take on the H100/H200: ring + AWQ's input scale
# The warpgroup kernel (sm_90 only): "stages" -3, -4, -6; (column tiles, warps) = (4 x warpgroups x A tiles of 64
# columns, 4 x warpgroups); row tiles of 8 up to 256 rows; at most 256 rows x A tiles a warpgroup (accumulators).
# Split-K: "stages" -(10 s + 4), s in WGMMA_SPLITS splits of the input, 4 stages, 64 rows a block (8 row tiles: the
# only blocks that won on the H200, at 65-128 rows; the others were dropped to keep the build short).
WGMMA_STAGES = (-3, -4, -6)
WGMMA_SPLITS = (2, 4, 8)
WGMMA_BLOCKS = ((4, 4), (8, 4), (8, 8), (16, 8))
WGMMA_ROW_TILES = (1, 2, 4, 8, 16, 32)


def is_wgmma(config: tuple[int, int, int, int]) -> bool:
    """Whether ``config`` selects the warpgroup kernel (negative stages)."""
    return config[3] < 0


def wgmma_splits(config: tuple[int, int, int, int]) -> tuple[int, int]:
    """``(splits of the input, stages)`` of a warpgroup config (1 split: no split-K)."""
    code = -config[3]
    return max(1, code // 10), code % 10


def split_buffers(config: tuple[int, int, int, int], rows: int, n: int) -> tuple[int, int]:
    """``(float32 partial sums, arrival counters)`` a launch of ``config`` over ``rows`` rows and ``n`` columns
    needs (0, 0 without split-K): every block's sums, one counter per output tile."""
    if not is_wgmma(config) or wgmma_splits(config)[0] == 1:
        return 0, 0
    mt, nt = config[0], config[1]
    row_blocks, col_blocks = -(-rows // (8 * mt)), n // (16 * nt)
    return wgmma_splits(config)[0] * row_blocks * 8 * mt * n, row_blocks * col_blocks


def register_depth(k: int, warps: int, n_tiles: int) -> int:
    """Input tiles each warp of the register kernel holds at once (the library's KPW): its share of the layer's
    ``k / 64`` tiles rounded up to a power of two, at most 16 column-tile words a thread (8 with 16 warps)."""
    cap = (8 if warps == 16 else 16) // n_tiles
    need, depth = -(-(k // 64) // warps), 1
    while depth < need and depth < cap:
        depth *= 2
    return depth


def mma_smem_bytes(config: tuple[int, int, int, int], k: int = 0, prequant: bool = False,
                   rows: int | None = None) -> int:
    """Dynamic shared memory of a block of the mma kernels (as the CUDA library computes it), or the warps'
    partial sums if larger. The ring kernel: each warp's ring of ``stages`` slots (the slot: column tiles x (32
    weight + 8 scale) uint4, row tiles x 64 uint4 of activations), then AWQ's input scale (2 K bytes) where the
    kernel applies it. The register kernel (stages 0): the block's rows (``rows``, at most 8 per row tile; None:
    a full block) of one chunk of activations, each row padded by 16 bytes. The warpgroup kernel (negative stages):
    1 KB of alignment, then per stage the block's rows of 64 inputs (128 bytes a row) and each thread's weight words
    and scale pairs (20 bytes an A tile), then the input scale."""
    mt, nt, warps, stages = config
    if stages < 0:
        depth = wgmma_splits(config)[1]
        return 1024 + depth * (8 * mt * 128 + 32 * warps * (nt // warps) * 20) + (2 * k if prequant else 0)
    partial = warps * nt * mt * 4 * 32 * 4
    if stages == MMA_REGISTERS:
        block_rows = 8 * mt if rows is None else min(8 * mt, rows)
        inputs = min(warps * register_depth(k, warps, nt), k // 64) * 64
        return max(block_rows * (inputs + 8) * 2, partial)
    ring = warps * stages * (nt * 40 + mt * 64) * 16
    return max(ring, partial) + (2 * k if prequant else 0)


@functools.cache
def mma_configs() -> tuple[tuple[int, int, int, int], ...]:
    """Every ``(row tiles, column tiles, warps, stages)`` llmc's CUDA library launches (before the shape's own
    constraints: column tiles dividing N / 16, shared memory). Ring kernel: 16 warps only with at most 2 (row
    tile, column tile) pairs (a thread then has 128 registers), rings of at most 200 KB. Register kernel (stages
    0): 1 or 2 row tiles. Warpgroup kernel (negative stages, sm_90 only): see ``WGMMA_*``."""
    ring = tuple((mt, nt, warps, stages) for mt in (1, 2, 4) for nt in (1, 2, 4) for warps in (4, 8, 16)
                 for stages in MMA_STAGES if (warps < 16 or mt * nt <= 2)
                 and mma_smem_bytes((mt, nt, warps, stages)) <= MMA_MAX_RING)
    registers = tuple((mt, nt, warps, MMA_REGISTERS) for mt in (1, 2) for nt in (1, 2, 4) for warps in (4, 8, 16))
    warpgroup = tuple((mt, nt, warps, stages) for mt in WGMMA_ROW_TILES for nt, warps in WGMMA_BLOCKS
                      for stages in WGMMA_STAGES if 8 * mt * (nt // warps) <= 256 and (mt < 16 or stages == -4))
    split = tuple((8, nt, warps, -(10 * s + 4)) for nt, warps in WGMMA_BLOCKS for s in WGMMA_SPLITS)
    return ring + registers + warpgroup + split


def mma_fits(config: tuple[int, int, int, int], n: int, k: int, prequant: bool, rows: int | None = None,
             sm90: bool = True) -> bool:
    """Whether the library launches ``config`` for a layer of ``n`` columns and ``k`` inputs (at ``rows`` rows;
    None: any row count) on a GPU of compute capability 9.x (``sm90``; the warpgroup kernel needs one) or another."""
    return (config in mma_configs() and (n // 16) % config[1] == 0 and (sm90 or not is_wgmma(config))
            and mma_smem_bytes(config, k, prequant, rows) <= MMA_MAX_BLOCK)


def heuristic_mma_config(m: int, n: int, k: int, prequant: bool = False) -> tuple[int, int, int, int]:
    """``(row tiles of 8, column tiles of 16, warps, stages)`` per block of the mma kernel where nothing was tuned,
    after what the H200's tuning chose for the 8B shapes: one row tile per 8 rows up to 32 rows, column tiles
    sharing each activation fragment (4 for wide layers, 2 for narrow ones), 8 warps with a ring of 4 tiles each
    (4 warps for 4 x 4 tiles; shallower rings where the input scale leaves no room)."""
    tiles = n // MMA_COLS
    n_tiles = next(nt for nt in (4, 2, 1) if tiles % nt == 0 and (nt < 4 or tiles >= 4 * 132))
    m_tiles = 1 if m <= 8 else 2 if m <= 16 else 4
    warps = 4 if m_tiles * n_tiles >= 16 else 8
    for stages in (4, 2):
        if mma_fits((m_tiles, n_tiles, warps, stages), n, k, prequant):
            return m_tiles, n_tiles, warps, stages
    return 1, 1, 4, 2

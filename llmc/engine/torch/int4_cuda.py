"""W4A16_AWQ linears that stay int4 on CUDA: the layer and the per-step kernel choice (installed in a model by
:mod:`llmc.engine.torch.int4_install`).

A decode step multiplies few rows (M = the batch) by every weight: it is bound by reading the weights, so the
int4 kernel (:mod:`llmc.engine.torch.int4_triton`) reads a quarter of the bf16 bytes. A prefill step multiplies
thousands of rows: it is bound by tensor-core FLOPs, where cuBLAS is best; the layer's weight is then
dequantized into a scratch buffer shared by all layers (one pass over the packed weight, ~0.1 ms for an 8B
layer) and multiplied by cuBLAS. Which rows count as "few" is measured per shape (``int4_cuda_configs.json``).

Two kernel families, chosen per layer at load (:func:`choose_backend`):

- ``mma`` (:mod:`llmc.engine.torch.cuda_ext`, CUDA C++): the weight in tensor-core fragment order
  (:func:`llmc.engine.torch.int4_layout.pack_mma`), 1-32 rows per block on the tensor cores with one read of
  the weight (and, on sm_90, a warpgroup kernel for 8-256 rows a block that shares the block's activations between
  its warps); used where nvcc and an sm_80+ GPU are there and the shape is whole tiles of 16 columns x 64 inputs
  (every Llama shape).
- ``triton`` (:mod:`llmc.engine.torch.int4_triton`): the portable fallback
  (:func:`llmc.engine.torch.int4_layout.pack_for_cuda`), and the path Triton's CPU interpreter tests.

The kernel configs are tuned on the GPU and shipped (:mod:`llmc.engine.torch.int4_configs`).
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
from torch import nn

from llmc.checkpoint.int4 import unpack_int4
from llmc.engine.torch import cuda_ext, pending_norm, triton_support
from llmc.engine.torch.int4_configs import (DENSE_FROM_M_DEFAULT, KernelConfig, heuristic_config,
                                            heuristic_mma_config, mma_fits, split_buffers, tuned_entry)
from llmc.engine.torch.int4_layout import (MMA_COLS, TILE, interleave_halves, interleave_tiles, mma_supported,
                                           pack_for_cuda, pack_mma)
from llmc.engine.torch.pending_norm import PendingNorm

logger = logging.getLogger(__name__)

# (magic bits, offset) per activation dtype: ``u | magic`` read as that 16-bit float is ``q + offset`` exactly;
# float32 activations convert the nibble directly (magic 0) and subtract 8.
MAGIC = {torch.bfloat16: (0x4300, 136.0), torch.float16: (0x6400, 1032.0), torch.float32: (0, 8.0)}

MMA_DENSE_FROM_M_DEFAULT = 96
ROPE_EPILOGUE_ENV = "LLMC_ROPE_EPILOGUE"  # "0": qkv layers write qkv, then a separate kernel does RoPE + KV write


def rope_epilogue_enabled() -> bool:
    """The qkv layers' RoPE + KV-write epilogue is on (``LLMC_ROPE_EPILOGUE`` is not ``0``; for A/B runs)."""
    return not triton_support.switched_off(ROPE_EPILOGUE_ENV)


def choose_backend(n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device) -> str:
    """``mma`` where llmc's CUDA library loads and the shape and dtype fit it, else ``triton``."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or not mma_supported(n, k, group_size):
        return "triton"
    return "mma" if cuda_ext.load() is not None else "triton"


class Scratch:
    """Buffers shared by every int4 linear of a model: the dequantized weight of prefill steps, the split-K partials
    and arrival counters of decode steps, the per-block sums of squares of a pending norm.

    Layers run one after another on one stream, so one buffer of the largest need serves all of them. Each layer
    reserves its need when built; :meth:`allocate` (the loader calls it before the KV cache is planned and the
    decode steps are captured in CUDA graphs) makes the buffers once, at the largest sizes reserved.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.sizes = {"dense": 0, "partials": 0, "counters": 0, "norm_sums": 0}
        self._buffers: dict[str, torch.Tensor] | None = None

    def reserve(self, dense: int = 0, partials: int = 0, counters: int = 0, norm_sums: int = 0) -> None:
        """Room for each need (elements)."""
        assert self._buffers is None, "reserve before allocate: the buffers are made once"
        for key, numel in (("dense", dense), ("partials", partials), ("counters", counters), ("norm_sums", norm_sums)):
            self.sizes[key] = max(self.sizes[key], numel)

    def reserve_splits(self, launches, n: int) -> None:
        """Room for split-K launches ``(config, rows)`` over ``n`` columns
        (:func:`llmc.engine.torch.int4_configs.split_buffers`; configs that do not split need none)."""
        needs = [split_buffers(config, rows, n) for config, rows in launches]
        self.reserve(partials=max((p for p, _ in needs), default=0), counters=max((c for _, c in needs), default=0))

    def allocate(self) -> None:
        if self._buffers is None:
            self._buffers = {
                "dense": torch.empty(self.sizes["dense"], dtype=self.dtype, device=self.device),
                "partials": torch.empty(self.sizes["partials"], dtype=torch.float32, device=self.device),
                "counters": torch.zeros(max(1, self.sizes["counters"]), dtype=torch.int32, device=self.device),
                "norm_sums": torch.empty(self.sizes["norm_sums"], dtype=torch.float32, device=self.device),
            }

    def buffer(self, key: str, numel: int) -> torch.Tensor:
        self.allocate()
        assert numel <= self.sizes[key], (key, numel, self.sizes[key])
        return self._buffers[key]

    def dense_view(self, k: int, n: int) -> torch.Tensor:
        return self.buffer("dense", k * n)[: k * n].view(k, n)


class Int4CudaLinear(nn.Module):
    """``y = x @ W^T`` of a W4A16_AWQ linear, its weight kept packed (see :func:`pack_for_cuda`).

    ``prequant`` [K] (AWQ's input scale) is applied in the kernel's input load, None where the loader folded it
    into the preceding norm's weight. ``silu_output``: the weight's columns are the MLP's fc and gate rows
    interleaved (``2n`` = fc ``n``, ``2n + 1`` = gate ``n``) and the layer returns ``silu(fc) * gate``
    ``[T, N / 2]``. Rows below the shape's ``dense_from_m`` run the int4 kernel; larger steps dequantize into
    ``scratch`` and use cuBLAS.

    ``backend``: ``triton`` (``words`` and ``scales`` from :func:`pack_for_cuda`, fc + gate columns interleaved
    one by one) or ``mma`` (from :func:`pack_mma`, fc + gate interleaved in blocks of 8: :func:`interleave_tiles`).
    :meth:`from_ir` packs for either. ``rope_head`` (``mma``, a qkv layer): the columns are interleaved per head of
    that size (:func:`interleave_halves`), so :meth:`rope_write_kv` can rotate q and k and write the KV cache in
    the product's epilogue; :meth:`forward` still returns the columns in their own order.
    """

    takes_pending_norm = True  # forward and rope_write_kv take a PendingNorm (see forward)

    def __init__(self, words: torch.Tensor, scales: torch.Tensor, prequant: torch.Tensor | None, in_features: int,
                 group_size: int, scratch: Scratch, silu_output: bool = False, backend: str = "triton",
                 rope_head: int = 0):
        super().__init__()
        assert backend in ("triton", "mma"), backend
        assert not rope_head or (backend == "mma" and not silu_output), "the RoPE epilogue is the mma kernel's"
        self.backend = backend
        self.rope_head = rope_head
        # the weight's columns (2I with silu_output)
        self.columns = words.shape[0] * MMA_COLS if backend == "mma" else words.shape[1]
        self.in_features = in_features
        self.out_features = self.columns // 2 if silu_output else self.columns
        self.group_size, self.silu_output, self.scratch = group_size, silu_output, scratch
        # mma: the columns' interleave period (interleave_halves): fc + gate over all of them, qkv per head
        self.period = self.columns if silu_output and backend == "mma" else rope_head
        self.register_buffer("words", words, persistent=False)  # triton: [Kp/8, N]; mma: [N/16, K/64, 32, 4]
        self.register_buffer("scales", scales, persistent=False)  # triton: [K/g, N]; mma: pairs [N/16, K/g, 8]
        self.register_buffer("prequant", prequant, persistent=False)  # [K] or None
        self._dense_weight: torch.Tensor | None = None  # this layer's view of the shared prefill scratch
        gpu = torch.cuda.get_device_properties(words.device) if words.is_cuda else None
        entry = tuned_entry(gpu.name if gpu else "cpu", self.columns, in_features, group_size,
                            *((f"{gpu.major}.{gpu.minor}", gpu.multi_processor_count) if gpu else ())) or {}
        if backend == "mma":
            mma = entry.get("mma", {})
            # whose configs these are (llmc bench's report): a GPU's, of this shape or (mma_from) the nearest one,
            # from the shipped table or (mma_table) one read over it
            shape = f", shape {entry['mma_from']}" if "mma_from" in entry else ""
            table = f" ({entry['mma_table']})" if "mma_table" in entry else ""
            self.configs_from = entry.get("mma_gpu", "tuned") + shape + table if mma else "heuristics"
            self.dense_from_m = int(mma.get("dense_from_m", MMA_DENSE_FROM_M_DEFAULT))
            self._mma_buckets = [(b[0], tuple(b[1:5])) for b in mma.get("buckets", [])]
            self._mma_chosen: dict[int, tuple[int, int, int, int]] = {}
            self._sm90 = words.is_cuda and cuda_ext.warpgroup_kernels(words.device)
            # split-K's buffers for the tuned configs that split (the last bucket's runs up to dense_from_m - 1 rows)
            tops = [m for m, _ in self._mma_buckets[:-1]] + [max(self.dense_from_m - 1, 1)]
            scratch.reserve(dense=in_features * self.columns)
            fits = [(c, min(m, self.dense_from_m - 1)) for m, (_, c) in zip(tops, self._mma_buckets)
                    if mma_fits(c, self.columns, in_features, prequant is not None)]
            scratch.reserve_splits(fits, self.columns)  # a borrowed config that does not fit the shape never runs
            scratch.reserve(norm_sums=max(self.dense_from_m - 1, 1) * (self.columns // 16))  # pending norms
            return
        self.dense_from_m = int(entry.get("dense_from_m", DENSE_FROM_M_DEFAULT))
        table = f" ({entry['triton_table']})" if "triton_table" in entry else ""
        self.configs_from = "Triton: " + (entry.get("triton_gpu", "tuned") + table if "buckets" in entry else
                                          "heuristics")
        self._buckets = [(b[0], KernelConfig(*b[1:])) for b in entry.get("buckets", [])]
        # Every config this layer can launch (rows 1 .. dense_from_m - 1), for the shared buffers' sizes: each row
        # count, as the heuristic's split-K (a shape without tuned buckets) varies with the rows.
        rows = range(1, max(self.dense_from_m, 2))
        configs = [(m, self.config_for(m)) for m in rows] + [(m, heuristic_config(m, self.columns, in_features))
                                                            for m in rows]
        n = self.columns
        scratch.reserve(dense=in_features * n, partials=max(c.workspace(m, n) for m, c in configs),
                        counters=max(c.grid(m, n)[0] * c.grid(m, n)[1] for m, c in configs))

    @classmethod
    def from_ir(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], prequant: torch.Tensor | None, group_size: int,
                scratch: Scratch, silu_output: bool = False, backend: str | None = None,
                rope_head: int = 0) -> Int4CudaLinear:
        """The layer of IR tensors ``[(packed int8 [N/2, K], scales [N, K/g] in the compute dtype)]`` on the
        device: one part, or fc and gate with ``silu_output``. ``backend`` None: :func:`choose_backend`.
        ``rope_head``: a qkv layer's head size, for the RoPE epilogue (used with the ``mma`` backend only, when the
        head size is a multiple of 16)."""
        assert len(parts) == (2 if silu_output else 1)
        k = parts[0][0].shape[1]
        n = sum(2 * packed.shape[0] for packed, _ in parts)
        backend = backend or choose_backend(n, k, group_size, scratch.dtype, parts[0][0].device)
        rope_head = rope_head if backend == "mma" and rope_head and rope_head % 16 == 0 and n % rope_head == 0 else 0
        if backend == "mma":
            qs = [unpack_int4(packed) for packed, _ in parts]
            q = interleave_tiles(*qs) if silu_output else qs[0]
            scales = interleave_tiles(*(s for _, s in parts)) if silu_output else parts[0][1]
            if rope_head:
                q, scales = interleave_halves(q, rope_head), interleave_halves(scales, rope_head)
            words, scales = pack_mma(q, scales, group_size)
        else:
            packed_scales = [pack_for_cuda(packed, s, group_size) for packed, s in parts]
            # fc + gate: their columns interleaved (2n = fc n, 2n + 1 = gate n)
            words = torch.stack([w for w, _ in packed_scales], dim=2).flatten(1)
            scales = torch.stack([s for _, s in packed_scales], dim=2).flatten(1)
        return cls(words, scales, prequant, k, group_size, scratch, silu_output=silu_output, backend=backend,
                   rope_head=rope_head)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"prequant={self.prequant is not None}, silu_output={self.silu_output}, backend={self.backend}"
                + (f", rope_head={self.rope_head}" if self.rope_head else ""))

    def mma_config_for(self, m: int) -> tuple[int, int, int, int]:
        """The mma kernel's ``(row tiles, column tiles, warps, stages)`` for ``m`` rows: the tuned bucket where the
        library launches it for this layer (a warpgroup config only on sm_90; rows past the last bucket, up to
        ``dense_from_m``, take the last bucket's: what the tuner timed against dequantize + cuBLAS there), else the
        heuristic (kept per row count: decode steps ask every time)."""
        config = self._mma_chosen.get(m)
        if config is None:
            prequant = self.prequant is not None
            last = self._mma_buckets[-1][1] if self._mma_buckets else None
            tuned = next((c for m_max, c in self._mma_buckets if m <= m_max), last)
            fits = tuned is not None and mma_fits(tuned, self.columns, self.in_features, prequant, m, self._sm90)
            config = tuned if fits else heuristic_mma_config(m, self.columns, self.in_features, prequant)
            self._mma_chosen[m] = config
        return config

    def config_for(self, m: int) -> KernelConfig:
        """The tuned config of the smallest bucket holding ``m`` rows, else :func:`heuristic_config`."""
        return next((c for m_max, c in self._buckets if m >= 1 and m <= m_max), None) or heuristic_config(
            m, self.columns, self.in_features)

    def weight_bytes(self) -> int:
        """Bytes of this layer's packed weight, scales and input scale on the device."""
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.prequant) if t is not None)

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """``x @ W^T``; ``x`` may be a residual stream whose norm is pending (finished in the kernel's input load
        where :func:`~llmc.engine.torch.pending_norm.takes_input_norm` says so, else here first)."""
        m = x.shape[0]
        if isinstance(x, PendingNorm):
            if pending_norm.takes_input_norm(self, x):
                return self.mma(x.scaled, *self.mma_config_for(m), norm=x)
            x = x.materialize()
        if m >= self.dense_from_m:
            return self._dense(x)
        if self.backend == "mma":
            return self.mma(x, *self.mma_config_for(m))
        return self.matmul(x, self.config_for(m))

    def mma(self, x: torch.Tensor, m_tiles: int, n_tiles: int, warps: int, stages: int,
            norm: PendingNorm | None = None) -> torch.Tensor:
        """The CUDA tensor-core kernel with an explicit config (the tuning script calls this); ``stages``: the depth
        of each warp's cp.async ring, 0 for the register kernel (no ring), negative for the warpgroup kernel
        (sm_90; :data:`llmc.engine.torch.int4_configs.WGMMA_STAGES`); ``norm``: ``x`` is its ``scaled`` rows and
        the kernel finishes the norm (:func:`llmc.engine.torch.pending_norm.takes_input_norm`)."""
        assert x.shape[-1] == self.in_features
        x = cuda_ext.aligned_rows(x)
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if x.shape[0]:
            cuda_ext.w4a16_mma(x, self.words, self.scales, self.prequant, y, self.columns, self.in_features,
                               self.group_size, self.silu_output, m_tiles, n_tiles, warps, stages,
                               period=0 if self.silu_output else self.period,
                               **self._split_buffers((m_tiles, n_tiles, warps, stages), x.shape[0]),
                               **(pending_norm.kernel_args(norm) if norm is not None else {}))
        return y

    def _split_buffers(self, config: tuple[int, int, int, int], m: int) -> dict:
        """The shared scratch's split-K buffers for ``config`` at ``m`` rows (none where it does not split)."""
        partials, counters = split_buffers(config, m, self.columns)
        if not partials:
            return {}
        return {"partials": self.scratch.buffer("partials", partials),
                "counters": self.scratch.buffer("counters", counters)}

    def rope_write_kv(self, x: torch.Tensor | PendingNorm, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                      num_kv_heads: int) -> torch.Tensor | None:
        """A qkv layer's decode-sized product with RoPE and the KV-cache write in the kernel's epilogue (what
        :func:`llmc.engine.torch.fused_triton.rope_write_kv` does after :meth:`forward`, one kernel fewer per layer
        and step): ``x [T, H]`` (or a pending norm, as :meth:`forward` takes), tables ``cos, sin [T, 1, hd]``
        (:func:`llmc.engine.torch.rope.rope_cos_sin`), caches ``[blocks, block_size, nkv, hd]``, ``slot_mapping [T]``
        int64 -> rotated queries ``[T, nh, hd]``. None where it does not apply (no ``rope_head``, prefill-sized
        steps, a cache not of ``x``'s dtype, or ``LLMC_ROPE_EPILOGUE=0``): the caller then runs the two steps. The
        epilogue writes 16 bits (an fp8 store in it changed every kernel's code, 4 % slower at 64 rows on an H100),
        so the rope kernel stores an fp8 cache."""
        m, hd = x.shape[0], self.rope_head
        dtype = x.scaled.dtype if isinstance(x, PendingNorm) else x.dtype
        if (not hd or m == 0 or m >= self.dense_from_m or k_cache.dtype != dtype
                or k_cache.shape[-1] != hd
                or (num_heads + 2 * num_kv_heads) * hd != self.columns or not rope_epilogue_enabled()):
            return None
        norm = x if isinstance(x, PendingNorm) and pending_norm.takes_input_norm(self, x) else None
        x = cuda_ext.aligned_rows(x.scaled if norm is not None else pending_norm.materialized(x))
        q = torch.empty(m, num_heads, hd, dtype=x.dtype, device=x.device)
        config = self.mma_config_for(m)
        cuda_ext.w4a16_mma_rope(x, self.words, self.scales, self.prequant, self.columns, self.in_features,
                                self.group_size, config, cos.reshape(m, hd), sin.reshape(m, hd), slot_mapping,
                                q.view(m, num_heads * hd), k_cache, v_cache, num_heads, num_kv_heads,
                                **self._split_buffers(config, m),
                                **(pending_norm.kernel_args(norm) if norm is not None else {}))
        return q

    def add_residual(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> PendingNorm | None:
        """``h += x @ W^T`` in place in the product's epilogue, with the RMSNorm (``weight``, ``eps``) that follows
        left pending for the next layer (:mod:`llmc.engine.torch.pending_norm`); None where that does not apply."""
        return pending_norm.add_residual(self, x, h, weight, eps)

    def matmul(self, x: torch.Tensor, config: KernelConfig) -> torch.Tensor:
        """The int4 kernel with an explicit config (the tuning script calls this)."""
        assert x.stride(-1) == 1 and x.shape[-1] == self.in_features
        m, n = x.shape[0], self.columns
        y = torch.empty(m, self.out_features, dtype=x.dtype, device=x.device)
        if m == 0:
            return y
        magic, offset = MAGIC[x.dtype]
        grid = config.grid(m, n)
        num_tiles = -(-self.in_features // TILE)
        per_split = -(-num_tiles // config.split_k)
        partials = self.scratch.buffer("partials", config.workspace(m, n))
        counters = self.scratch.buffer("counters", grid[0] * grid[1] if config.split_k > 1 else 0)
        even_tiles = num_tiles % config.split_k == 0 and per_split % config.unroll == 0
        _kernels().w4a16_matmul[grid](
            x, self.words, self.scales, self.prequant if self.prequant is not None else self.scales, y, partials,
            counters, m, n, self.in_features, num_tiles, per_split, grid[1] * config.block_m, x.stride(0),
            y.stride(0),
            GROUP=self.group_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n, UNROLL=config.unroll,
            SPLIT_K=config.split_k,
            CDTYPE=_TL_DTYPES()[x.dtype], MAGIC_BITS=magic, OFFSET=offset, HAS_PREQUANT=self.prequant is not None,
            SILU_OUT=self.silu_output, DOT_F32=triton_support.interpreting(),
            EVEN_K=self.in_features % TILE == 0 and even_tiles, EVEN_N=n % config.block_n == 0,
            EVEN_TILES=even_tiles,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return y

    def dequantize(self, out: torch.Tensor) -> torch.Tensor:
        """The effective weight ``[K, N]`` (q * scale * prequant; N = the weight's columns) written into ``out``."""
        k, n = self.in_features, self.columns
        if self.backend == "mma":  # columns in their own order; fc + gate come out as [fc | gate]
            cuda_ext.w4a16_mma_dequant(self.words, self.scales, self.prequant, out, n, k, self.group_size,
                                       self.period)
            return out
        block_n = 128
        _kernels().w4a16_dequant[(-(-n // block_n), -(-k // TILE))](
            self.words, self.scales, self.prequant if self.prequant is not None else self.scales, out, n, k,
            GROUP=self.group_size, BLOCK_N=block_n, HAS_PREQUANT=self.prequant is not None, num_warps=4,
        )
        return out

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense_weight is None:  # the shared scratch is made once: its view is this layer's for good
            self._dense_weight = self.scratch.dense_view(self.in_features, self.columns)
        weight = self.dequantize(self._dense_weight)  # [K, N]
        y = torch.mm(x, weight)
        return silu_mul(y, interleaved=self.backend == "triton") if self.silu_output else y


def silu_mul(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``silu(fc) * gate`` for ``x [T, 2W]`` holding ``[fc | gate]`` (or fc and gate in the even and odd columns
    when ``interleaved``) in one pass (Triton)."""
    rows, width = x.shape[0], x.shape[1] // 2
    y = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        block = 1024
        _kernels().silu_mul[(rows, -(-width // block))](x, y, width, x.stride(0), y.stride(0), BLOCK=block,
                                                        **triton_support.pdl_kwargs(x.device),
                                                        INTERLEAVED=interleaved)
    return y


def _kernels():
    """The Triton kernel module, imported on first use (Triton is an optional dependency)."""
    return importlib.import_module("llmc.engine.torch.int4_triton")


@functools.cache
def _TL_DTYPES() -> dict[torch.dtype, object]:  # noqa: N802 - a constant built on first use (Triton is lazy)
    _, tl = triton_support.modules()
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

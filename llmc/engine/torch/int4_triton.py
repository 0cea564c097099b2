"""W4A16 Triton kernels for CUDA: the int4 matmul of decode steps and the dequantization of prefill steps.

Packed layout (made once at load by :func:`llmc.engine.torch.int4_layout.pack_for_cuda` from the IR's
``[O/2, K]`` bytes): ``words`` int32 ``[Kp / 8, N]`` with ``Kp`` = K rounded up to a multiple of 128. Input
features are taken in tiles of 128 = 8 chunks of 16; word ``16 t + i`` of column ``n`` holds, in its nibble ``j``
(bits ``4j .. 4j + 3``), the weight of input ``128 t + 16 j + i`` as ``u = q + 8`` (offset binary, 0 .. 15). Pad
inputs (``K <= k < Kp``) hold ``u = 8`` (q = 0). Scales are ``[K / g, N]`` in the activations' dtype.

Why this layout: chunk ``j`` of a tile is a plain shift of every word, and it multiplies a *contiguous* slice of
16 inputs, so a tile is 8 tensor-core dots of ``[BLOCK_M, 16] x [16, BLOCK_N]`` with no register shuffles.
A nibble becomes a 16-bit float with two integer ops: ``u | 0x4300`` read as bfloat16 is ``128 + u`` exactly
(``u | 0x6400`` as float16 is ``1024 + u``), i.e. ``q + OFFSET`` with OFFSET 136 (1032). The kernel sums
``x . (q + OFFSET)`` per group with fp32 accumulation and subtracts ``OFFSET * sum(x)``, then multiplies by the
group's scale: ``y = sum_g s_g (x_g . q_g)``, the W4A16_AWQ product without rounding the dequantized weight.

Fused into the kernel (so they need no pass over memory of their own):
- ``HAS_PREQUANT``: the input load multiplies ``x * prequant`` (AWQ's per-input scale, where the loader could not
  fold it into a norm weight);
- ``SILU_OUT``: the MLP's fc and gate layers are one weight with interleaved columns (``2n`` = fc row ``n``,
  ``2n + 1`` = gate row ``n``), and the epilogue writes ``silu(fc) * gate`` ``[M, N / 2]`` from the float32 sums.
"""

from __future__ import annotations

# Imported only where Triton is installed (through llmc.engine.torch.int4_cuda); kernels must live at module level
# so that Triton's compiler (and its interpreter) resolve the helper they call by name.
import triton
import triton.language as tl


@triton.jit
def _input_chunk(x_rows, pq_ptr, k, K, HAS_PREQUANT: tl.constexpr, CDTYPE: tl.constexpr, EVEN_K: tl.constexpr):
    """x[rows, k] for one chunk of 16 inputs -> [BLOCK_M, 16] in the compute dtype (zeros past K).

    Rows past M were clamped to the last row by the caller: they load real data (no mask needed) and are never
    stored. With EVEN_K (K a multiple of 128) no input is past K either, and the loads are unmasked.
    """
    if EVEN_K:
        x = tl.load(x_rows + k[None, :])
    else:
        x = tl.load(x_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
    if not HAS_PREQUANT:
        return x
    pq = tl.load(pq_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    return (x.to(tl.float32) * pq[None, :]).to(CDTYPE)


@triton.jit
def _store_output(y_ptr, acc, rm, pid_n, m_ok, N, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SILU_OUT: tl.constexpr):
    """Store a [BLOCK_M, BLOCK_N] float32 block; with SILU_OUT, silu(even column) * odd column -> BLOCK_N / 2."""
    if SILU_OUT:
        fc, gate = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        h = fc * tl.sigmoid(fc) * gate  # [BLOCK_M, BLOCK_N / 2]
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(out, h.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (cols < N // 2)[None, :])
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count of a bucket
def w4a16_matmul(
    x_ptr, w_ptr, s_ptr, pq_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, num_tiles, tiles_per_split, m_ws, stride_xm, stride_ym,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    SPLIT_K: tl.constexpr, CDTYPE: tl.constexpr, MAGIC_BITS: tl.constexpr, OFFSET: tl.constexpr,
    HAS_PREQUANT: tl.constexpr, SILU_OUT: tl.constexpr, DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_TILES: tl.constexpr,
):
    """y[M, N] = x'[M, K] @ W[K, N] (y[M, N / 2] with SILU_OUT; see the module docstring); ``num_tiles`` =
    cdiv(K, 128); grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K).

    Split-K: program ``(n, m, s)`` sums the tiles ``[s * tiles_per_split, (s + 1) * tiles_per_split)`` and stores
    its float32 partial in ``ws [SPLIT_K, m_ws, N]``; the last of the SPLIT_K programs of an output block to
    arrive (a counter in ``cnt``, reset by that program for the next launch) adds the partials in split order (the
    result does not depend on which program finished last) and writes y. Few output blocks then still keep
    every multiprocessor reading: a decode step's narrow layers have too few for one program per block.

    CDTYPE is the activations' dtype; MAGIC_BITS 0 means float32 activations (nibbles converted directly).
    EVEN_TILES: the splits cover whole UNROLL steps; EVEN_K: also K % 128 == 0; EVEN_N: N % BLOCK_N == 0. Each
    drops a mask from the loads of the hot loop (masks cost selects and compares per chunk).
    """
    CHUNKS_PER_GROUP: tl.constexpr = GROUP // 16
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, 16)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1], rows past M clamped
    num_groups = K // GROUP
    ones = tl.full((16, BLOCK_N), 1.0, CDTYPE)
    # tl.full, not tl.zeros: in a process where torch loaded Triton first, the interpreter (CPU tests) runs
    # tl.zeros as an uncompiled @jit function and fails; the compiled code is the same.
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for t0 in range(t_begin, t_end, UNROLL):
        for u in tl.static_range(UNROLL):
            tile = t0 + u
            word = tile * 16 + ri  # [16] word rows of this tile (past the last tile when UNROLL overshoots)
            if EVEN_N and EVEN_TILES:
                words = tl.load(w_ptr + word[:, None] * N + rn[None, :])  # [16, BLOCK_N] int32
            else:  # a tile past this split's end reads q = 0 (u = 8 in every nibble) and a zero scale
                words = tl.load(w_ptr + word[:, None] * N + rn[None, :],
                                mask=(word < t_end * 16)[:, None] & n_ok[None, :], other=-2004318072)
            part = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # x . (q + OFFSET) over the group so far
            xsum = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # x . 1: each row's sum, in every column
            for j in tl.static_range(8):
                k = tile * 128 + j * 16 + ri  # [16] input features of chunk j
                x = _input_chunk(x_rows, pq_ptr, k, K, HAS_PREQUANT, CDTYPE, EVEN_K)
                if MAGIC_BITS == 0:
                    w = ((words >> (4 * j)) & 0xF).to(tl.float32)
                else:  # u | magic = q + OFFSET, exact
                    w = (((words >> (4 * j)) & 0xF) | MAGIC_BITS).to(tl.int16).to(CDTYPE, bitcast=True)
                # Row sums from the tensor cores too (a dot with ones): a tl.sum here is a cross-thread
                # reduction with shuffles and barriers in every chunk.
                if DOT_F32 or MAGIC_BITS == 0:
                    part += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                    xsum += tl.dot(x.to(tl.float32), ones.to(tl.float32), input_precision="ieee")
                else:
                    part += tl.dot(x, w)
                    xsum += tl.dot(x, ones)
                if (j + 1) % CHUNKS_PER_GROUP == 0:  # a group ends with this chunk: scale its sum
                    g = (tile * 128 + (j + 1 - CHUNKS_PER_GROUP) * 16) // GROUP
                    if EVEN_N and EVEN_K:  # every group of every tile is real
                        s = tl.load(s_ptr + g * N + rn).to(tl.float32)
                    else:
                        g_ok = (g + 0 * rn) < tl.minimum(num_groups, t_end * 128 // GROUP)  # [BLOCK_N] block-shaped
                        s = tl.load(s_ptr + g * N + rn, mask=n_ok & g_ok, other=0.0).to(tl.float32)
                    acc += (part - OFFSET * xsum) * s[None, :]
                    part = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
                    xsum = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if SPLIT_K == 1:
        _store_output(y_ptr, acc, rm, pid_n, m_ok, N, stride_ym, BLOCK_M, BLOCK_N, SILU_OUT)
    else:
        part_ptr = ws_ptr + (pid_k * m_ws + rm).to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(part_ptr, acc, mask=n_ok[None, :])
        block = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel")  # release: the partial is visible first
        if arrived == SPLIT_K - 1:  # the last split of this output block: sum all partials, in split order
            total = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + (s * m_ws + rm).to(tl.int64)[:, None] * N + rn[None, :],
                                 mask=n_ok[None, :], other=0.0, cache_modifier=".cg")
            _store_output(y_ptr, total, rm, pid_n, m_ok, N, stride_ym, BLOCK_M, BLOCK_N, SILU_OUT)
            tl.atomic_xchg(cnt_ptr + block, 0)  # ready for the next launch (stream order: none is running)


@triton.jit
def w4a16_dequant(
    w_ptr, s_ptr, pq_ptr, out_ptr, N, K,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PREQUANT: tl.constexpr,
):
    """out[K, N] = q * scale (* prequant[k]) in out's dtype; grid (cdiv(N, BLOCK_N), cdiv(K, 128))."""
    tile = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, 16)
    n_ok = rn < N
    words = tl.load(w_ptr + (tile * 16 + ri)[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0)
    for j in tl.static_range(8):
        k = tile * 128 + j * 16 + ri  # [16]
        k_ok = k < K
        s = tl.load(s_ptr + (k // GROUP)[:, None] * N + rn[None, :], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)  # [16, BLOCK_N]
        w = (((words >> (4 * j)) & 0xF) - 8).to(tl.float32) * s
        if HAS_PREQUANT:
            w = w * tl.load(pq_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + k.to(tl.int64)[:, None] * N + rn[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=k_ok[:, None] & n_ok[None, :])

@triton.jit
def silu_mul(x_ptr, y_ptr, width, stride_xm, stride_ym, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
             PDL: tl.constexpr):
    """y[m, :] = silu(fc) * gate with fc, gate = x[m, :width], x[m, width:] (or the even and odd columns of
    x[m, :2 width] when INTERLEAVED); grid (rows, cdiv(width, BLOCK)). PDL: launched while the previous kernel
    runs (see ``triton_support.pdl_launch``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    if INTERLEAVED:
        a = tl.load(x_ptr + row * stride_xm + 2 * cols, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * stride_xm + 2 * cols + 1, mask=ok, other=0.0).to(tl.float32)
    else:
        a = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * stride_xm + width + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, (a * tl.sigmoid(a) * b).to(y_ptr.dtype.element_ty), mask=ok)

"""W4A16 Triton kernels for CUDA: the int4 matmul of decode steps and the dequantization of prefill steps.

Packed layout (made once at load by :func:`llmc.engine.torch.int4_cuda.pack_for_cuda` from the IR's
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

``x`` may be transformed in the kernel's input load (so it needs no separate pass over memory):
- ``HAS_PREQUANT``: ``x * prequant`` (AWQ's per-input scale, where it could not be folded into a norm weight);
- ``SILU_GATE``: ``x`` is ``[M, 2K]`` = ``[fc | gate]`` and the kernel reads ``silu(fc) * gate`` (the MLP's
  down projection reads the fused fc + gate output directly).
"""

from __future__ import annotations

# Imported only where Triton is installed (through llmc.engine.torch.int4_cuda); kernels must live at module level
# so that Triton's compiler (and its interpreter) resolve the helper they call by name.
import triton
import triton.language as tl


@triton.jit
def _input_chunk(x_rows, pq_ptr, k, K, gate_off,
                 HAS_PREQUANT: tl.constexpr, SILU_GATE: tl.constexpr, CDTYPE: tl.constexpr, EVEN_K: tl.constexpr):
    """x[rows, k] for one chunk of 16 inputs -> [BLOCK_M, 16] in the compute dtype (zeros past K).

    Rows past M were clamped to the last row by the caller: they load real data (no mask needed) and are never
    stored. With EVEN_K (K a multiple of 128) no input is past K either, and the loads are unmasked.
    """
    if EVEN_K:
        x = tl.load(x_rows + k[None, :])
    else:
        x = tl.load(x_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
    if not SILU_GATE and not HAS_PREQUANT:
        return x
    x = x.to(tl.float32)
    if SILU_GATE:
        if EVEN_K:
            gate = tl.load(x_rows + gate_off + k[None, :]).to(tl.float32)
        else:
            gate = tl.load(x_rows + gate_off + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
        x = x * tl.sigmoid(x) * gate
    if HAS_PREQUANT:
        x = x * tl.load(pq_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    return x.to(CDTYPE)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count of a bucket
def w4a16_matmul(
    x_ptr, w_ptr, s_ptr, pq_ptr, y_ptr, M, N, K, num_tiles, stride_xm, stride_ym, gate_off,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    CDTYPE: tl.constexpr, MAGIC_BITS: tl.constexpr, OFFSET: tl.constexpr,
    HAS_PREQUANT: tl.constexpr, SILU_GATE: tl.constexpr, DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_TILES: tl.constexpr,
):
    """y[M, N] = x'[M, K] @ W[K, N] (see the module docstring); ``num_tiles`` = cdiv(K, 128);
    grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)).

    CDTYPE is the activations' dtype; MAGIC_BITS 0 means float32 activations (nibbles converted directly).
    EVEN_K: K % 128 == 0 and no overshooting tile (EVEN_TILES); EVEN_N: N % BLOCK_N == 0; EVEN_TILES: num_tiles % UNROLL == 0. Each drops a mask
    from the loads of the hot loop (masks cost selects and compares per chunk).
    """
    CHUNKS_PER_GROUP: tl.constexpr = GROUP // 16
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, 16)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1], rows past M clamped
    num_groups = K // GROUP
    ones = tl.full((16, BLOCK_N), 1.0, CDTYPE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t0 in range(0, num_tiles, UNROLL):
        for u in tl.static_range(UNROLL):
            tile = t0 + u
            word = tile * 16 + ri  # [16] word rows of this tile (past the last tile when UNROLL overshoots)
            if EVEN_N and EVEN_TILES:
                words = tl.load(w_ptr + word[:, None] * N + rn[None, :])  # [16, BLOCK_N] int32
            else:
                words = tl.load(w_ptr + word[:, None] * N + rn[None, :],
                                mask=(word < num_tiles * 16)[:, None] & n_ok[None, :], other=0)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x . (q + OFFSET) over the group so far
            xsum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x . 1: each row's sum, in every column
            for j in tl.static_range(8):
                k = tile * 128 + j * 16 + ri  # [16] input features of chunk j
                x = _input_chunk(x_rows, pq_ptr, k, K, gate_off, HAS_PREQUANT, SILU_GATE, CDTYPE, EVEN_K)
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
                        g_ok = (g + 0 * rn) < num_groups  # [BLOCK_N] (the interpreter's masks must be block-shaped)
                        s = tl.load(s_ptr + g * N + rn, mask=n_ok & g_ok, other=0.0).to(tl.float32)
                    acc += (part - OFFSET * xsum) * s[None, :]
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    xsum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    out = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


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
def silu_mul(x_ptr, y_ptr, width, stride_xm, stride_ym, BLOCK: tl.constexpr):
    """y[m, :] = silu(x[m, :width]) * x[m, width:2 width]; grid (rows, cdiv(width, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    a = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_xm + width + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, (a * tl.sigmoid(a) * b).to(y_ptr.dtype.element_ty), mask=ok)


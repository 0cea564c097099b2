"""Top-p (nucleus) filtering without a sort, in Triton: the sampler's path on CUDA for steps where no row has a top-k.

A full GPU sort of each row is what the sampler's general path does; at 64 rows of 128,256 ids it took 706 us on an
H100 (68 us at one row). The nucleus only needs one number per row, its cutoff: the smallest value ``v`` in the row
with ``G(v) < top_p * Z``, where ``G(v)`` is the mass (``sum exp``) of the values strictly above ``v`` and ``Z`` the
row's whole mass. That is where a descending sort's cut falls (keep while the mass before a token is below
``top_p``; ties with the last kept value survive), computed without ordering anything: a search over the values'
bit patterns, 16 thresholds a pass (4 bits), 8 passes for all of float32, each pass one launch over ``S x P``
programs (every row split into ``P`` slices), each program summing its slice's mass above the pass's thresholds.
A pass narrows the interval from the previous pass's sums; the last launch writes the filtered row. Two compiles
(the passes, the last launch): the CUDA warm-up runs a top-p step, so no request pays them.

Cost (H100, 128,256 ids, GPU time of the launches in a CUDA graph, 2026-12-06): 72-74 / 79-80 / 334-339 us at 1 / 8 / 64
rows. The passes are bound by their compares at many rows: 16 thresholds x 8 passes (128 compares an id) took 337 us at
64 rows where 32 x 7 (224) took 575-586; int32 keys instead of int64 took the 32-threshold form from 652 to 575 us
(both with one accumulator per (id, threshold), summed once per program; the form before, int64 with a sum across
threads every iteration: 861 us a call, wall, another H100 the session before). Skipping the compares of blocks with
no id inside the pass's interval was slower (366-516 us).

Same cut as :func:`llmc.engine.torch.sampler._cut_sorted` up to the rounding of the mass sums (their order
differs from a sorted cumulative sum's): a token whose mass-before is within float32 rounding of ``top_p`` may
fall on the other side. Imported only where Triton is installed; runs in Triton's interpreter on CPU in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NT = 16  # thresholds a pass
PASSES = 8  # 16 ** 8 = 2 ** 32: every float32 key
SLICES = 32  # programs a row
BLOCK = 256
_KEY_LO = -0x7F800000 - 1  # below -inf: the mass above it is the row's
_KEY_HI = 0x7F800000  # +inf: nothing above it


@triton.jit
def _key(x):
    """float32 -> int32, monotone: -x's bit pattern negated for negatives, so -0.0 and 0.0 share key 0 (every key,
    -inf's -0x7F800000 included, and the search's bounds KEY_LO / KEY_HI fit in int32)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


@triton.jit(do_not_specialize=["PASS"])
def _pass_kernel(x_ptr, out_ptr, top_p_ptr, keys_ptr, z_ptr, part_ptr, S, V, stride_x, stride_o, slice_len, PASS,
                 FINAL: tl.constexpr, KEY_LO: tl.constexpr, KEY_HI: tl.constexpr, NT: tl.constexpr,
                 P: tl.constexpr, BLOCK: tl.constexpr):
    """One pass (``PASS`` a runtime value: one compile for the seven) or, with ``FINAL``, the filtered rows."""
    row = tl.program_id(0).to(tl.int64)
    prog = tl.program_id(1)
    j = tl.arange(0, NT)
    top_p = tl.load(top_p_ptr + row)
    if PASS == 0:
        lo = tl.full((), KEY_LO, tl.int64)
        hi = tl.full((), KEY_HI, tl.int64)
    else:  # the previous pass's interval and its sums -> this pass's interval (every program alike)
        lo = tl.load(keys_ptr + ((PASS - 1) * S + row) * 2)
        hi = tl.load(keys_ptr + ((PASS - 1) * S + row) * 2 + 1)
        base = ((PASS - 1) * S + row) * P * NT
        masses = tl.sum(tl.load(part_ptr + base + tl.arange(0, P)[:, None] * NT + j[None, :]), axis=0)  # [NT]
        if PASS == 1:  # threshold 0 of pass 0 is below every value: the row's mass
            z = tl.sum(tl.where(j == 0, masses, 0.0), axis=0)
            if prog == 0:
                tl.store(z_ptr + row, z)
        else:
            z = tl.load(z_ptr + row)
        t = lo + (hi - lo) * j // NT
        below = (masses >= top_p * z) | (j == 0)  # mass above t_j reaches the nucleus: t_j is below the cut
        jf = tl.max(tl.where(below, j, 0), axis=0)
        new_lo = tl.sum(tl.where(j == jf, t, 0), axis=0)
        hi = tl.where(jf + 1 < NT, tl.sum(tl.where(j == jf + 1, t, 0), axis=0), hi)
        lo = new_lo
    start = prog * slice_len
    if FINAL:  # keep the values at or above the cut (rows with top_p >= 1: everything)
        cut = tl.where(top_p >= 1.0, KEY_LO, hi)
        for off in range(0, slice_len, BLOCK):
            cols = start + off + tl.arange(0, BLOCK)
            ok = (cols < V) & (cols < start + slice_len)
            x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf"))
            tl.store(out_ptr + row * stride_o + cols, tl.where(_key(x) >= cut, x, float("-inf")), mask=ok)
    else:
        if prog == 0:
            tl.store(keys_ptr + (PASS * S + row) * 2, lo)
            tl.store(keys_ptr + (PASS * S + row) * 2 + 1, hi)
        # Every key and threshold fits in int32 (the compares' cost); one accumulator per (column, threshold), summed
        # once at the end rather than across the program's threads every iteration.
        t = (lo + (hi - lo) * j // NT).to(tl.int32)
        acc = tl.zeros([BLOCK, NT], tl.float32)
        for off in range(0, slice_len, BLOCK):
            cols = start + off + tl.arange(0, BLOCK)
            ok = (cols < V) & (cols < start + slice_len)
            x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf"))
            w = tl.where(ok, tl.exp(x), 0.0)
            acc += tl.where(_key(x)[:, None] > t[None, :], w[:, None], 0.0)
        tl.store(part_ptr + ((PASS * S + row) * P + prog) * NT + j, tl.sum(acc, axis=0))


def top_p_filter(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled [S, V]`` float32 (rows contiguous, values <= 0, no NaN: the sampler's shifted log-probabilities),
    ``top_p [S]`` or ``[S, 1]`` float32 on the same device -> ``scaled`` with -inf below each row's nucleus."""
    assert scaled.dim() == 2 and scaled.dtype == torch.float32 and scaled.stride(1) == 1
    rows, vocab = scaled.shape
    out = torch.empty_like(scaled)
    if rows == 0 or vocab == 0:
        return out
    top_p = top_p.reshape(rows).to(torch.float32).contiguous()
    keys = torch.empty(PASSES, rows, 2, dtype=torch.int64, device=scaled.device)
    z = torch.empty(rows, dtype=torch.float32, device=scaled.device)
    part = torch.empty(PASSES, rows, SLICES, NT, dtype=torch.float32, device=scaled.device)
    slice_len = triton.cdiv(triton.cdiv(vocab, SLICES), BLOCK) * BLOCK
    for p in range(PASSES + 1):
        _pass_kernel[(rows, SLICES)](scaled, out, top_p, keys, z, part, rows, vocab, scaled.stride(0), out.stride(0),
                                     slice_len, p, FINAL=p == PASSES, KEY_LO=_KEY_LO, KEY_HI=_KEY_HI, NT=NT,
                                     P=SLICES, BLOCK=BLOCK)
    return out

"""Fused elementwise ops of the CUDA decode step, as Triton kernels (one launch and one pass each).

- :func:`add_rms_norm_`: ``h += a`` (the residual add, in place) then ``RMSNorm(h) * weight``;
- :func:`rms_norm`: the same without the add (the first layer's input norm);
- :func:`rope_write_kv`: RoPE on the q and k heads of a fused qkv output, k and v written to their paged-cache
  slots, rotated q returned (Qwen2's qkv bias and Qwen3's per-head q / k norms applied first, in the same kernel).

Numerics follow the reference ops of :mod:`llmc.engine.torch.model` (transformers' order of roundings): the
residual sum is rounded to the activations' dtype, the norm is computed in float32 from that rounded sum and
rounded before the weight multiply. RoPE is computed in float32 from the 16-bit tables as ``fma(x, cos, x_rot * sin)``
and rounded once (the reference rounds after each of its three ops), a difference within one rounding of the result;
the int4 qkv layers' RoPE epilogue on CUDA computes the same ops, so both give the same bits.

Imported only where Triton is installed (:mod:`llmc.engine.torch.model` asks :func:`available` first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmc.engine.torch.triton_support import early_launch, pdl_kwargs, pow2_at_least


@triton.jit
def _add_rms_norm_kernel(h_ptr, a_ptr, w_ptr, out_ptr, H, stride_h, stride_a, stride_o, eps,
                         HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, EARLY_LAUNCH: tl.constexpr,
                         PDL: tl.constexpr):
    """One row per program: (h += a); out = w * round(h * rsqrt(mean(h^2) + eps))."""
    if EARLY_LAUNCH:  # the kernel after this one may launch (an int4 kernel starts loading its weights); it waits
        tl.extra.cuda.gdc_launch_dependents()  # for our output
    if PDL:  # launched while the previous kernel runs: wait for it before touching memory
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0)
    if HAS_ADD:
        a = tl.load(a_ptr + row * stride_a + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + a.to(tl.float32)).to(h_ptr.dtype.element_ty)  # the residual stream's rounding
        tl.store(h_ptr + row * stride_h + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / H + eps)
    normed = (x32 * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _heads(row, bias_ptr, norm_ptr, eps, h, ok, d, rot, HD: tl.constexpr, HAS_BIAS: tl.constexpr,
           HAS_NORM: tl.constexpr):
    """Heads ``h`` of one token's qkv row (the q part, or the k part with ``row`` and ``bias_ptr`` advanced to it),
    and each element's NeoX partner, in float32: the bias added and the head RMS-normed first where asked, rounded
    to the activations' dtype after each op as the reference (``qkv + bias``, then :class:`RMSNorm`) rounds."""
    x = tl.load(row + h * HD + d[None, :], mask=ok, other=0.0)
    xr = tl.load(row + h * HD + rot[None, :], mask=ok, other=0.0)
    act = x.dtype
    if HAS_BIAS:
        x = (x.to(tl.float32) + tl.load(bias_ptr + h * HD + d[None, :], mask=ok, other=0.0).to(tl.float32)).to(act)
        xr = (xr.to(tl.float32) + tl.load(bias_ptr + h * HD + rot[None, :], mask=ok, other=0.0).to(tl.float32)).to(act)
    x, xr = x.to(tl.float32), xr.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HD + eps)[:, None]  # one per head
        w, wr = tl.load(norm_ptr + d).to(tl.float32)[None, :], tl.load(norm_ptr + rot).to(tl.float32)[None, :]
        x = ((x * rstd).to(act).to(tl.float32) * w).to(act).to(tl.float32)
        xr = ((xr * rstd).to(act).to(tl.float32) * wr).to(act).to(tl.float32)
    return x, xr


@triton.jit
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_out_ptr,
                    bias_ptr, q_norm_ptr, k_norm_ptr, eps, inv_kv_scale,
                    stride_qkv, stride_cs, stride_q, stride_slot, stride_k_out, NH, NKV,
                    HD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, HAS_K_OUT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """One token per program: rotate its q heads (stored to q) and k heads (stored at the token's cache slot,
    and to ``k_out`` when given), copy its v heads to the cache. The cache is ``[slots, NKV, HD]`` (flattened
    blocks). ``HAS_BIAS``: q, k and v get the qkv bias first (Qwen2); ``HAS_NORM``: each q and k head is
    RMS-normed (``q_norm`` / ``k_norm`` weights ``[HD]``, Qwen3) before the rotation. ``FP8``: the cache holds k
    and v times ``inv_kv_scale``, clamped to e4m3's range and rounded to nearest (``kv_store.to_cache``)."""
    if PDL:  # launched while the previous kernel runs: the next may launch now, and we wait for the previous one
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HD)
    rot = (d + HD // 2) % HD  # NeoX halves: x_rot = cat(x2, x1); the table's sin has its first half negated
    cos = tl.load(cos_ptr + t * stride_cs + d).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_cs + d).to(tl.float32)[None, :]
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)  # a column of the CUDA graphs' static rows: strided
    row = qkv_ptr + t * stride_qkv

    h = tl.arange(0, BLOCK_H)[:, None]  # q heads
    ok = h < NH
    x, xr = _heads(row, bias_ptr, q_norm_ptr, eps, h, ok, d, rot, HD, HAS_BIAS, HAS_NORM)
    q = tl.fma(x, cos, xr * sin)  # one fma, as the int4 qkv layers' RoPE epilogue (csrc_cuda/w4a16_mma.cu) computes
    tl.store(q_ptr + t * stride_q + h * HD + d[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)

    g = tl.arange(0, BLOCK_KV)[:, None]  # kv heads
    ok = g < NKV
    k_row = row + NH * HD
    x, xr = _heads(k_row, bias_ptr + NH * HD, k_norm_ptr, eps, g, ok, d, rot, HD, HAS_BIAS, HAS_NORM)
    # Round like the reference: k is rotated in the activations' dtype, then stored in the cache's dtype.
    k = tl.fma(x, cos, xr * sin).to(qkv_ptr.dtype.element_ty)
    cache = slot * NKV * HD + g * HD + d[None, :]
    tl.store(k_cache_ptr + cache, _cached(k, inv_kv_scale, k_cache_ptr.dtype.element_ty, FP8), mask=ok)
    if HAS_K_OUT:
        tl.store(k_out_ptr + t * stride_k_out + g * HD + d[None, :], k, mask=ok)
    v = tl.load(k_row + NKV * HD + g * HD + d[None, :], mask=ok, other=0.0)
    if HAS_BIAS:
        b = tl.load(bias_ptr + (NH + NKV) * HD + g * HD + d[None, :], mask=ok, other=0.0)
        v = (v.to(tl.float32) + b.to(tl.float32)).to(qkv_ptr.dtype.element_ty)
    tl.store(v_cache_ptr + cache, _cached(v, inv_kv_scale, v_cache_ptr.dtype.element_ty, FP8), mask=ok)


@triton.jit
def _cached(x, inv_scale, dtype, FP8: tl.constexpr):
    """Keys or values (the activations' dtype) as the cache stores them."""
    if FP8:
        return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(dtype)
    return x.to(dtype)


def add_rms_norm_(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += a`` in place, then the RMSNorm of ``h`` times ``weight``; ``h, a [T, H]`` -> normed ``[T, H]``."""
    return _norm(h, a, weight, eps)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``h [T, H]`` times ``weight`` (the reference :class:`RMSNorm`'s roundings)."""
    return _norm(h, None, weight, eps)


def _norm(h: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert h.dim() == 2 and h.stride(-1) == 1 and (a is None or (a.shape == h.shape and a.stride(-1) == 1))
    out = torch.empty_like(h)
    rows, width = h.shape
    if rows:
        _add_rms_norm_kernel[(rows,)](h, a if a is not None else h, weight, out, width, h.stride(0),
                                     a.stride(0) if a is not None else 0, out.stride(0), eps,
                                     HAS_ADD=a is not None, BLOCK=pow2_at_least(width),
                                     EARLY_LAUNCH=early_launch(h.device), num_warps=4, **pdl_kwargs(h.device))
    return out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_size: int, return_k: bool = False, bias: torch.Tensor | None = None,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                  kv_scale: float = 1.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RoPE + KV-cache write of one step: ``qkv [T, (nh + 2 nkv) hd]``, tables ``cos, sin [T, 1, hd]`` (from
    :func:`llmc.engine.torch.rope.rope_cos_sin`), caches ``[blocks, block_size, nkv, hd]``, ``slot_mapping [T]``.
    Returns the rotated queries ``[T, nh, hd]``; with ``return_k`` also the rotated keys ``[T, nkv, hd]`` in the
    activations' dtype (what a fresh prompt's attention reads, instead of gathering them back from the cache).
    ``bias [(nh + 2 nkv) hd]`` (Qwen2) is added to q, k and v first; ``q_norm, k_norm [hd]`` (Qwen3, both or
    neither) RMS-norm each q and k head (``eps``) before the rotation: what the model's reference path does in
    separate ops, in this one kernel. An fp8 cache gets k and v divided by ``kv_scale``
    (:func:`llmc.engine.torch.kv_store.to_cache`)."""
    assert (q_norm is None) == (k_norm is None), "q_norm and k_norm come together"
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_size, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, num_kv_heads, head_size, dtype=qkv.dtype, device=qkv.device) if return_k else q
    if t:
        assert qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
        cos2, sin2 = cos.reshape(t, head_size), sin.reshape(t, head_size)
        _rope_kv_kernel[(t,)](qkv, cos2, sin2, q, k_cache, v_cache, slot_mapping, k,
                              qkv if bias is None else bias, qkv if q_norm is None else q_norm,
                              qkv if k_norm is None else k_norm, eps, 1.0 / kv_scale, qkv.stride(0), cos2.stride(0),
                              q.stride(0), slot_mapping.stride(0), k.stride(0), num_heads, num_kv_heads, HD=head_size,
                              BLOCK_H=pow2_at_least(num_heads), BLOCK_KV=pow2_at_least(num_kv_heads),
                              HAS_K_OUT=return_k, HAS_BIAS=bias is not None, HAS_NORM=q_norm is not None,
                              FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=4, **pdl_kwargs(qkv.device))
    return (q, k) if return_k else q

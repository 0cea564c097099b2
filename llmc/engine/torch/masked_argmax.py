"""Greedy choice under output-format masks in one Triton kernel: each row's first index of its largest logit among
the ids its bitmask allows (the sampler's fast path on CUDA for steps whose rows are all greedy and shaped by masks
alone: about 36 small PyTorch ops become one copy and one launch).

Same answer as the sampler's general path (:func:`llmc.engine.torch.sampler._apply_token_masks` then argmax): NaN
logits count as -inf, +inf as the largest float32, an allowed id at -inf as the lowest finite float32 (a row with an
allowed id never collapses), ids past the bitmask's ``32 * words`` are not allowed; a row that allows nothing gives
id 0, as ``argmax`` of an all -inf row does.

Imported only where Triton is installed; runs in Triton's interpreter on CPU tensors in the tests.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

_FLOAT_MAX = float(np.finfo(np.float32).max)
_NONE = 2 ** 31 - 1
BLOCK = 2048


@triton.jit
def _masked_argmax_kernel(logits_ptr, words_ptr, out_ptr, V, W, stride_l, stride_w, FLOAT_MAX: tl.constexpr,
                          NONE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.full([BLOCK], NONE, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(logits_ptr + row * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
        word = tl.load(words_ptr + row * stride_w + cols // 32, mask=ok & (cols // 32 < W), other=0)
        allowed = ((word >> (cols % 32)) & 1) != 0
        x = tl.where(x != x, -FLOAT_MAX, tl.minimum(tl.maximum(x, -FLOAT_MAX), FLOAT_MAX))  # finite
        x = tl.where(allowed & ok, x, float("-inf"))
        take = x > best  # each lane's columns rise: a tie keeps the earlier id
        best = tl.where(take, x, best)
        where = tl.where(take, cols, where)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, where, NONE), axis=0)
    tl.store(out_ptr + row, tl.where(first == NONE, 0, first).to(tl.int64))


def masked_argmax(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``logits [S, V]`` (float32, rows contiguous), ``words [S, W]`` int32 bitmasks on the same device (bit
    ``i % 32`` of word ``i // 32`` allows id ``i``; -1 words allow everything) -> int64 ``[S]``."""
    assert logits.dim() == 2 and words.shape[0] == logits.shape[0] and logits.stride(1) == 1
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        words = words.contiguous()
        _masked_argmax_kernel[(logits.shape[0],)](logits, words, out, logits.shape[1], words.shape[1],
                                                  logits.stride(0), words.stride(0), FLOAT_MAX=_FLOAT_MAX,
                                                  NONE=_NONE, BLOCK=BLOCK)
    return out

"""The masked greedy kernel (the sampler's CUDA fast path for greedy rows under output-format masks), against the
sampler's general path on CPU (mask applied by PyTorch ops, then argmax): in Triton's interpreter on CPU tensors
without a GPU, on the GPU where there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmc.engine.torch.sampler import Sampler
from llmc.request.params import SamplingParams
from tests.engine.torch.test_sampler_shaping import REGEX, mask_of, seq

pytest.importorskip("triton")

kernel = pytest.importorskip("llmc.engine.torch.masked_argmax").masked_argmax


def masked_argmax(logits: torch.Tensor, words: torch.Tensor, device: str) -> torch.Tensor:
    return kernel(logits.to(device), words.to(device)).cpu()


def general(logits: torch.Tensor, masks: list) -> list[int]:
    """The sampler's general path: every row greedy, masked where a mask is given."""
    seqs = [seq(SamplingParams(temperature=0.0, structured=REGEX if m is not None else None), m) for m in masks]
    return Sampler("cpu")(logits.clone(), seqs).tolist()


def words_of(masks: list, width: int) -> torch.Tensor:
    every = np.full(width, -1, dtype=np.int32)
    return torch.from_numpy(np.stack([m if m is not None else every for m in masks]))


@pytest.mark.parametrize("vocab", [5000, 4103, 49152])
def test_the_kernel_chooses_what_the_general_path_chooses(vocab, kernel_device):
    """Random logits with NaN, +inf and -inf sprinkled in, masks of a few to thousands of ids (some allowed ids at
    -inf or NaN), rows without a mask, a row whose mask allows nothing, ties (the first id wins)."""
    rng = np.random.default_rng(vocab)
    rows = 12
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32)).mul_(4)
    logits[torch.from_numpy(rng.random((rows, vocab)) < 0.02)] = float("nan")
    logits[torch.from_numpy(rng.random((rows, vocab)) < 0.02)] = float("-inf")
    logits[2, 17] = logits[2, 4000] = float("inf")  # +inf twice: the first id
    logits[3, :] = 1.0  # all tied: the first allowed id
    logits[4, :] = float("-inf")  # the allowed ids at -inf or NaN count as the lowest finite value
    logits[4, 10] = float("nan")
    some = [mask_of(rng.choice(vocab, size=n, replace=False).tolist(), vocab) for n in (3, 40, 900, 2000)]
    masks = [some[0], some[1], mask_of([17, 4000, 5], vocab), mask_of([300, 200, 4001], vocab),
             mask_of([10, 11], vocab), mask_of([vocab - 1, 3], vocab), mask_of([], vocab), None,
             mask_of(range(vocab), vocab), some[2], some[3], None]
    expected = general(logits, masks)
    words = words_of(masks, (vocab + 31) // 32)
    assert masked_argmax(logits, words, kernel_device).tolist() == expected
    assert expected[2] == 17 and expected[3] == 200 and expected[4] == 10 and expected[6] == 0


def test_ids_past_the_masks_words_are_not_allowed(kernel_device):
    vocab = 40  # a 32-bit mask word covers ids 0..31: ids 32..39 are never allowed, as in the general path
    logits = torch.zeros(2, vocab)
    logits[:, 35] = 10.0
    logits[:, 7] = 1.0
    masks = [mask_of([3, 7], 32), mask_of(range(32), 32)]
    assert masked_argmax(logits, words_of(masks, 1), kernel_device).tolist() == general(logits, masks) == [7, 7]


def test_no_rows_gives_no_ids(kernel_device):
    assert masked_argmax(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.int32), kernel_device).shape == (0,)

"""The sort-free top-p kernel (the sampler's CUDA path when no row has a top-k) against the sampler's sorted cut: in
Triton's interpreter on CPU tensors without a GPU, on the GPU where there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmc.engine.torch import sampler as sampler_mod
from llmc.request.params import SamplingParams
from tests.engine.torch.test_sampler import seq

pytest.importorskip("triton")

top_p_filter = pytest.importorskip("llmc.engine.torch.top_p_cut").top_p_filter


def sorted_cut(scaled: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """The sampler's general path: one descending sort of every row, cut by cumulative mass."""
    seqs = [seq(SamplingParams(temperature=1.0, top_p=p), rid=str(i)) for i, p in enumerate(top_p)]
    batch = sampler_mod._gather_params(seqs, torch.device("cpu"))
    return sampler_mod._cut_sorted(scaled, scaled.sort(dim=-1, descending=True).values, batch)


def kernel(scaled: torch.Tensor, top_p: list[float], device: str) -> torch.Tensor:
    return top_p_filter(scaled.to(device), torch.tensor(top_p, device=device)).cpu()


def test_the_kernel_cuts_where_a_sort_cuts(kernel_device):
    """Peaked and flat rows, rows with -inf entries (after min-p), bf16-rounded rows full of ties, a row that keeps
    only its maximum (and the values tied with it), a row with top_p 1 (unchanged), a collapsed row (all -inf); 4,103
    ids: two blocks a slice, the last slices short or empty."""
    vocab = 4103
    rng = np.random.default_rng(vocab)
    logits = torch.from_numpy(rng.standard_normal((8, vocab)).astype(np.float32))
    logits[0] *= 3.0
    logits[1] *= 0.05
    logits[2] *= 3.0
    logits[2, torch.from_numpy(rng.random(vocab) < 0.5)] = float("-inf")
    logits[3] = (logits[3] * 4).bfloat16().float()  # ties everywhere, at the cut too
    logits[4] = (logits[4] * 2).bfloat16().float()
    logits[5] *= 5.0
    logits[6] *= 5.0
    logits[7] = float("-inf")
    scaled = logits - logits.amax(dim=-1, keepdim=True).clamp_min(-torch.finfo(torch.float32).max)
    top_p = [0.9, 0.95, 0.5, 0.8, 0.3, 0.001, 1.0, 0.9]
    expected = sorted_cut(scaled, top_p)
    got = kernel(scaled, top_p, kernel_device)
    assert torch.equal(got, expected)
    kept = torch.isfinite(expected).sum(dim=-1).tolist()
    assert 1 < kept[0] < kept[1] and kept[6] == vocab and kept[7] == 0  # the cases are what they claim
    assert kept[5] == int((scaled[5] == 0).sum())  # only the maximum and its ties


def test_rows_of_every_length_and_empty_batches(kernel_device):
    """Vocabularies that fill no slice or block evenly, down to one id; an empty batch."""
    for vocab in (1, 33, 4097):
        scaled = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
        scaled -= scaled.amax(dim=-1, keepdim=True)
        assert torch.equal(kernel(scaled, [0.7, 0.99, 0.2], kernel_device), sorted_cut(scaled, [0.7, 0.99, 0.2]))
    assert kernel(torch.empty(0, 10), [], kernel_device).shape == (0, 10)

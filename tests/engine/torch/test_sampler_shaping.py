"""Sampler: output-format token masks (``ScheduledSequence.token_mask``) and ``logit_bias``."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from llmc.engine.torch.sampler import Sampler, token_logprobs
from llmc.engine.types import ScheduledSequence
from llmc.request.params import SamplingParams
from llmc.request.structured import OutputFormat

REGEX = OutputFormat("regex", "a")  # any format: the sampler only reads the mask


def mask_of(allowed, vocab: int) -> np.ndarray:
    """llguidance's layout, built by hand: bit i % 32 of int32 word i // 32 for each allowed id."""
    bits = np.zeros((vocab + 31) // 32 * 32, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def seq(params: SamplingParams, mask=None, output=(), rid="r") -> ScheduledSequence:
    return ScheduledSequence(request_id=rid, token_ids=(0,), num_computed=0, block_ids=(0,), sample=True,
                             params=params, output_token_ids=tuple(output), token_mask=mask)


def test_greedy_rows_take_the_best_allowed_token_and_unmasked_rows_are_untouched():
    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(4, vocab) * 3
    allowed = [[5, 700, 999], [0], [31, 32, 33, 64]]
    params = SamplingParams(temperature=0.0, structured=REGEX)
    seqs = [seq(params, mask_of(a, vocab)) for a in allowed] + [seq(SamplingParams(temperature=0.0))]
    out = Sampler("cpu")(logits.clone(), seqs).tolist()
    for row, ids in enumerate(allowed):
        assert out[row] == max(ids, key=lambda i: logits[row, i].item())
    assert out[3] == logits[3].argmax().item()


def test_sampled_rows_draw_only_allowed_tokens_in_their_relative_proportions():
    vocab, n = 64, 4000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1] + [0.0] * (vocab - 4)) + 1e-9).repeat(n, 1)
    allowed = [1, 2, 40]  # the format bans the most likely token (id 0)
    seqs = [seq(SamplingParams(temperature=1.0, seed=i, structured=REGEX), mask_of(allowed, vocab)) for i in range(n)]
    counts = Counter(Sampler("cpu", seed=0)(logits, seqs).tolist())
    assert set(counts) <= set(allowed) and counts[40] < n * 0.01
    assert counts[1] / n == pytest.approx(0.75, abs=0.03)  # 0.3 / (0.3 + 0.1), renormalised over the allowed ids


def test_ids_past_the_masks_words_are_not_allowed_and_a_collapsed_row_keeps_to_its_mask():
    vocab = 40  # a 32-bit mask word covers ids 0..31: ids 32..39 are never allowed
    logits = torch.zeros(2, vocab)
    logits[:, 35] = 10.0
    logits[1] = float("nan")  # a row whose distribution collapses falls back to the argmax of the masked logits
    params = SamplingParams(temperature=0.0, structured=REGEX)
    short_mask = mask_of([3, 7], 32)
    assert short_mask.shape == (1,)
    out = Sampler("cpu")(logits, [seq(params, short_mask), seq(params.replace(temperature=0.7), short_mask)])
    assert out[0].item() in (3, 7) and out[1].item() in (3, 7)


def test_min_tokens_cannot_push_a_row_outside_its_format():
    """The format allows only the end id, which min_tokens masks: the row collapses and still samples the end id
    (the constraint then ends the request)."""
    vocab = 50
    logits = torch.randn(1, vocab)
    params = SamplingParams(temperature=0.0, min_tokens=5, structured=REGEX)
    out = Sampler("cpu", eos_token_ids=[2])(logits, [seq(params, mask_of([2], vocab), output=(9,))])
    assert out.tolist() == [2]


def test_logit_bias_shifts_the_choice_and_bans_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    sampler = Sampler("cpu")
    greedy = SamplingParams(temperature=0.0)
    assert sampler(logits, [seq(greedy)]).tolist() == [0]
    assert sampler(logits, [seq(greedy.replace(logit_bias={"0": -100}))]).tolist() == [1]
    assert sampler(logits, [seq(greedy.replace(logit_bias={3: 2.5}))]).tolist() == [3]
    banned = SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100})
    counts = Counter(sampler(logits.repeat(500, 1), [seq(banned.replace(seed=i)) for i in range(500)]).tolist())
    assert set(counts) == {2, 3}
    assert torch.equal(logits, torch.tensor([[2.0, 1.0, 0.5, 0.0]]))  # the caller's logits are not modified


def test_rows_that_shape_their_logits_are_not_plain_greedy_and_logprobs_stay_the_models():
    sampler = Sampler("cpu")
    greedy = SamplingParams(temperature=0.0)
    assert sampler.plain_greedy([seq(greedy)])
    assert not sampler.plain_greedy([seq(greedy.replace(logit_bias={1: 1.0}))])
    assert not sampler.plain_greedy([seq(greedy.replace(structured={"type": "json_object"}), mask_of([1], 8))])
    assert not sampler.plain_greedy([seq(greedy, mask_of([1], 8))])  # a mask alone (the runner's warm-up gives one)
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    row = seq(SamplingParams(temperature=0.0, logprobs=1, structured=REGEX), mask_of([2], 4))
    token = sampler(logits, [row])
    lp = token_logprobs(logits, token, [row])
    assert token.tolist() == [2]
    assert lp.chosen.item() == pytest.approx(torch.log_softmax(logits, dim=-1)[0, 2].item())  # before the mask

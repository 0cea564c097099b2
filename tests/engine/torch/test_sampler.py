"""Sampler: greedy, filters, penalties, numerics, collapse fallback, seeded reproducibility, skipped work."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from llmc.engine.torch.penalties import apply_penalties
from llmc.engine.torch.sampler import Sampler, token_logprobs
from llmc.engine.types import ScheduledSequence
from llmc.request.params import SamplingParams


def seq(params: SamplingParams, prompt=(), output=(), rid="r") -> ScheduledSequence:
    return ScheduledSequence(request_id=rid, token_ids=(0,), num_computed=0, block_ids=(0,), sample=True,
                             params=params, prompt_token_ids=tuple(prompt), output_token_ids=tuple(output))


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int = 400) -> Counter:
    """Sample one row ``n`` times with seeds 0..n-1 (one batched call)."""
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    seqs = [seq(params.replace(seed=i)) for i in range(n)]
    return Counter(Sampler("cpu", seed=0)(logits, seqs).tolist())


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000) * 3
    out = Sampler("cpu")(logits, [seq(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.dtype == torch.long and out.shape == (8,)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_rows_mixed_with_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, seed=3)] * 3
    out = Sampler("cpu", seed=0)(logits, [seq(p) for p in params])
    greedy_rows = torch.tensor([0, 2, 4])
    assert torch.equal(out[greedy_rows], logits[greedy_rows].argmax(dim=-1))
    assert ((out >= 0) & (out < 500)).all()
    # at temperature 1.5 over 500 near-uniform logits the sampled rows are almost never the argmax
    assert (out[1::2] != logits[1::2].argmax(dim=-1)).any()


def test_unfiltered_sampling_follows_the_distribution():
    probs = (0.5, 0.3, 0.15, 0.05)
    counts = draws(log_probs(*probs), SamplingParams(), n=2000)
    for token, p in enumerate(probs):
        assert abs(counts[token] / 2000 - p) < 0.04, (token, counts)


def test_temperature_sharpens_and_flattens():
    logits = log_probs(0.6, 0.4)
    cold = draws(logits, SamplingParams(temperature=0.25), n=1000)
    hot = draws(logits, SamplingParams(temperature=4.0), n=1000)
    expected_cold = 0.6**4 / (0.6**4 + 0.4**4)  # p^(1/T), renormalized
    expected_hot = 0.6**0.25 / (0.6**0.25 + 0.4**0.25)
    assert abs(cold[0] / 1000 - expected_cold) < 0.05
    assert abs(hot[0] / 1000 - expected_hot) < 0.05


def test_top_k_support():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.0, 1.9, -3.0, 0.5])
    counts = draws(logits, SamplingParams(top_k=3))
    assert set(counts) == {1, 3, 5}


def test_top_p_support():
    logits = log_probs(0.05, 0.5, 0.15, 0.3)
    # sorted: 0.5, 0.3 (mass before 0.5), 0.15 (mass before 0.8 >= 0.75: dropped), 0.05
    assert set(draws(logits, SamplingParams(top_p=0.75))) == {1, 3}
    assert set(draws(logits, SamplingParams(top_p=0.4))) == {1}
    assert set(draws(logits, SamplingParams(top_p=0.85))) == {1, 3, 2}


def test_min_p_support():
    logits = log_probs(0.05, 0.5, 0.15, 0.3)
    # threshold 0.2 * 0.5 = 0.1 keeps 0.5, 0.3, 0.15
    assert set(draws(logits, SamplingParams(min_p=0.2))) == {1, 2, 3}
    assert set(draws(logits, SamplingParams(min_p=0.7))) == {1}


def test_top_k_and_top_p_combined_and_batch_mixed():
    logits = log_probs(0.05, 0.5, 0.15, 0.3)
    n = 300
    rows = logits.unsqueeze(0).repeat(2 * n, 1)
    params = [SamplingParams(top_k=2, seed=i) for i in range(n)] + [SamplingParams(top_p=0.4, seed=i) for i in range(n)]
    out = Sampler("cpu")(rows, [seq(p) for p in params]).tolist()
    assert set(out[:n]) == {1, 3}
    assert set(out[n:]) == {1}


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0], [2.0, -1.0, 0.5, 3.0, 0.0]])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.5)
    seqs = [seq(params, prompt=(0,), output=(1, 3, 3)), seq(SamplingParams(), prompt=(0,), output=(1, 3, 3))]
    out = apply_penalties(logits, seqs, torch.device("cpu"))
    expected = [
        2.0 / 1.5,  # in the prompt: repetition only
        -1.0 * 1.5 - 0.25 * 1 - 0.5,  # negative logit: multiplied; once in the output
        0.5,  # never seen
        3.0 / 1.5 - 0.25 * 2 - 0.5,  # twice in the output
        0.0,
    ]
    assert torch.allclose(out[0], torch.tensor(expected))
    assert torch.equal(out[1], logits[1])  # a row without penalties is untouched


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    plain = Sampler("cpu")(logits, [seq(SamplingParams(temperature=0.0), output=(0,))])
    penalized = Sampler("cpu")(logits, [seq(SamplingParams(temperature=0.0, presence_penalty=0.5), output=(0,))])
    assert plain.tolist() == [0] and penalized.tolist() == [1]


def test_low_temperature_and_strong_penalty_on_fp16_range_logits():
    torch.manual_seed(2)
    logits = (torch.rand(4, 2000) * 2 - 1).mul(65504).half().float()
    logits[:, 0] = 65504.0  # the raw winner, but penalized (in the prompt and the output)
    prompt = tuple(range(0, 2000, 3))
    params = SamplingParams(temperature=1e-5, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0,
                            seed=0)
    seqs = [seq(params, prompt=prompt, output=prompt[:50]) for _ in range(4)]
    penalized = apply_penalties(logits, seqs, torch.device("cpu"))
    assert not torch.isnan(penalized).any()
    out = Sampler("cpu")(logits, seqs)
    # at T = 1e-5 with gaps of ~1 logit, sampling is greedy over the penalized logits
    assert torch.equal(out, penalized.argmax(dim=-1))
    assert (out != 0).all()  # the penalty dethroned the raw winner


def test_collapsed_rows_fall_back_to_greedy_on_the_raw_logits():
    vocab = 6
    collapsing = torch.tensor([-3.0e38, -3.1e38, -3.2e38, -3.05e38, -3.3e38, -3.4e38])  # x2 overflows to -inf
    logits = torch.stack([
        collapsing,
        torch.full((vocab,), float("nan")),
        torch.tensor([float("nan"), 1.0, float("nan"), 2.0, float("nan"), 0.0]),
        torch.tensor([0.0, float("inf"), 1.0, 2.0, 3.0, 4.0]),
    ])
    strong = SamplingParams(repetition_penalty=2.0, seed=5)
    seqs = [seq(strong, prompt=range(vocab)), seq(SamplingParams(seed=1)), seq(SamplingParams(temperature=0.0)),
            seq(SamplingParams(seed=2))]
    out = Sampler("cpu")(logits, seqs).tolist()
    assert out[0] == 0  # every logit became -inf: greedy on the unpenalized logits
    assert 0 <= out[1] < vocab  # all NaN: still a valid id instead of an error
    assert out[2] == 3  # NaN never wins
    assert out[3] == 1  # +inf is the (finite) maximum


def test_seeded_rows_are_independent_of_batch_and_position():
    torch.manual_seed(3)
    vocab = 300
    target_logits = torch.randn(vocab)
    params = SamplingParams(temperature=1.0, top_k=100, seed=1234)
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, seed=9)]

    def run(position: int, batch_size: int, sampler_seed: int) -> list[int]:
        sampler = Sampler("cpu", seed=sampler_seed)
        tokens: list[int] = []
        for _ in range(12):
            logits = torch.randn(batch_size, vocab)
            logits[position] = target_logits
            seqs = [seq(others[i % len(others)], output=(1,) * i) for i in range(batch_size)]
            seqs[position] = seq(params, output=tuple(tokens))
            tokens.append(int(sampler(logits, seqs)[position]))
        return tokens

    alone = run(0, 1, sampler_seed=0)
    assert run(3, 5, sampler_seed=1) == alone
    assert run(1, 4, sampler_seed=2) == alone
    assert len(set(alone)) > 1  # the token index enters the seed: not the same draw each step
    other_seed = SamplingParams(temperature=1.0, top_k=100, seed=99)
    draws_other = [int(Sampler("cpu")(target_logits.unsqueeze(0), [seq(other_seed, output=(0,) * i)])[0])
                   for i in range(12)]
    assert draws_other != alone


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # eos (2) then stop id 3 are the best
    sampler = Sampler("cpu", eos_token_ids=(2,))
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    assert sampler(logits, [seq(p, output=())]).tolist() == [4]
    assert sampler(logits, [seq(p, output=(4,))]).tolist() == [4]
    assert sampler(logits, [seq(p, output=(4, 4))]).tolist() == [2]
    ignoring = p.replace(ignore_eos=True)
    assert sampler(logits, [seq(ignoring, output=())]).tolist() == [2]  # eos is no stop then: not masked


def test_sampler_does_not_modify_its_input():
    logits = torch.tensor([[0.5, float("nan"), 2.0]])
    before = logits.clone()
    Sampler("cpu", eos_token_ids=(2,))(logits, [seq(SamplingParams(min_tokens=1, repetition_penalty=1.3), (0,))])
    assert torch.equal(logits.isnan(), before.isnan())
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize(
    ("params", "sorts", "topks"),
    [
        (SamplingParams(temperature=0.8), 0, 0),
        (SamplingParams(temperature=0.0), 0, 0),
        (SamplingParams(top_k=5), 0, 1),
        (SamplingParams(top_k=5, top_p=0.9), 0, 1),
        (SamplingParams(top_p=0.9), 1, 0),
    ],
)
def test_work_no_row_needs_is_skipped(monkeypatch, params, sorts, topks):
    calls = Counter()
    for name in ("sort", "topk"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    out = Sampler("cpu")(torch.randn(3, 50), [seq(params) for _ in range(3)])
    assert out.shape == (3,)
    assert calls["sort"] == sorts and calls["topk"] == topks


def test_empty_batch():
    out = Sampler("cpu")(torch.empty(0, 10), [])
    assert out.shape == (0,) and out.dtype == torch.long


def test_plain_greedy_steps_are_the_argmax_of_the_raw_logits():
    """Where plain_greedy says so, the runner uses the argmax its CUDA graph computed instead of calling the sampler:
    that must be exactly the sampler's answer, and it must refuse rows where the sampler does more."""
    sampler = Sampler("cpu", eos_token_ids=(2,), seed=0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    greedy = SamplingParams(temperature=0.0)
    plain = [seq(greedy, output=(5,), rid=f"r{i}") for i in range(3)]
    assert sampler.plain_greedy(plain)
    assert torch.equal(sampler(logits, plain), torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1))
    assert not sampler.plain_greedy([seq(SamplingParams(temperature=0.7))])
    assert not sampler.plain_greedy([seq(SamplingParams(temperature=0.0, repetition_penalty=1.3), prompt=(1,))])
    assert not sampler.plain_greedy([seq(SamplingParams(temperature=0.0, min_tokens=2), output=(5,))])
    assert sampler.plain_greedy([seq(SamplingParams(temperature=0.0, min_tokens=2), output=(5, 6))])


def _top_p_batch(top_p: list[float]):
    from llmc.engine.torch.sampler import _BatchParams

    rows = len(top_p)
    return _BatchParams(greedy=torch.zeros(rows, dtype=torch.bool), temperature=torch.ones(rows, 1),
                        top_k=torch.zeros(rows, dtype=torch.long), top_p=torch.tensor(top_p).unsqueeze(1),
                        log_min_p=torch.full((rows, 1), float("-inf")), any_sampled=True, any_top_k=False,
                        any_top_p=True, every_top_p=True, any_min_p=False, max_top_k=0,
                        top_p_within_top_k=False)


@pytest.mark.parametrize("scale", [6.0, 0.05])  # peaked rows: the window holds the nucleus; flat: full sort
def test_top_p_window_cuts_where_a_full_sort_cuts(scale, monkeypatch):
    from llmc.engine.torch import sampler as sampler_mod

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=gen) * scale
    scaled = logits - logits.amax(dim=-1, keepdim=True)
    batch = _top_p_batch([0.5, 0.8, 0.9, 0.95, 0.99, 0.7])
    calls = []
    real_cut = sampler_mod._cut_sorted
    monkeypatch.setattr(sampler_mod, "_cut_sorted", lambda *a, **k: calls.append(a[1].shape[1]) or real_cut(*a, **k))
    windowed = sampler_mod._top_k_top_p_sorted(scaled, batch)
    window = sampler_mod.TOP_P_WINDOW
    monkeypatch.setattr(sampler_mod, "TOP_P_WINDOW", 10**9)  # no window: every value sorted
    full = sampler_mod._top_k_top_p_sorted(scaled, batch)
    assert torch.equal(windowed, full)
    kept = torch.isfinite(windowed).sum(dim=-1)
    if scale > 1:  # the window served every row (one cut of 1,024 values) and the nuclei are small
        assert calls[0] == window and len(calls) == 2 and int(kept.max()) < window
    else:  # flat rows: the nucleus reaches past the window, so the whole row was sorted
        assert calls[:2] == [window, 49152] and int(kept.min()) > window


def test_token_logprobs_are_the_raw_log_softmax_for_the_rows_that_ask():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[2, 7] = float("nan")  # sanitized as the sampler does: NaN is -inf
    seqs = [seq(SamplingParams(logprobs=2, temperature=0.5)), seq(SamplingParams()),
            seq(SamplingParams(logprobs=0, repetition_penalty=1.3), output=(4,))]
    token_ids = torch.tensor([5, 9, 11])
    rows = token_logprobs(logits, token_ids, seqs)
    assert rows.rows == (0, 2) and rows.counts == (2, 0)
    ref = torch.log_softmax(torch.nan_to_num(logits, nan=float("-inf")), dim=-1)  # raw: no temperature, penalty
    assert rows.chosen.tolist() == pytest.approx([ref[0, 5].item(), ref[2, 11].item()], abs=1e-6)
    top = ref[[0, 2]].topk(2)
    assert rows.top_ids.tolist() == top.indices.tolist()
    assert rows.top_logprobs.tolist() == [pytest.approx(v, abs=1e-6) for v in top.values.tolist()]
    assert token_logprobs(logits, token_ids, [seq(SamplingParams())] * 3) is None  # nobody asks: nothing computed

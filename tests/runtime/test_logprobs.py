"""``SamplingParams.logprobs``: each generated token's log-probability under the model and the most likely
alternatives, through the engine's serial and overlapped step paths, against transformers' own model."""

from __future__ import annotations

import math

import pytest
import torch

from llmc.request.params import SamplingParams
from tests.runtime.engine_helpers import hf_model, make_engine

PROMPTS = ["The river runs", "A cat sat on the", "Numbers: one two"]


@torch.no_grad()
def reference_logprobs(hf_dir, prompt_ids, output_ids) -> torch.Tensor:
    """[len(output_ids), V]: transformers' float32 log-softmax at each generated position."""
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    logits = hf_model(hf_dir)(ids).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("overlap", [False, True])
def test_each_token_comes_with_the_models_log_probabilities(tiny_build_dir, tiny_hf_dir, overlap):
    engine = make_engine(tiny_build_dir, overlap=overlap)
    params = [SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_new_tokens=6, temperature=0.9, seed=7, ignore_eos=True, logprobs=0),
              SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)]
    completions = engine.generate(PROMPTS, params)
    assert completions[2].logprobs == ()  # not asked for: not computed
    for completion, p in zip(completions[:2], params):
        prompt_ids = engine.tokenize(completion.prompt)
        ref = reference_logprobs(tiny_hf_dir, prompt_ids, completion.token_ids)
        assert [lp.token_id for lp in completion.logprobs] == list(completion.token_ids)
        for i, lp in enumerate(completion.logprobs):
            assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-4)
            assert len(lp.top) == p.logprobs
            want = ref[i].topk(p.logprobs) if p.logprobs else None
            if want is not None:
                assert [t for t, _ in lp.top] == want.indices.tolist()
                assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-4)
                assert lp.top[0][0] == lp.token_id  # greedy: the token is the most likely one
    assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 for lp in completions[1].logprobs)


def test_streamed_events_carry_their_tokens_log_probabilities(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    events = list(engine.stream(PROMPTS[0], SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True,
                                                           logprobs=2)))
    assert all(len(e.logprobs) == len(e.token_ids) == 1 for e in events)
    assert [e.logprobs[0].token_id for e in events] == [e.token_ids[0] for e in events]


@pytest.mark.parametrize("value, message", [(21, r"must be in \[0, 20\]"), (-1, r"must be in \[0, 20\]"),
                                            (2.5, "must be an integer or null"), (True, "must be an integer")])
def test_logprobs_out_of_range_name_the_field(value, message):
    from llmc.errors import RequestError

    with pytest.raises(RequestError, match=message) as info:
        SamplingParams(logprobs=value).validate()
    assert info.value.field == "logprobs"

"""``SamplingParams.prompt_logprobs``: each prompt token's log-probability given the tokens before it (what
evaluation harnesses score a continuation with), across prompt chunks, batches, both step paths, the prefix cache
and preemption, against transformers' own model."""

from __future__ import annotations

import pytest
import torch

from llmc.errors import RequestError
from llmc.request.outputs import RequestOutput, TokenLogprob
from llmc.request.params import SamplingParams
from tests.runtime.engine_helpers import hf_model, make_engine

# the tiny build takes 32 tokens a step: the long prompt runs in 3 chunks, next to the others' chunks and decodes
LONG = " ".join(f"word{i}" for i in range(30))
PROMPTS = [LONG, "The river runs", "A cat sat on the"]


@torch.no_grad()
def reference(hf_dir, prompt_ids) -> torch.Tensor:
    """[len - 1, V]: transformers' float32 log-softmax at prompt positions 0 .. len - 2."""
    logits = hf_model(hf_dir)(torch.tensor([list(prompt_ids)])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_reference(entries, prompt_ids, ref, k):
    assert [lp.token_id for lp in entries] == list(prompt_ids[1:])
    for i, lp in enumerate(entries):
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-4)
        assert len(lp.top) == k
        if k:
            want = ref[i].topk(k)
            assert [t for t, _ in lp.top] == want.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_tokens_come_with_the_models_log_probabilities(tiny_build_dir, tiny_hf_dir, overlap):
    engine = make_engine(tiny_build_dir, overlap=overlap)
    params = [SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=1),
              SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)]
    completions = engine.generate(PROMPTS, params)
    assert len(engine.tokenize(LONG)) > 64  # three chunks of the 32-token budget
    for completion, p in zip(completions[:2], params):
        prompt_ids = engine.tokenize(completion.prompt)
        check_against_reference(completion.prompt_logprobs, prompt_ids, reference(tiny_hf_dir, prompt_ids),
                                p.prompt_logprobs)
    assert completions[2].prompt_logprobs == ()  # not asked for: not computed
    assert len(completions[1].logprobs) == 6  # the generated tokens' own, as before


def test_the_first_event_carries_them_once(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    events = list(engine.stream(PROMPTS[1], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True,
                                                           prompt_logprobs=1)))
    assert len(events[0].prompt_logprobs) == len(engine.tokenize(PROMPTS[1])) - 1
    assert all(e.prompt_logprobs == () for e in events[1:])
    one = engine.generate(["word"], SamplingParams(max_new_tokens=1, prompt_logprobs=1))[0]
    assert len(engine.tokenize("word")) == 1 and one.prompt_logprobs == ()  # nothing before the first token


def test_a_cached_prefix_is_computed_again_for_them(tiny_build_dir, tiny_hf_dir):
    engine = make_engine(tiny_build_dir)
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([LONG], greedy)  # its blocks enter the prefix cache
    hits = engine.block_manager.hit_tokens
    scored = engine.generate([LONG], greedy.replace(prompt_logprobs=0))[0]
    assert engine.block_manager.hit_tokens == hits  # no position skipped
    prompt_ids = engine.tokenize(LONG)
    check_against_reference(scored.prompt_logprobs, prompt_ids, reference(tiny_hf_dir, prompt_ids), 0)
    engine.generate([LONG], greedy)
    assert engine.block_manager.hit_tokens > hits  # other requests still reuse the cache


def test_a_preempted_request_keeps_each_position_once(tiny_build_dir, tiny_hf_dir):
    # 16 blocks of 8 tokens: two ~40-token prompts growing by 48 tokens each outgrow them, so the later one is
    # preempted and computed again from position 0 (its prompt's positions a second time)
    engine = make_engine(tiny_build_dir, num_blocks=16)
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    mid = " ".join(f"word{i}" for i in range(15))
    completions = engine.generate([mid, mid + " more"], params)
    assert sum(c.metrics.num_preemptions for c in completions) >= 1
    for completion in completions:
        prompt_ids = engine.tokenize(completion.prompt)
        check_against_reference(completion.prompt_logprobs, prompt_ids, reference(tiny_hf_dir, prompt_ids), 1)


def test_repeated_positions_are_kept_once_and_a_gap_is_an_error(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    out = RequestOutput("r", tuple(range(9)), SamplingParams(prompt_logprobs=0), engine.tokenizer, (), 64,
                        metrics=None)
    out.add_prompt_logprobs(1, [TokenLogprob(i, -float(i)) for i in range(1, 5)])
    out.add_prompt_logprobs(1, [TokenLogprob(i, -float(i)) for i in range(1, 7)])  # recomputed from the start
    out.add_prompt_logprobs(7, [TokenLogprob(7, -7.0), TokenLogprob(8, -8.0)])
    assert [lp.token_id for lp in out.prompt_logprobs] == list(range(1, 9))
    with pytest.raises(AssertionError, match="from position 11, expected 9"):
        out.add_prompt_logprobs(11, [TokenLogprob(11, -1.0)])


@pytest.mark.parametrize("value, message", [(21, r"must be in \[0, 20\]"), (2.5, "must be an integer or null")])
def test_out_of_range_names_the_field(value, message):
    with pytest.raises(RequestError, match=message) as info:
        SamplingParams(prompt_logprobs=value).validate()
    assert info.value.field == "prompt_logprobs"

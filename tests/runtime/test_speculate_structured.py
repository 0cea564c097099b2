"""Speculation for requests with an output format (structured outputs): the scheduler drafts them only through the
engine's constraints, which vet prompt lookup's drafts and add the tokens a format forces; each drafted row samples
under its own position's mask, so the tokens equal plain constrained decoding's (greedy and seeded sampling, serial
and overlapped steps), bounded formats still complete, and on the embedded SmolLM2 a JSON answer accepts drafts."""

from __future__ import annotations

import json

import pytest

from llmc.engine.types import ModelRunnerOutput
from llmc.request.params import SamplingParams
from llmc.runtime.scheduler.request import Request
from llmc.runtime.scheduler.speculate import PromptLookup, speculable
from tests.runtime.engine_helpers import assert_all_blocks_free, make_engine
from tests.runtime.scheduler_helpers import make_scheduler
from tests.runtime.test_structured import FORMATS, matches

SPACED = {"type": "choice", "choices": ["green tea with milk and honey", "black coffee"]}
PHRASE = {"type": "regex", "pattern": "the quick brown fox jumps over the lazy dog"}


def test_the_scheduler_drafts_a_formatted_request_only_through_the_engines_constraint():
    regex = SamplingParams(max_new_tokens=8, temperature=0.0, structured={"type": "regex", "pattern": "[a-z]+"})
    assert speculable(SamplingParams()) and not speculable(regex) and speculable(regex, formats=True)
    sched = make_scheduler()
    sched.speculator = PromptLookup(4)
    sched.add(Request("r", (5, 6, 7, 5, 6, 7, 5, 6), regex))
    sched.schedule()
    sched.update(ModelRunnerOutput(sampled_token_ids={"r": 7}))  # the prompt's step
    assert [s.num_draft for s in sched.schedule().sequences] == [0]  # no format_drafts: not drafted
    sched.update(ModelRunnerOutput(sampled_token_ids={"r": 5}))  # the tail "6 7 5" occurred before
    calls = []

    def vet(request_id, proposed, limit):
        calls.append((request_id, proposed, limit))
        return proposed[:2]
    sched.format_drafts = vet
    out = sched.schedule()
    assert calls == [("r", (6, 7, 5, 6), 4)]  # prompt lookup's drafts and the limit: the format's call
    assert out.sequences[0].token_ids == (5, 6, 7) and out.sequences[0].num_draft == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_requests_with_drafts_keep_plain_decodings_tokens(tiny_build_dir, overlap):
    """Greedy and seeded sampled requests under every kind of format, one with spaces the format spells out: the
    same tokens as without drafts, drafts verified and accepted, bounded formats complete, every block free."""
    formats = FORMATS + [SPACED, PHRASE]
    prompts = ["Answer in JSON:", "A code:", "Pick a colour:", "A tuple:", "A drink:", "Say it:"]
    cases = [[SamplingParams(max_new_tokens=24, temperature=0.0, structured=f) for f in formats],
             [SamplingParams(max_new_tokens=24, temperature=0.8, top_k=50, seed=i, structured=f)
              for i, f in enumerate(formats)]]
    plain = make_engine(tiny_build_dir, overlap=overlap)
    expected = [[c.token_ids for c in plain.generate(prompts, params)] for params in cases]
    for params, want in zip(cases, expected):
        spec = make_engine(tiny_build_dir, overlap=overlap, speculative_tokens=4)
        done = spec.generate(prompts, params)
        assert [c.token_ids for c in done] == want
        for fmt, completion in zip(formats, done):
            if completion.finish_reason == "stop":
                assert matches(fmt, completion.text) if fmt in FORMATS else completion.text in (
                    SPACED["choices"] + [PHRASE["pattern"]]), (fmt, completion.text)
        assert [c.finish_reason for c in done[1:]] == ["stop"] * 5  # (the JSON's integer may run to the length)
        stats = spec.stats()
        assert stats["draft_tokens"] >= stats["accepted_draft_tokens"] > 0
        assert_all_blocks_free(spec)


def test_the_tokens_a_format_forces_are_drafted_where_prompt_lookup_finds_nothing(tiny_build_dir):
    """A phrase the prompt does not contain: every draft is one of the tokens the format forces."""
    spec = make_engine(tiny_build_dir, speculative_tokens=4)
    done = spec.generate(["Say it:"], SamplingParams(max_new_tokens=24, temperature=0.0, structured=PHRASE))[0]
    assert done.text == PHRASE["pattern"] and done.finish_reason == "stop"
    assert spec.stats()["draft_tokens"] >= 4


@pytest.mark.slow
def test_a_real_models_json_answer_accepts_the_keys_and_copied_values_as_drafts(smollm2_build_dir):
    schema = {"type": "object", "properties": {"landmark": {"type": "string"}, "city": {"type": "string"},
                                               "year": {"type": "integer"}},
              "required": ["landmark", "city", "year"], "additionalProperties": False}
    chat = [{"role": "user", "content": "The Eiffel Tower in Paris was completed in 1889. Give the landmark, its "
                                        "city and the year it was completed as JSON."}]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, structured={"type": "json_schema", "schema": schema})
    plain = make_engine(smollm2_build_dir)
    want = plain.generate([chat], params)[0]
    spec = make_engine(smollm2_build_dir, speculative_tokens=4)
    got = spec.generate([chat], params)[0]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    assert set(json.loads(got.text)) == {"landmark", "city", "year"}
    stats = spec.stats()
    assert stats["accepted_draft_tokens"] >= 4  # the keys at least
    assert_all_blocks_free(spec)

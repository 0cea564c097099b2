"""Prompt-lookup speculation (llmc/runtime/scheduler/speculate.py): the proposer, the scheduler's drafted steps over
a fake model that checks every context it reads, and the engine on the tiny model (serial and overlapped steps):
the tokens equal plain decoding's, stops inside accepted drafts end the output where plain decoding ends it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from llmc.engine.types import PLACEHOLDER, ModelRunnerOutput, SchedulerOutput
from llmc.errors import EngineError, RecipeError
from llmc.recipe import recipe_from_dict
from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine
from llmc.runtime.scheduler.speculate import MAX_BACKOFF, PromptLookup, speculable
from tests.runtime.engine_helpers import GREEDY, assert_all_blocks_free, hf_greedy, make_engine
from tests.runtime.scheduler_helpers import SlotRunner, make_request, make_scheduler
from tests.runtime.test_api import random_prompts


def test_the_longest_tail_ngram_finds_its_latest_continuation():
    lookup = PromptLookup(num_draft=3, min_ngram=1, max_ngram=3)
    tokens = (5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7)
    # tail 3-gram (5, 6, 7) occurred at 0: its continuation 8, 9, 1 (the 2-gram (6, 7) later at 6 is shorter)
    assert lookup.propose("r", tokens, limit=8) == (8, 9, 1)
    assert lookup.propose("r", tokens + (4,), limit=2) == ()  # (7, 4), (4) never occurred before
    assert lookup.propose("r", tokens + (4, 6, 7), limit=2) == (4, 6)  # (4, 6, 7) no; (6, 7): latest at 11 -> 4, 6
    assert lookup.propose("s", (1, 2, 3, 1, 2, 3, 1), limit=9) == (2, 3, 1)  # num_draft caps; the tail is excluded
    assert lookup.propose("t", (1, 2, 3, 1), limit=9) == (2, 3, 1)  # a continuation runs into the tail itself
    assert lookup.propose("u", (9, 7, 7, 7, 7), limit=9) == (7, 7, 7)  # a loop drafts in full, not 1 token
    assert lookup.propose("v", (4, 1, 2, 1, 2), limit=9) == (1, 2, 1)


def test_no_draft_without_a_known_last_token_room_or_a_match():
    lookup = PromptLookup(num_draft=4, min_ngram=2, max_ngram=2)
    assert lookup.propose("r", (1, 2, 3, 1, 2, PLACEHOLDER), limit=4) == ()
    assert lookup.propose("r", (1, 2, 3, 1, 2), limit=0) == ()
    assert lookup.propose("r", (1, 2, 3, 1, 2), limit=4) == (3, 1, 2, 3)  # past the tail: the period 3 again
    assert lookup.propose("q", (1, 2, 3, 4, 2), limit=4) == ()  # the 1-gram (2) is below min_ngram
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(4, min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="num_draft"):
        PromptLookup(0)


def test_rejected_drafts_back_off_and_an_accepted_one_ends_the_backoff():
    lookup = PromptLookup(num_draft=2)
    tokens = (1, 2, 1, 2, 1)
    assert lookup.propose("r", tokens, 2) == (2, 1)
    lookup.verified("r", 0)  # all rejected: skip the next lookup
    assert lookup.propose("r", tokens, 2) == ()
    assert lookup.propose("r", tokens, 2) == (2, 1)
    lookup.verified("r", 0)  # twice in a row: skip 3
    assert [lookup.propose("r", tokens, 2) for _ in range(4)] == [(), (), (), (2, 1)]
    lookup.verified("r", 1)
    assert lookup.propose("r", tokens, 2) == (2, 1)
    for _ in range(10):
        lookup.verified("r", 0)
    assert sum(lookup.propose("r", tokens, 2) == () for _ in range(MAX_BACKOFF + 1)) == MAX_BACKOFF


def test_requests_with_an_output_format_are_drafted_only_where_the_engine_vets_their_drafts():
    assert speculable(SamplingParams(temperature=0.0))
    assert speculable(SamplingParams(temperature=0.7, repetition_penalty=1.2, logit_bias={5: 1.0}, min_tokens=3,
                                     logprobs=2))
    regex = SamplingParams(structured={"type": "regex", "pattern": "[a-z]+"})
    assert not speculable(regex) and speculable(regex, formats=True)  # (test_speculate_structured.py)


def cyclic_token(context: list[int]) -> int:
    """A 'model' whose output repeats a 5-token cycle, broken at every 11th position (drafts get accepted and
    rejected)."""
    if len(context) % 11 == 0:
        return 150 + len(context) % 7
    return 100 + (context[-1] + 1) % 5


class DraftSlotRunner(SlotRunner):
    """SlotRunner (a simulated paged KV cache read back before every answer) that verifies draft tokens: its
    greedy token after each new token of a drafted sequence, read through the block table like the rest."""

    verifies_drafts = True

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled, verify = {}, {}
        for s in out.sequences:
            for i, t in enumerate(s.token_ids):
                self.slots[self._slot(s.block_ids, s.num_computed + i)] = t
        for s in out.sequences:
            known = list(s.prompt_token_ids + s.output_token_ids) + list(s.draft_token_ids)
            total = s.num_computed + len(s.token_ids)
            ctx = [self.slots[self._slot(s.block_ids, p)] for p in range(total)]
            assert ctx == known[:total], s.request_id
            if s.sample:
                assert total == len(known)
                sampled[s.request_id] = cyclic_token(ctx)
                verify[s.request_id] = tuple(cyclic_token(ctx[:total - s.num_draft + i]) for i in range(s.num_draft))
        return ModelRunnerOutput(sampled_token_ids=sampled, verify_token_ids={k: v for k, v in verify.items() if v})


def _run(speculator, num_blocks=64, max_num_tokens=32, draft_limits=None):
    sched = make_scheduler(num_blocks=num_blocks, max_num_tokens=max_num_tokens)
    sched.speculator, sched.draft_limits = speculator, draft_limits
    runner = DraftSlotRunner(sched.block_manager.block_size)
    for i, (prompt, max_new) in enumerate([(7, 40), (3, 25), (12, 33), (5, 1), (9, 17)]):
        sched.add(make_request(f"r{i}", [100 + (j * 3 + i) % 5 for j in range(prompt)], max_new=max_new))
    outputs, drafted_steps = {}, 0
    while sched.has_unfinished():
        out = sched.schedule()
        drafted_steps += sum(1 for s in out.sequences if s.num_draft)
        if draft_limits and any(s.num_draft for s in out.sequences):  # what the CUDA graphs' graph_rows() checks
            decoding = [s for s in out.sequences if s.is_decode or s.num_draft]  # prompt chunks count as before
            assert sum(len(s.token_ids) for s in decoding) <= draft_limits[0]
            assert sum(len(s.token_ids) * s.num_computed + len(s.token_ids) * (len(s.token_ids) + 1) // 2
                       for s in decoding) <= draft_limits[1]
        for rid, tokens in sched.update(runner.execute(out)).items():
            outputs.setdefault(rid, []).extend(tokens if isinstance(tokens, tuple) else (tokens,))
            request = sched.get(rid)
            assert len(request.output_token_ids) <= request.params.max_new_tokens
            if len(request.output_token_ids) == request.params.max_new_tokens:
                sched.finish_request(rid)
    assert sched.block_manager.num_used_blocks == 0
    return outputs, drafted_steps, sched


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12 blocks of 4: drafted requests are preempted and recomputed
def test_drafted_steps_give_plain_decodings_tokens_within_every_length_limit(num_blocks):
    plain, none_drafted, _ = _run(None, num_blocks)
    assert none_drafted == 0
    drafted, steps, sched = _run(PromptLookup(4), num_blocks)
    assert drafted == plain
    assert steps > 10 and sched.drafted_tokens_total > sched.accepted_tokens_total > 0
    if num_blocks == 12:
        assert sched.num_preemptions_total > 0


@pytest.mark.parametrize("limits", [(8, 10_000), (100, 160), (5, 0)])
def test_drafts_stay_within_the_rows_and_contexts_a_graph_step_takes(limits):
    """``draft_limits`` (the runner's CUDA graphs: rows, summed row contexts): a drafted step's decodes and drafts
    never exceed them (limits that leave no room for drafts: no drafts at all; prompt chunks that join the step count
    as without drafts), and the tokens stay plain decoding's."""
    drafted, steps, sched = _run(PromptLookup(4), draft_limits=limits)
    assert drafted == _run(None)[0]
    assert (steps > 0) == (limits != (5, 0))


def test_a_draft_never_runs_past_the_token_budget():
    drafted, _, sched = _run(PromptLookup(8), max_num_tokens=3)  # a decode and at most 2 drafts a step
    assert drafted == _run(None, max_num_tokens=3)[0]
    assert sched.accepted_tokens_total > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_outputs_equal_plain_decoding_and_transformers(tiny_build_dir, tiny_hf_dir, overlap):
    params = dataclasses.replace(GREEDY, max_new_tokens=40)
    prompts = random_prompts(3, [9, 20, 33])
    plain = make_engine(tiny_build_dir, overlap=overlap)
    spec = make_engine(tiny_build_dir, overlap=overlap, speculative_tokens=4)
    expected = [c.token_ids for c in plain.generate(prompts, params)]
    done = spec.generate(prompts, params)
    assert [c.token_ids for c in done] == expected
    assert list(expected[0]) == hf_greedy(tiny_hf_dir, prompts[0], 40)
    stats = spec.stats()
    assert stats["draft_tokens"] > stats["accepted_draft_tokens"] > 10  # the random model's outputs loop
    assert plain.stats()["draft_tokens"] == 0
    assert all(c.finish_reason == "length" and len(c.token_ids) == 40 for c in done)
    assert_all_blocks_free(spec)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_inside_accepted_drafts_ends_the_output_where_plain_decoding_does(tiny_build_dir, overlap):
    prompts = random_prompts(3, [9, 20])
    params = dataclasses.replace(GREEDY, max_new_tokens=40)
    plain = make_engine(tiny_build_dir, overlap=overlap)
    full = plain.generate(prompts, params)
    stop_id = full[0].token_ids[20]  # deep in a looping stretch: reached through accepted drafts
    text_stop = full[1].text[len(full[1].text) // 2:][:6]
    cases = [dataclasses.replace(params, stop_token_ids=(stop_id,)), dataclasses.replace(params, stop=(text_stop,))]
    # every plain answer before any speculative engine runs: the engines share the runner's KV cache, so the plain
    # engine's prefix cache must not look at blocks another engine wrote since
    expected = [plain.generate(prompts, stopped) for stopped in cases]
    for stopped, want in zip(cases, expected):
        assert "stop" in {c.finish_reason for c in want}
        spec = make_engine(tiny_build_dir, overlap=overlap, speculative_tokens=6)
        events = [list(spec.stream(p, stopped)) for p in prompts]  # the streamed pieces add up to the completion
        assert [(ev[-1].finish_reason, "".join(e.text for e in ev), sum((e.token_ids for e in ev), ()))
                for ev in events] == [(c.finish_reason, c.text, c.token_ids) for c in want]
        assert spec.stats()["accepted_draft_tokens"] > 0
        assert_all_blocks_free(spec)


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampled_and_penalized_requests_keep_their_tokens_with_drafts(tiny_build_dir, overlap):
    """A drafted row draws its token as that output position would without drafts (same seed index, penalties over
    the drafts before it, min_tokens): a seeded request gives the same tokens, and a draft is accepted exactly where
    that draw equals it."""
    prompts = random_prompts(4, [9, 20, 14])
    cases = [SamplingParams(max_new_tokens=40, temperature=0.6, top_k=20, seed=7, ignore_eos=True),
             SamplingParams(max_new_tokens=40, temperature=0.0, repetition_penalty=1.3, min_tokens=12),
             SamplingParams(max_new_tokens=40, temperature=0.1, top_p=0.9, min_p=0.05, frequency_penalty=0.1,
                            logit_bias={100: 3.0}, seed=3)]  # the tiny model's logits are flat: low temperatures
    plain = make_engine(tiny_build_dir, overlap=overlap)
    expected = [[c.token_ids for c in plain.generate(prompts, params)] for params in cases]  # before any drafts
    for params, want in zip(cases, expected):
        spec = make_engine(tiny_build_dir, overlap=overlap, speculative_tokens=4)
        assert [c.token_ids for c in spec.generate(prompts, params)] == want
        assert spec.stats()["draft_tokens"] > 0
        assert_all_blocks_free(spec)


def test_drafts_of_sampled_requests_are_accepted_at_the_models_rate(tiny_build_dir):
    """Unseeded sampling at a low temperature (the tiny model's logits are flat; its loops stay likely): drafts are
    accepted often but not always, and every request still ends at its length. Unseeded rows draw from the
    sampler's shared generator, seeded here so the run is the same each time: at temperature 0.05 one unseeded
    run (under transformers 4.57.3, tests/test_install_beside_trtllm.py) accepted all of its 68 drafts; at 0.1,
    12 seeds of this generator rejected 7-36 drafts of 69-84 (2026-12-07)."""
    spec = make_engine(tiny_build_dir, speculative_tokens=4)
    spec.runner.sampler._generator.manual_seed(2026)
    done = spec.generate(random_prompts(5, [9, 30]), SamplingParams(max_new_tokens=48, temperature=0.1,
                                                                     ignore_eos=True))
    stats = spec.stats()
    assert stats["draft_tokens"] > stats["accepted_draft_tokens"] > 0
    assert [len(c.token_ids) for c in done] == [48, 48]


@pytest.mark.parametrize("overlap", [False, True])
def test_drafted_tokens_carry_the_log_probabilities_plain_decoding_gives(tiny_build_dir, overlap):
    """Each token of a drafted step, accepted draft or the model's own, gets its row's log-probabilities: the same
    tokens, chosen log-probabilities and alternatives as plain decoding (float32), greedy and seeded sampling."""
    prompts = random_prompts(6, [9, 25])
    cases = [dataclasses.replace(GREEDY, max_new_tokens=40, logprobs=3),
             SamplingParams(max_new_tokens=40, temperature=0.05, seed=4, logprobs=0, ignore_eos=True)]
    plain = make_engine(tiny_build_dir, overlap=overlap)
    expected = [plain.generate(prompts, params) for params in cases]
    for params, want in zip(cases, expected):
        spec = make_engine(tiny_build_dir, overlap=overlap, speculative_tokens=4)
        got = spec.generate(prompts, params)
        assert spec.stats()["accepted_draft_tokens"] > 0
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 40
            for a, b in zip(g.logprobs, w.logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)


def test_bad_speculation_settings_get_one_clear_error(tiny_build_dir):
    base = {"name": "x", "model": {"source": "HuggingFaceTB/SmolLM2-135M-Instruct"}}
    with pytest.raises(RecipeError, match="prompt_lookup_min"):
        recipe_from_dict({**base, "serving": {"prompt_lookup_min": 4, "prompt_lookup_max": 2}}, check_inputs=False)
    with pytest.raises(RecipeError, match="speculative_tokens"):
        recipe_from_dict({**base, "backend": "tensorrt_llm", "serving": {"speculative_tokens": 4}},
                         check_inputs=False)
    with pytest.raises(RecipeError, match="speculative_tokens"):
        recipe_from_dict({**base, "serving": {"speculative_tokens": 17}}, check_inputs=False)
    with pytest.raises(ValueError, match="speculative_tokens"):
        make_engine(tiny_build_dir, speculative_tokens=-1)
    engine = make_engine(tiny_build_dir)

    class NoDrafts:  # a step runner that cannot verify drafts
        block_size, num_blocks, vocab_size = 8, 16, engine.runner.vocab_size

        def execute(self, scheduled):
            raise AssertionError("not reached")
    with pytest.raises(EngineError, match="cannot verify draft tokens"):
        Engine(NoDrafts(), engine.tokenizer, engine.recipe, engine.eos_token_ids, speculative_tokens=2)


@pytest.mark.parametrize("overlap", [False, True])
def test_staggered_arrivals_preemption_and_aborts_with_drafts(tiny_build_dir, overlap):
    """Requests arriving every step into a cache too small for all of them (preemption), greedy and seeded, some
    aborted mid-way: the others' tokens equal plain decoding's, and every block comes back."""
    rng = random.Random(11)
    prompts = random_prompts(12, [rng.randint(5, 40) for _ in range(8)])
    params = [SamplingParams(max_new_tokens=rng.randint(10, 40), temperature=0.0 if i % 2 else 0.05, seed=i,
                             ignore_eos=True) for i in range(8)]
    plain = make_engine(tiny_build_dir, overlap=overlap)
    expected = [c.token_ids for c in plain.generate(prompts, params)]
    spec = make_engine(tiny_build_dir, num_blocks=14, overlap=overlap, speculative_tokens=4)
    ids, tokens, done, step, aborted = {}, {}, set(), 0, set()
    while len(done) < len(prompts):
        if step < len(prompts):
            ids[spec.add_request(prompts[step], params[step])] = step
        if step in (6, 11):  # the earliest live request, mid-way
            rid = min((r for r in ids if r not in done), key=ids.get)
            assert spec.abort(rid)
            done.add(rid)
            aborted.add(ids[rid])
        for event in spec.step():
            tokens.setdefault(ids[event.request_id], []).extend(event.token_ids)
            if event.finished:
                done.add(event.request_id)
        step += 1
    assert spec.stats()["preemptions"] > 0 and spec.stats()["accepted_draft_tokens"] > 0 and len(aborted) == 2
    for i in set(range(len(prompts))) - aborted:
        assert tuple(tokens[i]) == expected[i], f"request {i}"
    assert_all_blocks_free(spec)

"""Structured outputs through the engine (``SamplingParams.structured``) and ``logit_bias``: each constrained greedy
token is transformers' best allowed token, sampled outputs match their formats, a complete format ends its request,
batches mix constrained and free requests, preemption, the overlapped step path, errors at admission."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from llmc.errors import RequestError
from llmc.request.params import SamplingParams
from llmc.request.structured import Grammars, OutputFormat
from tests.runtime.engine_helpers import assert_all_blocks_free, hf_greedy, hf_model, make_engine

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
          "required": ["answer", "n"], "additionalProperties": False}
FORMATS = [{"type": "json_schema", "schema": ANSWER}, {"type": "regex", "pattern": "[0-9]{3}-[a-z]{2}"},
           {"type": "choice", "choices": ["red", "green", "blue"]}, {"type": "grammar",
                                                                      "grammar": 'start: "(" num ("," num)* ")"\n'
                                                                                 'num: /[0-9]/'}]


@torch.no_grad()
def hf_constrained_greedy(engine, hf_dir, prompt_ids, fmt: dict, max_new_tokens: int) -> list[int]:
    """The reference: transformers' logits at each step, the best token among those the format allows (its
    constraint's bitmask unpacked with NumPy), the constraint advanced by hand; stops where the format is complete
    or an end id is taken."""
    model = hf_model(hf_dir)
    constraint = Grammars(engine.tokenizer, engine.runner.vocab_size, engine.eos_token_ids).compile(
        OutputFormat.from_dict(fmt))
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        allowed = np.unpackbits(constraint.mask().view(np.uint8), bitorder="little")[:logits.shape[0]].astype(bool)
        token = int(torch.where(torch.from_numpy(allowed), logits, -torch.inf).argmax())
        out.append(token)
        ids.append(token)
        assert constraint.accept(token)
        if constraint.complete or token in engine.eos_token_ids:
            break
    return out


def matches(fmt: dict, text: str) -> bool:
    if fmt["type"] == "json_schema":
        value = json.loads(text)
        return set(value) == {"answer", "n"} and value["answer"] in ("yes", "no") and type(value["n"]) is int
    if fmt["type"] == "regex":
        return re.fullmatch(fmt["pattern"], text) is not None
    if fmt["type"] == "choice":
        return text in fmt["choices"]
    return re.fullmatch(r"\([0-9](,[0-9])*\)", text) is not None


@pytest.mark.parametrize("overlap,late_masks", [(False, False), (True, False), (True, True)],
                         ids=["serial", "overlapped-waiting", "overlapped-late-masks"])
def test_constrained_greedy_tokens_are_the_best_allowed_ones_beside_a_free_request(tiny_build_dir, tiny_hf_dir,
                                                                                   overlap, late_masks):
    engine = make_engine(tiny_build_dir, overlap=overlap, late_masks=late_masks)
    prompts = ["Answer in JSON:", "A code:", "Pick a colour:", "A tuple:", "Once upon a time"]
    params = [SamplingParams(max_new_tokens=24, temperature=0.0, structured=f) for f in FORMATS]
    params.append(SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    completions = engine.generate(prompts, params)
    for prompt, fmt, completion in zip(prompts, FORMATS, completions):
        ids = engine.tokenize(prompt)
        assert list(completion.token_ids) == hf_constrained_greedy(engine, tiny_hf_dir, ids, fmt, 24), fmt
        if completion.finish_reason == "stop":
            assert matches(fmt, completion.text), (fmt, completion.text)
    free = completions[-1]
    assert list(free.token_ids) == hf_greedy(tiny_hf_dir, list(engine.tokenize(prompts[-1])), 12)
    assert [c.finish_reason for c in completions[1:4]] == ["stop"] * 3  # formats with a bounded length complete
    order = [entry for entry in engine.runner.log if entry[0] in ("launch", "result")] if overlap else []
    if overlap and not late_masks:  # while a constrained request runs, each step's tokens are known before the
        assert all(b == ("result", a[1]) for a, b in zip(order, order[1:]) if a[0] == "launch")  # next is planned
    if late_masks:  # each step after the first is launched before the previous one's tokens are known (its masks
        # come after, from the constraints that saw them: the tokens above are the best allowed ones)
        steps = [step for kind, step in order if kind == "launch"]
        overlapped = [b for a, b in zip(steps, steps[1:]) if order.index(("result", a)) > order.index(("launch", b))]
        assert len(overlapped) >= 10 and len(overlapped) >= len(steps) - 3, order
    assert_all_blocks_free(engine)


def test_sampled_outputs_match_their_formats_and_end_when_complete(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    fmts = FORMATS[1:3] * 4
    params = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=i, structured=f) for i, f in enumerate(fmts)]
    completions = engine.generate(["Say something:"] * len(fmts), params)
    for fmt, completion in zip(fmts, completions):
        assert completion.finish_reason == "stop" and completion.stop_reason is None, completion
        assert matches(fmt, completion.text), (fmt, completion.text)
    assert len({c.text for c in completions}) > 2  # sampled, not one answer
    assert_all_blocks_free(engine)


def test_a_preempted_constrained_request_keeps_its_format_and_its_tokens(tiny_build_dir):
    """12 blocks of 8 tokens for three growing requests: preemption recomputes a request from its tokens so far,
    while its constraint keeps its state; the outputs equal an unpressed engine's."""
    fmt = {"type": "regex", "pattern": "[a-z ]{100,400}"}
    params = SamplingParams(max_new_tokens=48, temperature=0.0, structured=fmt)
    prompts = ["one two three four five six", "seven eight nine ten eleven", "twelve thirteen fourteen fifteen"]
    roomy = make_engine(tiny_build_dir).generate(prompts, params)
    tight = make_engine(tiny_build_dir, num_blocks=12)
    got = tight.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in roomy]
    assert sum(c.metrics.num_preemptions for c in got) > 0
    assert all(re.fullmatch("[a-z ]*", c.text) and len(c.token_ids) == 48 for c in got)
    assert_all_blocks_free(tight)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "regex", "pattern": "[a-"}, "not a valid regex format"),
    ({"type": "grammar", "grammar": "start: missing_rule"}, "not a valid grammar format"),
    ({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "strng"}}}},
     "not a valid json_schema format"),
])
def test_invalid_formats_are_refused_at_admission_naming_the_field(tiny_build_dir, fmt, words):
    engine = make_engine(tiny_build_dir)
    with pytest.raises(RequestError) as info:
        engine.add_request("hello", SamplingParams(max_new_tokens=4, structured=fmt))
    assert info.value.field == "structured" and words in info.value.message
    assert not engine.scheduler.has_unfinished()
    assert engine.generate(["hello"], SamplingParams(max_new_tokens=2, temperature=0.0))[0].finish_reason == "length"


def test_logit_bias_bans_the_greedy_token_and_forces_another(tiny_build_dir, tiny_hf_dir):
    engine = make_engine(tiny_build_dir)
    ids = list(engine.tokenize("Once upon a time"))
    logits = hf_model(tiny_hf_dir)(torch.tensor([ids])).logits[0, -1]
    best, second = logits.topk(2).indices.tolist()
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    banned, forced = engine.generate(["Once upon a time"] * 2, [greedy.replace(logit_bias={str(best): -100}),
                                                                 greedy.replace(logit_bias={"7": 100})])
    assert banned.token_ids == (second,) and forced.token_ids == (7,)
    with pytest.raises(RequestError, match="logit_bias"):
        engine.add_request("x", greedy.replace(logit_bias={str(engine.runner.vocab_size): 1}))


def test_the_format_stages_are_measured(tiny_build_dir, tmp_path):
    """Compiling a format (per request) and computing the masks (per step: rows, host seconds; totals in stats())."""
    from llmc.runtime.api import Engine

    base = make_engine(tiny_build_dir)
    log = tmp_path / "steps.jsonl"
    engine = Engine(base.runner, base.tokenizer, base.recipe, base.eos_token_ids, metrics_log=log)
    fmt = {"type": "regex", "pattern": "[a-z]{400}"}  # never complete in 6 tokens: one mask per token
    done = engine.generate(["a", "b", "c"], [SamplingParams(max_new_tokens=6, temperature=0.0, structured=fmt)] * 2
                           + [SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)])
    assert all(c.metrics.format_compile_time > 0 for c in done[:2]) and done[2].metrics.format_compile_time == 0
    stats = engine.stats()
    assert stats["structured_masks"] == 12 and stats["structured_mask_seconds"] > 0
    engine.flush_metrics()
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("type", "step") == "step"
             and "masked_rows" in r]
    assert sum(r["masked_rows"] for r in steps) == 12 and max(r["masked_rows"] for r in steps) == 2
    assert sum(r["mask_time_s"] for r in steps) == pytest.approx(stats["structured_mask_seconds"])


def test_a_loaded_engine_builds_the_tokenizer_index_before_the_first_structured_request(tiny_build_dir):
    """Engine.from_dir (with its warm-up) has built llguidance's tokenizer index when it returns (not on a thread
    beside the first requests: the build holds the GIL), so the first request with a format compiles its format
    only; without the warm-up, or with ``prepare_formats=False``, the first such request builds it."""
    from llmc.runtime.api import Engine

    warm = Engine.from_dir(tiny_build_dir, device="cpu")
    cold = Engine.from_dir(tiny_build_dir, device="cpu", warmup=False)
    plain = Engine.from_dir(tiny_build_dir, device="cpu", prepare_formats=False)
    plain.shutdown()
    try:
        assert warm.grammars.ready.is_set() and warm.grammars._index is not None  # at once: no waiting for it
        for engine in (cold, plain):
            assert not engine.grammars.ready.is_set() and engine.grammars._index is None
        params = SamplingParams(max_new_tokens=3, temperature=0.0, structured={"type": "regex", "pattern": "[ab]+"})
        done = [engine.generate(["x"], params)[0] for engine in (warm, cold)]
        assert cold.grammars._index is not None and all(re.fullmatch("[ab]+", c.text) for c in done)
        assert done[0].metrics.format_compile_time < done[1].metrics.format_compile_time
    finally:
        warm.shutdown()
        cold.shutdown()


def test_a_failure_collected_inside_the_late_masks_ends_every_request_of_that_step(tiny_build_dir):
    """With late masks the previous step is collected between the launch and the sampler. When that step failed on
    the device (its result raises there, again if asked again), every request it held ends with the error, also
    one whose length limit left it out of the step being launched (before, nothing would ever end it), their blocks
    come back, and the engine serves the next request."""
    import queue

    from llmc.runtime.api import Engine
    from tests.runtime.engine_helpers import LazyStepRunner

    base = make_engine(tiny_build_dir)
    seen: list[int] = []

    class FailingStep:  # the third step planned raises whenever it is computed (LazyStepRunner: at result())
        block_size, num_blocks, vocab_size = base.runner.block_size, base.runner.num_blocks, base.runner.vocab_size

        def execute(self, scheduled):
            seen.append(scheduled.step) if scheduled.step not in seen else None
            if scheduled.step == seen[0] + 2:
                raise RuntimeError("simulated device failure")
            return base.runner.execute(scheduled)

    engine = Engine(LazyStepRunner(FailingStep(), late_masks=True), base.tokenizer, base.recipe, base.eos_token_ids)
    fmt = {"type": "regex", "pattern": "[a-z ]{100,400}"}
    inboxes = {name: queue.Queue() for name in ("short", "long")}
    for name, max_new_tokens in (("short", 3), ("long", 12)):  # both queued first: they share every step, and the
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, structured=fmt)  # third computes
        engine.add_request(name, params, request_id=name, sink=inboxes[name].put)  # short's last token
    engine.start()
    try:
        for name, inbox in inboxes.items():
            event = inbox.get(timeout=60)
            while not event.finished:
                event = inbox.get(timeout=60)  # queue.Empty here: the request never ended
            assert event.finish_reason == "error" and "simulated device failure" in event.error, (name, event)
        assert_all_blocks_free(engine)
        (ok,) = engine.generate(["this one works"], SamplingParams(max_new_tokens=5, temperature=0.0, structured=fmt))
        assert ok.finish_reason == "length" and re.fullmatch("[a-z ]+", ok.text)
    finally:
        engine.shutdown()

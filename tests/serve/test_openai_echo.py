"""Completions with ``echo`` through OpenAI's client and as lm-eval's ``local-completions`` model sends them: the
prompt comes back before the completion, with its tokens' log-probabilities equal to the engine's
``prompt_logprobs``; ``max_tokens: 0`` returns the prompt alone; several prompts in one request."""

from __future__ import annotations

import json
import urllib.request

import pytest

from llmc.request.params import SamplingParams

PROMPT = "Tell me about rivers and the sea"


def scored(offline, prompt, k):
    """The offline engine's prompt log-probabilities and its greedy completion of 3 tokens."""
    return offline.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True,
                                                     prompt_logprobs=k, logprobs=k))[0]


def test_echo_returns_the_prompt_and_its_log_probabilities(client, tiny_server, offline):
    ref = scored(offline, PROMPT, 2)
    ids = offline.tokenize(PROMPT)
    reply = client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                      logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text == PROMPT + ref.text
    got = choice.logprobs
    assert len(got.tokens) == len(ids) + 3 and got.token_logprobs[0] is None and got.top_logprobs[0] is None
    want = [lp.logprob for lp in ref.prompt_logprobs] + [lp.logprob for lp in ref.logprobs]
    assert got.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert all(len(top) <= 2 for top in got.top_logprobs[1:])
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 3
    plain = client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def test_max_tokens_0_scores_the_prompt_alone_streamed_or_not(client, tiny_server, offline):
    ref = scored(offline, PROMPT, 0)
    reply = client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    got = reply.choices[0]
    assert got.text == PROMPT and reply.usage.completion_tokens == 0
    assert got.logprobs.token_logprobs[1:] == pytest.approx([lp.logprob for lp in ref.prompt_logprobs], abs=1e-5)
    chunks = list(client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=0, logprobs=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == got.logprobs.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"


def test_lm_evals_loglikelihood_requests_score_each_continuation(tiny_server, offline):
    # lm-eval's local-completions model: token-id prompts (context + continuation) in one batch, max_tokens 1,
    # logprobs 1, echo; it sums token_logprobs[ctxlen:-1] and calls the continuation greedy when each of its
    # tokens' log-probability is the largest of its top_logprobs
    pairs = [("The river runs", " to the sea"), ("A cat sat on the", " mat"), ("Numbers: one two", " three")]
    batch = [(offline.tokenize(ctx), offline.tokenize(ctx + cont)) for ctx, cont in pairs]
    body = {"model": tiny_server.model, "prompt": [full for _, full in batch], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    request = urllib.request.Request(tiny_server.http + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        out = json.loads(response.read())
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice, (ctx, full) in zip(choices, batch):
        ctxlen = len(ctx)
        logprob = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        greedy = all(v == max(top.values()) for v, top in zip(choice["logprobs"]["token_logprobs"][ctxlen:-1],
                                                              choice["logprobs"]["top_logprobs"][ctxlen:-1]))
        ref = offline.generate([list(full)], SamplingParams(max_new_tokens=1, prompt_logprobs=1))[0]
        want = ref.prompt_logprobs[ctxlen - 1:]  # entry i is prompt token i + 1
        assert logprob == pytest.approx(sum(lp.logprob for lp in want), abs=1e-4)
        assert greedy == all(lp.top[0][0] == lp.token_id for lp in want)
    assert out["usage"]["prompt_tokens"] == sum(len(full) for _, full in batch)
    stats = tiny_server.engine.stats()
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0


def test_each_of_n_streamed_choices_starts_with_the_echoed_prompt(client, tiny_server, offline):
    ref = scored(offline, PROMPT, 1)
    chunks = list(client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                            n=2, logprobs=1, echo=True, stream=True, extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert mine[0].text == PROMPT and mine[0].logprobs.token_logprobs[0] is None
        assert mine[0].logprobs.token_logprobs[1:] == pytest.approx([lp.logprob for lp in ref.prompt_logprobs],
                                                                    abs=1e-5)
        assert "".join(c.text for c in mine) == PROMPT + ref.text

"""Workloads: seeded length distributions within bounds, exact-length synthetic prompts that are pairwise
distinct from their first tokens on (also for a tokenizer that cannot encode the corpus), prompt files, plans."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings, strategies as st

from llmc.bench.workload import (DISTINCT_HEAD, BenchPrompt, LengthDist, RandomTokenIds, TextCorpus, Workload,
                                 file_workload, prompt_length_summary, prompt_source, synthetic_workload)
from llmc.errors import RequestError
from tests.bench.word_tokenizer import word_level_tokenizer


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["fixed", "uniform", "normal"]), mean=st.integers(1, 4000),
       spread=st.floats(0, 0.95), seed=st.integers(0, 2**32))
def test_length_dist_is_seeded_and_within_bounds(kind, mean, spread, seed):
    dist = LengthDist(kind, mean, spread)
    lo, hi = dist.bounds()
    a = dist.sample(random.Random(seed), 50)
    assert a == dist.sample(random.Random(seed), 50)
    assert all(lo <= n <= hi for n in a) and lo >= 1
    if kind == "fixed":
        assert set(a) == {mean}


def test_uniform_and_normal_spread_over_the_range():
    rng = random.Random(0)
    uniform = LengthDist("uniform", 100, 0.5).sample(rng, 2000)
    normal = LengthDist("normal", 100, 0.5).sample(rng, 2000)
    assert min(uniform) == 50 and max(uniform) == 150
    assert abs(sum(uniform) / len(uniform) - 100) < 3
    assert abs(sum(normal) / len(normal) - 100) < 3
    # N(100, 25^2): about 68 % within one sigma, clearly more concentrated than the uniform.
    within = sum(75 <= n <= 125 for n in normal) / len(normal)
    assert 0.6 < within < 0.76


@pytest.mark.parametrize("bad", [dict(kind="poisson", mean=10), dict(kind="fixed", mean=0),
                                 dict(kind="uniform", mean=10, spread=1.0)])
def test_length_dist_rejects_bad_values(bad):
    with pytest.raises(RequestError):
        LengthDist(**bad)


def test_synthetic_prompts_have_exact_lengths_and_reencode(tokenizer, corpus):
    w = synthetic_workload(tokenizer, LengthDist("uniform", 64, 0.5), LengthDist("fixed", 7), 12, seed=3,
                           corpus=corpus)
    expected = LengthDist("uniform", 64, 0.5).sample(random.Random(3), 12)
    assert [p.prompt_tokens for p in w.prompts] == expected
    for p in w.prompts:
        assert tuple(tokenizer(p.text, add_special_tokens=False)["input_ids"]) == p.token_ids
        assert p.max_new_tokens == 7
    again = synthetic_workload(tokenizer, LengthDist("uniform", 64, 0.5), LengthDist("fixed", 7), 12, seed=3,
                               corpus=corpus)
    assert again == w
    other = synthetic_workload(tokenizer, LengthDist("uniform", 64, 0.5), LengthDist("fixed", 7), 12, seed=4,
                               corpus=corpus)
    assert [p.text for p in other.prompts] != [p.text for p in w.prompts]
    assert w.description["isl"] == {"dist": "uniform", "mean": 64, "spread": 0.5, "min": 32, "max": 96}


def test_prompt_files(tmp_path, tokenizer):
    txt = tmp_path / "p.txt"
    txt.write_text("hello world\n\nsecond prompt here\n")
    w = file_workload(txt, tokenizer, default_max_tokens=5)
    assert [p.text for p in w.prompts] == ["hello world", "second prompt here"]
    assert [p.max_new_tokens for p in w.prompts] == [5, 5]
    assert w.prompts[0].token_ids == tuple(tokenizer("hello world", add_special_tokens=False)["input_ids"])

    jsonl = tmp_path / "p.jsonl"
    messages = [{"role": "user", "content": "Hi there"}]
    jsonl.write_text(json.dumps({"prompt": "abc", "max_tokens": 3}) + "\n" + json.dumps({"messages": messages}) + "\n")
    w = file_workload(jsonl, tokenizer, default_max_tokens=9)
    assert [p.max_new_tokens for p in w.prompts] == [3, 9]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert w.prompts[1].text == rendered and "<|im_start|>user" in rendered
    assert w.prompts[1].token_ids == tuple(tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("line", ['{"max_tokens": 3}', '{"prompt": "a", "messages": []}', "not json",
                                  '{"prompt": "a", "max_tokens": 0}', '{"prompt": ""}'])
def test_bad_jsonl_lines_are_request_errors(tmp_path, tokenizer, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(RequestError) as info:
        file_workload(path, tokenizer, 4)
    assert "bad.jsonl:1" in str(info.value) or "JSON" in str(info.value)


def test_missing_prompt_file(tmp_path, tokenizer):
    with pytest.raises(RequestError, match="does not exist"):
        file_workload(tmp_path / "nope.txt", tokenizer, 4)


def test_prompt_length_summary_buckets():
    prompts = [BenchPrompt("", (0,) * n, 2) for n in (1, 128, 129, 512, 513)]
    summary = prompt_length_summary(prompts)
    assert summary["by_bucket"] == {"<=128": 2, "129-512": 2, ">512": 1}
    assert summary["prompt_tokens"]["min"] == 1 and summary["prompt_tokens"]["max"] == 513


# ----------------------------------------------------------------------------- distinct synthetic prompts
def shared_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_distinct_from_the_first_tokens(workload: Workload, num_special: int = 0) -> None:
    """Pairwise distinct prompts, no two sharing more than their special tokens plus DISTINCT_HEAD - 1 tokens
    (so none can reuse a cached KV block of another: blocks hold >= 8 tokens)."""
    ids = [p.token_ids for p in workload.prompts]
    assert len(set(ids)) == len(ids)
    longest = max(shared_prefix(a, b) for i, a in enumerate(ids) for b in ids[:i])
    assert longest <= num_special + DISTINCT_HEAD - 1 < 8


def test_corpus_prompts_are_pairwise_distinct_from_the_first_tokens(tokenizer, corpus):
    assert corpus.problem() is None  # SmolLM2's BPE encodes the corpus: prompts are real text
    w = synthetic_workload(tokenizer, LengthDist("uniform", 48, 0.5), LengthDist("fixed", 4), 200, seed=5,
                           corpus=corpus)
    assert w.description["source"] == "synthetic:pydoc_data.topics"
    assert_distinct_from_the_first_tokens(w, corpus.num_special)


def test_word_level_tokenizer_gets_distinct_random_ids_that_round_trip(word_tokenizer):
    corpus = TextCorpus(word_tokenizer)
    assert set(corpus.ids) == {0}  # every pydoc word is unknown: cut prompts would be id 0 repeated
    assert "unknown token 't0'" in corpus.problem()
    source = prompt_source(word_tokenizer, exclude_ids=(7,))
    assert isinstance(source, RandomTokenIds)
    w = synthetic_workload(word_tokenizer, LengthDist("uniform", 40, 0.5), LengthDist("fixed", 4), 60, seed=2,
                           corpus=source)
    assert w.description["source"] == "synthetic:random-token-ids" and "unknown token" in w.description["why"]
    assert [p.prompt_tokens for p in w.prompts] == LengthDist("uniform", 40, 0.5).sample(random.Random(2), 60)
    used = {i for p in w.prompts for i in p.token_ids}
    assert used.isdisjoint({0, 299, 7})  # neither the unknown nor the eos token nor an excluded id
    assert len(used) > 200  # spread over the vocabulary
    for p in w.prompts:  # the same tokens offline (ids) and over HTTP (text)
        assert tuple(word_tokenizer(p.text, add_special_tokens=False)["input_ids"]) == p.token_ids
        assert tuple(word_tokenizer(word_tokenizer.decode(p.token_ids))["input_ids"]) == p.token_ids
    assert_distinct_from_the_first_tokens(w)
    again = synthetic_workload(word_tokenizer, LengthDist("uniform", 40, 0.5), LengthDist("fixed", 4), 60, seed=2,
                               exclude_ids=(7,))
    assert again == w  # seeded, and the same source is chosen without passing it


def test_random_ids_repair_merging_tokenizers(tokenizer):
    """A BPE tokenizer merges many random neighbours; the kept prompts still round-trip exactly."""
    source = RandomTokenIds(tokenizer, reason="forced")
    w = synthetic_workload(tokenizer, LengthDist("fixed", 96), LengthDist("fixed", 4), 12, seed=1, corpus=source)
    for p in w.prompts:
        assert p.prompt_tokens == 96
        assert tuple(tokenizer(p.text, add_special_tokens=False)["input_ids"]) == p.token_ids
        assert not set(p.token_ids) & set(tokenizer.all_special_ids)
    assert_distinct_from_the_first_tokens(w)


def test_too_many_prompts_for_distinct_beginnings_is_a_request_error():
    tiny = word_level_tokenizer(4, 3)  # two usable ids: 2^4 distinct beginnings at most
    with pytest.raises(RequestError, match="begin differently.*--num-prompts"):
        synthetic_workload(tiny, LengthDist("fixed", 6), LengthDist("fixed", 2), 40)


class _CharTokenizer:
    """One id per character (``encode``), text back through ``decode``: a stand-in for odd tokenizers."""

    unk_token_id = None

    def __init__(self, encode, decode):
        self._encode, self._decode = encode, decode

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self._encode(c) for c in text]}

    def decode(self, ids):
        return "".join(self._decode(i) for i in ids)


@pytest.mark.parametrize("encode, decode, problem", [
    (ord, chr, None),
    (lambda c: 1 if c.isalpha() else ord(c), chr, "token id 1 is"),  # letters are most of the text
    (ord, lambda i: chr(i) * 2, "re-encodes"),  # decode does not invert encode
])
def test_corpus_problems_are_named(encode, decode, problem):
    found = TextCorpus(_CharTokenizer(encode, decode)).problem()
    assert found == problem if problem is None else problem in found


def test_prompts_that_would_begin_alike_are_drawn_again():
    """Character-level windows of English text often begin alike (" the ..."); the workload draws those again."""
    chars = _CharTokenizer(ord, chr)
    w = synthetic_workload(chars, LengthDist("fixed", 20), LengthDist("fixed", 2), 300, seed=0,
                           corpus=TextCorpus(chars))
    assert_distinct_from_the_first_tokens(w)

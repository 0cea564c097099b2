"""TrtllmRunner's calls into ModelRunnerCpp (TensorRT-LLM 1.0 - 1.2's model_runner_cpp.py), checked against a
recording test double that behaves like upstream (per-request stop words, executor request ids, cancel), and
the text/stop layer llmc runs on top of TensorRT-LLM's token stream."""

from __future__ import annotations

import pytest
import torch

from llmc.engine.tensorrt_llm.manifest import EngineManifest
from llmc.engine.tensorrt_llm.runner import TrtllmRunner, TrtllmRunnerConfig
from llmc.errors import EngineError, RequestError
from llmc.request.params import SamplingParams
from llmc.tokenizer import load_tokenizer
from tests.engine.tensorrt_llm.doubles import RecordingModelRunnerCpp

EOS = (2, 0)  # <|im_end|> first (end_id), <|endoftext|> second (a stop word)
CONFIG = TrtllmRunnerConfig(engine_dir="/engines/x", rank=0, max_batch_size=4, max_input_len=16, max_seq_len=48,
                            kv_cache_free_gpu_memory_fraction=0.85, enable_chunked_context=True)


@pytest.fixture(scope="module")
def tokenizer(smollm2_hf_dir):
    return load_tokenizer(smollm2_hf_dir)


def make_runner(tokenizer, script, chunk=2):
    cls = RecordingModelRunnerCpp.with_script(script, chunk=chunk, max_seq_len=CONFIG.max_seq_len)
    return TrtllmRunner(CONFIG, tokenizer, EOS, model_runner_cls=cls), cls


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_from_dir_arguments(tokenizer):
    _, cls = make_runner(tokenizer, [[5]])
    (runner,) = cls.instances
    assert runner.engine_dir == "/engines/x"
    assert runner.from_dir_kwargs == {"rank": 0, "max_batch_size": 4, "max_input_len": 16, "max_output_len": 32,
                                      "kv_cache_free_gpu_memory_fraction": 0.85, "enable_chunked_context": True}


def test_generate_always_gets_end_id_pad_id_and_max_new_tokens(tokenizer):
    runner, cls = make_runner(tokenizer, [ids(tokenizer, " a b c")])
    runner.generate([[1, 9, 10]])  # default SamplingParams: nothing set by the caller
    (call,) = cls.instances[0].generate_calls
    assert type(call["end_id"]) is int and call["end_id"] == 2
    assert type(call["pad_id"]) is int
    assert type(call["max_new_tokens"]) is int and call["max_new_tokens"] == 45  # min(256, 48 - 3)
    assert call["streaming"] is True and call["return_dict"] is True and call["output_sequence_lengths"] is True
    (prompt,) = call["batch_input_ids"]
    assert prompt.dtype == torch.int32 and prompt.tolist() == [1, 9, 10]
    assert set(call) == {"batch_input_ids", "max_new_tokens", "end_id", "pad_id", "stop_words_list", "streaming",
                         "temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty", "return_dict", "output_sequence_lengths"}


def test_stop_words_list_has_other_eos_ids_stop_ids_and_stop_strings(tokenizer):
    runner, cls = make_runner(tokenizer, [[5], [5]])
    runner.generate([[1, 9], [1, 9, 10]], SamplingParams(max_new_tokens=4, stop_token_ids=(7,), stop=("Hello",)))
    swl = cls.instances[0].generate_calls[0]["stop_words_list"]
    # One list of token-id lists per request (generate zips it per request into Request(stop_words=...)):
    # eos id 0 (the second recorded eos), stop id 7, then "Hello"'s ids.
    assert swl == [[[0], [7], ids(tokenizer, "Hello")]] * 2
    assert [r.stop_words for _, r in cls.instances[0].recording.enqueued] == [[[0], [7], ids(tokenizer, "Hello")]] * 2


def test_stop_words_reach_each_request_as_word_lists_llama3_style(tokenizer):
    """Issue 16 item 3: two eos ids (Llama-3: 128001 then 128009) and two multi-token stop words. The
    executor must receive the words themselves; the Triton [2, N] tensor form would make its offset row a
    stop word (here [1, 3, 6]) and leave the real words unmatched."""
    eos = (2, 0)
    word_a, word_b = ids(tokenizer, " over there"), ids(tokenizer, " the end now")
    assert len(word_a) == 2 and len(word_b) == 3
    script = ids(tokenizer, " go") + [1, 3, 6] + ids(tokenizer, " and") + word_a + ids(tokenizer, " more text")
    cls = RecordingModelRunnerCpp.with_script([script, script], chunk=3, max_seq_len=CONFIG.max_seq_len)
    runner = TrtllmRunner(CONFIG, tokenizer, eos, model_runner_cls=cls)
    params = SamplingParams(max_new_tokens=30, stop=(tokenizer.decode(word_a), tokenizer.decode(word_b)))
    done = runner.generate([[1, 9], [1]], params)
    executor = cls.instances[0].recording
    assert [r.stop_words for _, r in executor.enqueued] == [[[0], word_a, word_b]] * 2
    assert list(executor.finished.values()) == ["stop_words", "stop_words"]  # stopped at word_a, not at 1, 3, 6
    for completion in done:
        assert list(completion.token_ids[:-len(word_a)]) == ids(tokenizer, " go") + [1, 3, 6] + ids(tokenizer, " and")
        assert completion.text == " go and"  # 1, 3, 6 are special tokens, skipped in the text
        assert (completion.finish_reason, completion.stop_reason) == ("stop", tokenizer.decode(word_a))


def test_no_stop_words_passes_none(tokenizer):
    cls = RecordingModelRunnerCpp.with_script([[5]])
    TrtllmRunner(CONFIG, tokenizer, (2,), model_runner_cls=cls).generate([[1]], SamplingParams(max_new_tokens=2))
    assert cls.instances[0].generate_calls[0]["stop_words_list"] is None


def test_greedy_and_sampling_mapping(tokenizer):
    runner, cls = make_runner(tokenizer, [[5]])
    runner.generate([[1]], SamplingParams(temperature=0.0, max_new_tokens=1))
    runner.generate([[1]], SamplingParams(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1,
                                          presence_penalty=0.2, frequency_penalty=0.3, seed=5, max_new_tokens=1))
    greedy, sampled = cls.instances[0].generate_calls
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (1.0, 1, 1.0)
    assert "random_seed" not in greedy
    assert {k: sampled[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty",
                                    "frequency_penalty", "random_seed")} == {
        "temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1, "presence_penalty": 0.2,
        "frequency_penalty": 0.3, "random_seed": 5}


def test_streaming_slices_new_tokens_after_the_prompt(tokenizer):
    a, b = ids(tokenizer, " The cat sat on the mat"), ids(tokenizer, " Hi")
    runner, _ = make_runner(tokenizer, [a, b], chunk=2)
    events = list(runner.stream_batch([[1, 9, 10, 11], [1]], SamplingParams(max_new_tokens=20), ["a", "b"]))
    by_id = {rid: [e for e in events if e.request_id == rid] for rid in ("a", "b")}
    for rid, script in (("a", a), ("b", b)):
        evs = by_id[rid]
        assert [t for e in evs for t in e.token_ids] == script + [2]  # the stream ended at end_id
        assert "".join(e.text for e in evs) == tokenizer.decode(script)
        assert [e.finished for e in evs] == [False] * len(script) + [True]
        assert (evs[-1].finish_reason, evs[-1].stop_reason) == ("stop", 2)


def test_length_limit(tokenizer):
    script = ids(tokenizer, " one two three four five six")
    runner, cls = make_runner(tokenizer, [script], chunk=3)
    (done,) = runner.generate([[1, 9]], SamplingParams(max_new_tokens=4))
    assert cls.instances[0].generate_calls[0]["max_new_tokens"] == 4
    assert list(done.token_ids) == script[:4] and done.finish_reason == "length"
    assert done.text == tokenizer.decode(script[:4])


def test_stop_string_handled_on_top(tokenizer):
    script = ids(tokenizer, " Hello world. Bye now")
    runner, _ = make_runner(tokenizer, [script], chunk=1)
    (done,) = runner.generate([[1]], SamplingParams(max_new_tokens=30, stop=("world",)))
    assert done.text == " Hello " and (done.finish_reason, done.stop_reason) == ("stop", "world")
    assert len(done.token_ids) < len(script)


def test_second_eos_id_stops_like_the_torch_backend(tokenizer):
    script = ids(tokenizer, " yes") + [0] + ids(tokenizer, " ignored")
    runner, _ = make_runner(tokenizer, [script], chunk=4)
    (done,) = runner.generate([[1]], SamplingParams(max_new_tokens=30))
    assert list(done.token_ids) == ids(tokenizer, " yes") + [0]
    assert (done.text, done.finish_reason, done.stop_reason) == (" yes", "stop", 0)


def test_metrics_are_filled(tokenizer):
    runner, _ = make_runner(tokenizer, [ids(tokenizer, " a b")])
    events = list(runner.stream([1, 9], SamplingParams(max_new_tokens=8)))
    m = events[-1].metrics
    assert m.prompt_tokens == 2 and m.generated_tokens == 3 and len(m.token_times) == 3
    assert m.first_token_time is not None and m.finished_time is not None


@pytest.mark.parametrize("params, field", [(SamplingParams(ignore_eos=True), "ignore_eos"),
                                           (SamplingParams(logprobs=2), "logprobs"),
                                           (SamplingParams(structured={"type": "json_object"}), "structured"),
                                           (SamplingParams(logit_bias={"3": 1}), "logit_bias")])
def test_options_the_backend_cannot_honour_are_refused(tokenizer, params, field):
    runner, cls = make_runner(tokenizer, [[5]])
    with pytest.raises(RequestError, match="is not supported by the tensorrt_llm backend") as exc:
        runner.generate([[1]], params)
    assert exc.value.field == field and cls.instances[0].generate_calls == []


def test_min_p_and_min_tokens_are_passed_when_set(tokenizer):
    """Issue 16 item 6: ModelRunnerCpp.generate accepts min_p and min_tokens (its accepted_parameters)."""
    runner, cls = make_runner(tokenizer, [[5]])
    runner.generate([[1]], SamplingParams(temperature=0.5, min_p=0.1, min_tokens=3, max_new_tokens=4))
    runner.generate([[1]], SamplingParams(max_new_tokens=4))
    with_both, plain = cls.instances[0].generate_calls
    assert (with_both["min_p"], with_both["min_tokens"]) == (0.1, 3)
    assert type(with_both["min_tokens"]) is int and "min_p" not in plain and "min_tokens" not in plain


def test_request_finished_early_by_llmc_is_cancelled_and_drained(tokenizer):
    """Issue 16 item 5: llmc's stop string ends request 0 while the executor would go on; it is cancelled,
    its remaining responses are consumed, and the next generate sees only its own responses."""
    script = ids(tokenizer, " Hello world. Bye now and more words follow here")
    runner, cls = make_runner(tokenizer, [script, script], chunk=1)
    first = runner.generate([[1], [1, 9]], SamplingParams(max_new_tokens=30, stop=("world",)))
    assert [c.finish_reason for c in first] == ["stop", "stop"]
    executor = cls.instances[0].recording
    assert sorted(executor.cancelled) == [100, 101] and executor.finished == {100: "cancelled", 101: "cancelled"}
    assert executor.active == {} and executor.stray_cancels == []
    (second,) = runner.generate([[1]], SamplingParams(max_new_tokens=3))  # would raise ValueError if stale
    assert list(second.token_ids) == script[:3] and second.finish_reason == "length"
    assert executor.finished[102] == "length" and 102 not in executor.cancelled  # finished ids are not cancelled


def test_abandoned_stream_cancels_its_requests(tokenizer):
    script = ids(tokenizer, " one two three four five six seven")
    runner, cls = make_runner(tokenizer, [script], chunk=1)
    events = runner.stream([1], SamplingParams(max_new_tokens=20))
    next(events), next(events)
    events.close()  # a client went away
    executor = cls.instances[0].recording
    assert executor.cancelled == [100] and executor.finished == {100: "cancelled"} and executor.active == {}
    (done,) = runner.generate([[1]], SamplingParams(max_new_tokens=2))
    assert list(done.token_ids) == script[:2]


def test_executor_error_cancels_and_drains_the_rest_of_the_batch(tokenizer):
    script = ids(tokenizer, " one two three four five six seven")
    runner, cls = make_runner(tokenizer, [script, script], chunk=1)
    executor = cls.instances[0].recording
    executor.fail[0] = 2  # request 0 errors on its third response, request 1 is still running
    with pytest.raises(RuntimeError, match="scripted executor error"):
        runner.generate([[1], [1]], SamplingParams(max_new_tokens=20))
    assert executor.finished == {100: "error", 101: "cancelled"} and executor.active == {}
    assert executor.cancelled == [101]
    (done,) = runner.generate([[1]], SamplingParams(max_new_tokens=2))
    assert list(done.token_ids) == script[:2]


def test_prompt_over_max_input_len_is_refused(tokenizer):
    runner, cls = make_runner(tokenizer, [[5]])
    with pytest.raises(RequestError, match="engine.max_input_len"):
        runner.generate([list(range(17))])
    assert cls.instances[0].generate_calls == []


def test_engine_from_other_tensorrt_is_refused_before_loading(tmp_path):
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    EngineManifest(1, "tensorrt_llm", "10.13.2", "1.2.0", "NVIDIA H100", "9.0", 1, 3.0, {}).write(engine_dir)
    cls = RecordingModelRunnerCpp.with_script([[5]])
    with pytest.raises(EngineError, match="rebuild with llmc build --force"):
        TrtllmRunner.from_build_dir(tmp_path, model_runner_cls=cls,
                                    found_versions={"tensorrt": "10.9.0", "tensorrt_llm": "1.1.0"})
    assert cls.instances == []

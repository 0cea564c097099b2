"""Engine per request on CPU: stop ids / EOS / stop strings / min_tokens, seeded sampling, the queue limit,
bad input named by field, duplicate ids, UTF-8 and chat prompts, recipe defaults. Tiny random Llama builds."""

from __future__ import annotations

import pytest

from llmc.errors import QueueFullError, RequestError
from llmc.request.params import SamplingParams
from tests.runtime.engine_helpers import GREEDY, assert_all_blocks_free, make_engine

# --------------------------------------------------------------------------------------------- stops
def test_stop_token_id_finishes_with_stop_reason(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    (free,) = engine.generate(["Stop here"], GREEDY)
    target = free.token_ids[4]
    first = free.token_ids.index(target)
    (stopped,) = engine.generate(["Stop here"], GREEDY.replace(stop_token_ids=(target,)))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_eos_ids_stop_unless_ignore_eos(tiny_build_dir):
    from llmc.runtime.api import Engine

    base = make_engine(tiny_build_dir)
    assert base.eos_token_ids == (2,)  # reconciled by the build and read from manifest.json
    free = base.generate(["eos"], GREEDY)[0].token_ids
    eos = free[2]
    engine = Engine(base.runner, base.tokenizer, base.recipe, eos_token_ids=(eos,))
    (stopped,) = engine.generate(["eos"], GREEDY.replace(ignore_eos=False))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == eos
    assert stopped.token_ids == free[: free.index(eos) + 1]
    (ignored,) = engine.generate(["eos"], GREEDY)
    assert ignored.token_ids == free


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_cut_or_kept(tiny_build_dir, include):
    engine = make_engine(tiny_build_dir)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    (free,) = engine.generate(["A stop string test"], params)
    text = free.text
    assert len(text) > 12
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cut = text.index(stop)
    (stopped,) = engine.generate(["A stop string test"], params.replace(stop=(stop,),
                                                                        include_stop_str_in_output=include))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == (text[: cut + len(stop)] if include else text[:cut])


def test_min_tokens_delays_stop_tokens(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    (free,) = engine.generate(["min tokens"], GREEDY)
    target = free.token_ids[0]
    (stopped,) = engine.generate(["min tokens"], GREEDY.replace(stop_token_ids=(target,), min_tokens=3))
    assert target not in stopped.token_ids[:3]
    assert len(stopped.token_ids) > 3
    if stopped.finish_reason == "stop":
        assert stopped.token_ids[-1] == target and target not in stopped.token_ids[:-1]
    else:
        assert len(stopped.token_ids) == GREEDY.max_new_tokens


# ------------------------------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_regardless_of_batch_companions(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    seeded = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    (alone,) = engine.generate(["Random words:"], seeded)
    companions = ["Other prompt", "A much longer companion prompt with many more tokens in it", "x"]
    batch = engine.generate(
        companions[:2] + ["Random words:"] + companions[2:],
        [SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True),
         SamplingParams(max_new_tokens=10, temperature=0.7, seed=7, ignore_eos=True), seeded,
         SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)],
    )
    assert batch[2].token_ids == alone.token_ids
    (other_seed,) = engine.generate(["Random words:"], seeded.replace(seed=4321))
    assert other_seed.token_ids != alone.token_ids


# ---------------------------------------------------------------------------------- limits, bad input
def test_queue_full_rejects_new_requests(tiny_build_dir):
    engine = make_engine(tiny_build_dir, max_queue_size=2)
    engine.add_request("one", GREEDY)
    engine.add_request("two", GREEDY)
    with pytest.raises(QueueFullError, match="max_queue_size"):
        engine.add_request("three", GREEDY)
    engine.step()  # both admitted: the queue has room again
    engine.add_request("three", GREEDY)
    completions = engine.generate(["four", "five", "six"], GREEDY)  # generate waits for room instead
    assert [c.finish_reason for c in completions] == ["length"] * 3


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", None, "prompt"),
        ([], None, "prompt"),
        (b"\xff\xfe bad", None, "prompt"),
        ([1, 2, 49152], None, "prompt"),
        ([7] * 257, None, "prompt"),  # max_input_len is 256: rejected, not truncated
        ("hi", SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ("hi", SamplingParams(temperature=-0.5), "temperature"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(stop_token_ids=(49152,)), "stop_token_ids"),
        ([{"role": "user"}], None, "prompt[0]"),
        (3.14, None, "prompt"),
    ],
)
def test_bad_input_raises_request_error_naming_the_field(tiny_build_dir, prompt, params, field):
    engine = make_engine(tiny_build_dir)
    with pytest.raises(RequestError) as err:
        engine.add_request(prompt, params)
    assert err.value.field == field
    assert_all_blocks_free(engine)


def test_duplicate_request_id_is_rejected(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    engine.add_request("a", GREEDY, request_id="same")
    with pytest.raises(RequestError) as err:
        engine.add_request("b", GREEDY, request_id="same")
    assert err.value.field == "request_id"
    engine.abort("same")


def test_utf8_bytes_and_chat_prompts_are_accepted(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    by_bytes = engine.generate(["héllo".encode()], GREEDY)[0]
    by_text = engine.generate(["héllo"], GREEDY)[0]
    assert by_bytes.token_ids == by_text.token_ids
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    rendered = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    by_chat = engine.generate([messages], GREEDY)[0]
    by_ids = engine.generate([engine.tokenizer(rendered, add_special_tokens=False)["input_ids"]], GREEDY)[0]
    assert by_chat.token_ids == by_ids.token_ids


def test_recipe_defaults_apply_when_params_are_omitted(tiny_build_dir):
    engine = make_engine(tiny_build_dir)
    (completion,) = engine.generate(["defaults"])
    assert engine.default_params.max_new_tokens == 16 and engine.default_params.temperature == 0.0
    assert len(completion.token_ids) == 16 or completion.finish_reason == "stop"

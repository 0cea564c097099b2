"""The runtime <-> runner contract: the decode definition, and the runner Protocols both backends satisfy."""

from __future__ import annotations

import inspect

import pytest

from llmc.engine.tensorrt_llm.runner import TrtllmRunner, TrtllmRunnerConfig
from llmc.engine.torch.runner import TorchModelRunner
from llmc.engine.types import BatchRunner, ModelRunner, ScheduledSequence, StepRunner, is_decode
from llmc.request.params import SamplingParams
from llmc.tokenizer import load_tokenizer
from tests.engine.tensorrt_llm.doubles import RecordingModelRunnerCpp

CONFIG = TrtllmRunnerConfig(engine_dir="/engines/x", rank=0, max_batch_size=4, max_input_len=16, max_seq_len=48,
                            kv_cache_free_gpu_memory_fraction=0.85, enable_chunked_context=True)


def seq(new_tokens: int, num_computed: int, prompt_len: int) -> ScheduledSequence:
    return ScheduledSequence("r", tuple(range(new_tokens)), num_computed, (0,), True, SamplingParams(),
                             prompt_token_ids=tuple(range(prompt_len)))


@pytest.mark.parametrize("new, computed, prompt, decode", [
    (1, 5, 5, True),  # the last sampled token
    (1, 4, 5, True),  # the last prompt token after a chunked (or prefix-cached) prefill: decode-shaped
    (3, 0, 3, False),  # a prompt
    (2, 4, 8, False),  # a prefill chunk
])
def test_a_decode_is_one_new_token(new, computed, prompt, decode):
    assert seq(new, computed, prompt).is_decode is decode is is_decode(new)


@pytest.fixture(scope="module")
def torch_runner(tiny_build_dir):
    return TorchModelRunner(tiny_build_dir, device="cpu")


@pytest.fixture(scope="module")
def trtllm_runner(smollm2_hf_dir):
    """TensorRT-LLM's runner over the recording test double of ModelRunnerCpp."""
    cls = RecordingModelRunnerCpp.with_script([[5]], max_seq_len=CONFIG.max_seq_len)
    return TrtllmRunner(CONFIG, load_tokenizer(smollm2_hf_dir), (2, 0), model_runner_cls=cls)


def protocol_methods(protocol: type) -> dict[str, inspect.Signature]:
    """The methods a Protocol declares (its own and inherited), by name."""
    return {name: inspect.signature(member) for klass in protocol.__mro__ if klass.__module__ == protocol.__module__
            for name, member in vars(klass).items() if inspect.isfunction(member) and not name.startswith("_")}


def assert_satisfies(runner: object, protocol: type) -> None:
    """``isinstance`` checks that every member exists; this also checks each method's parameters."""
    assert isinstance(runner, protocol) and isinstance(runner, ModelRunner)
    for name, expected in protocol_methods(protocol).items():
        got = inspect.signature(getattr(type(runner), name))
        assert list(got.parameters) == list(expected.parameters), (type(runner).__name__, name)
        assert [p.default for p in got.parameters.values()] == [p.default for p in expected.parameters.values()]


def test_the_torch_runner_is_a_step_runner(torch_runner):
    assert_satisfies(torch_runner, StepRunner)
    assert not isinstance(torch_runner, BatchRunner)
    assert torch_runner.vocab_size > 0 and torch_runner.num_blocks > 0


def test_the_tensorrt_llm_runner_is_a_batch_runner(trtllm_runner):
    assert_satisfies(trtllm_runner, BatchRunner)
    assert not isinstance(trtllm_runner, StepRunner)  # no block_size / num_blocks / execute: it batches by itself
    assert trtllm_runner.vocab_size == len(trtllm_runner.tokenizer)


def test_a_protocol_check_notices_a_missing_member(torch_runner):
    class Half:
        vocab_size, block_size = 10, 16

        def execute(self, scheduled):
            return None

    assert isinstance(Half(), ModelRunner) and not isinstance(Half(), StepRunner)  # no num_blocks
    assert protocol_methods(StepRunner).keys() == {"execute"}
    assert protocol_methods(BatchRunner).keys() == {"generate", "stream"}

"""``Engine.from_dir`` on a TensorRT-LLM build folder: the request API over TrtllmRunner.

The build folder is a real tiny build whose manifest is switched to ``backend: tensorrt_llm`` plus an
``engine_manifest.json`` (no TensorRT engine can be built here); ModelRunnerCpp is the recording test double.
"""

from __future__ import annotations

import json

import pytest

from llmc.engine.tensorrt_llm.engine import TrtllmEngine
from llmc.engine.tensorrt_llm.manifest import EngineManifest
from llmc.errors import BackendUnavailableError, EngineError, RequestError
from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine
from tests.engine.tensorrt_llm.doubles import RecordingModelRunnerCpp
from tests.runtime.engine_helpers import TINY_LIMITS, build_engine_dir

VERSIONS = {"tensorrt": "10.13.2", "tensorrt_llm": "1.2.0"}


@pytest.fixture(scope="module")
def trt_build_dir(tmp_path_factory, tiny_hf_dir):
    """A tiny build relabelled as a TensorRT-LLM build (float16, as that backend requires)."""
    build = build_engine_dir(tiny_hf_dir, tmp_path_factory.mktemp("trt") / "tiny-trt", "tiny-trt", TINY_LIMITS)
    manifest_path = build / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["backend"] = "tensorrt_llm"
    manifest["recipe"]["backend"] = "tensorrt_llm"
    manifest["recipe"]["model"]["dtype"] = "float16"
    manifest_path.write_text(json.dumps(manifest))
    EngineManifest(1, "tensorrt_llm", VERSIONS["tensorrt"], VERSIONS["tensorrt_llm"], "NVIDIA H100", "9.0", 1, 1.0,
                   {}).write(build / "engine")
    return build


def open_engine(build, script):
    cls = RecordingModelRunnerCpp.with_script(script, max_seq_len=TINY_LIMITS["max_seq_len"])
    return TrtllmEngine.from_build_dir(build, model_runner_cls=cls, found_versions=VERSIONS), cls


def test_from_dir_without_tensorrt_llm_says_what_is_needed(trt_build_dir):
    with pytest.raises(BackendUnavailableError, match="backend: torch"):
        Engine.from_dir(trt_build_dir)


def test_text_prompt_is_tokenized_like_the_torch_engine_and_streams_events(trt_build_dir):
    from llmc.tokenizer import load_tokenizer

    words = load_tokenizer(trt_build_dir / "tokenizer").encode(" the cat sat", add_special_tokens=False)
    engine, cls = open_engine(trt_build_dir, [words + [2]])
    events = list(engine.stream("Hello there", SamplingParams(max_new_tokens=8, temperature=0.0)))
    (call,) = cls.instances[0].generate_calls
    expected = engine.tokenizer("Hello there", add_special_tokens=engine.recipe.model.add_special_tokens).input_ids
    assert call["batch_input_ids"][0].tolist() == expected
    assert [t for e in events for t in e.token_ids] == words + [2]
    assert events[-1].finished and events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == " the cat sat"


def test_generate_uses_recipe_defaults_and_validates(trt_build_dir):
    engine, cls = open_engine(trt_build_dir, [[5, 6], [7, 8]])
    done = engine.generate(["a", [{"role": "user", "content": "hi"}]])
    assert [c.token_ids[:2] for c in done] == [(5, 6), (7, 8)]
    call = cls.instances[0].generate_calls[0]
    assert call["max_new_tokens"] == engine.recipe.runtime.sampling.max_new_tokens
    with pytest.raises(RequestError, match="top_p"):
        engine.generate(["a"], SamplingParams(top_p=0.0))
    with pytest.raises(RequestError, match="prompt"):
        engine.generate([""])


def test_concurrent_api_points_to_triton(trt_build_dir):
    engine, _ = open_engine(trt_build_dir, [[5]])
    for call in (lambda: engine.add_request("a"), engine.start, lambda: engine.astream("a")):
        with pytest.raises(EngineError, match="tritonserver --model-repository"):
            call()
    assert engine.abort("nothing") is False

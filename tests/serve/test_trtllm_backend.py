"""The generated ``tensorrt_llm`` Triton model against what the tensorrtllm C++ backend reads (issue 16, items 1
and 4): parameters it reads unconditionally, and request input names (``seed`` / ``min_tokens`` since 2025).
Configs are parsed with Triton's own schema (tritonclient's model_config_pb2)."""

from __future__ import annotations

import dataclasses
import importlib.util

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from llmc.manifest import read_manifest
from llmc.serve.repo import generate_model_repo, template_root
from llmc.serve.trtllm_backend import INPUT_NAMES, REQUIRED_PARAMETERS, check_trtllm_model


def _trt_repo(build_dir, out):
    recipe = dataclasses.replace(read_manifest(build_dir).recipe_obj(), backend="tensorrt_llm")
    return generate_model_repo(build_dir, out, recipe=recipe, eos_token_ids=(2, 0))


def _parse(path):
    config = model_config_pb2.ModelConfig()
    text_format.Parse(path.read_text(), config)
    return config


def test_backend_facts_name_the_renamed_inputs_and_the_unconditional_parameters():
    # utils.h InputFieldsNames (1.0 - 1.2): seed / min_tokens; the pre-2025 names are gone.
    assert {"seed", "min_tokens"} <= INPUT_NAMES and not {"random_seed", "min_length"} & INPUT_NAMES
    # model_instance_state.cc: read without try/catch.
    assert set(REQUIRED_PARAMETERS) == {"gpt_model_type", "tokenizer_dir", "xgrammar_tokenizer_info_path",
                                        "guided_decoding_backend"}


def test_generated_model_has_every_unconditional_parameter(serve_tiny_build, tmp_path):
    config = _parse(_trt_repo(serve_tiny_build, tmp_path / "repo") / "tensorrt_llm" / "config.pbtxt")
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert set(REQUIRED_PARAMETERS) <= set(params)
    assert params["gpt_model_type"] == "inflight_fused_batching"
    # Guided decoding on (xgrammar, with the tokenizer info JSON beside the config); tokenizer_dir is read but
    # ignored by the C++ backend, so it stays empty (= unset).
    assert params["tokenizer_dir"] == "" and params["guided_decoding_backend"] == "xgrammar"
    assert params["xgrammar_tokenizer_info_path"].endswith("/tensorrt_llm/xgrammar_tokenizer_info.json")
    assert check_trtllm_model(config) == []


def test_every_generated_input_is_one_the_backend_reads(serve_tiny_build, tmp_path):
    repo = _trt_repo(serve_tiny_build, tmp_path / "repo")
    trt = _parse(repo / "tensorrt_llm" / "config.pbtxt")
    names = {t.name for t in trt.input}
    assert names <= INPUT_NAMES and {"seed", "min_tokens"} <= names
    (step,) = [s for s in _parse(repo / "ensemble" / "config.pbtxt").ensemble_scheduling.step
               if s.model_name == "tensorrt_llm"]
    assert step.input_map["seed"] == "random_seed" and step.input_map["min_tokens"] == "min_length"
    assert set(step.input_map) <= names


def test_bls_model_passes_sampling_inputs_under_the_backend_names(serve_tiny_build, tmp_path):
    repo = _trt_repo(serve_tiny_build, tmp_path / "repo")
    spec = importlib.util.spec_from_file_location("bls_model", template_root() / "tensorrt_llm_bls" / "1" / "model.py")
    bls = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bls)
    trt_inputs = {t.name for t in _parse(repo / "tensorrt_llm" / "config.pbtxt").input}
    assert bls.PASSTHROUGH["random_seed"] == "seed" and bls.PASSTHROUGH["min_length"] == "min_tokens"
    assert set(bls.PASSTHROUGH.values()) <= trt_inputs


def test_check_reports_a_missing_parameter_and_an_unread_input(serve_tiny_build, tmp_path):
    path = _trt_repo(serve_tiny_build, tmp_path / "repo") / "tensorrt_llm" / "config.pbtxt"
    guided = 'parameters { key: "guided_decoding_backend" value: { string_value: "xgrammar" } }'
    text = path.read_text().replace(guided, "")
    text = text.replace('name: "seed" data_type', 'name: "random_seed" data_type')
    config = model_config_pb2.ModelConfig()
    text_format.Parse(text, config)
    problems = check_trtllm_model(config)
    assert len(problems) == 2
    assert "'guided_decoding_backend' is missing" in problems[0] and "'random_seed' is not read" in problems[1]

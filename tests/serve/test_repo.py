"""Triton model repository generation: every config parses with Triton's schema, values come from the
recipe, the ensemble's wiring is checked (and a broken one is caught)."""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from llmc.errors import BuildError
from llmc.manifest import read_manifest
from llmc.serve.pbtxt import check_ensemble, fill_template, parse_config, read_config
from llmc.serve.protocol import ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS
from llmc.serve.repo import TRTLLM_MODELS, XGRAMMAR_INFO, generate_model_repo
from llmc.serve.trtllm_backend import check_trtllm_model

GUIDED = ("guided_decoding_guide_type", "guided_decoding_guide")


def _trt_recipe(build_dir, **serving):
    recipe = read_manifest(build_dir).recipe_obj()
    return dataclasses.replace(recipe, backend="tensorrt_llm",
                               serving=dataclasses.replace(recipe.serving, **serving))


def _parse_file(path):
    config = model_config_pb2.ModelConfig()
    text_format.Parse(path.read_text(), config)  # Triton's own schema, independent of llmc's helper
    return config


def _params(config):
    return {k: v.string_value for k, v in config.parameters.items()}


def _tensors(tensors):
    """(name, Triton type, dims) of a parsed config's inputs or outputs."""
    return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in tensors]


def _specs(specs):
    names = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32", "UINT64": "TYPE_UINT64",
             "FP32": "TYPE_FP32"}
    return [(s.name, names[s.datatype], list(s.dims)) for s in specs]


def test_torch_repo_is_one_decoupled_python_model(serve_tiny_build, tmp_path):
    repo = generate_model_repo(serve_tiny_build, tmp_path / "repo")
    assert sorted(p.name for p in repo.iterdir()) == ["tiny"]
    config = _parse_file(repo / "tiny" / "config.pbtxt")
    assert config.backend == "python" and config.model_transaction_policy.decoupled
    assert [i.name for i in config.input] == [s.name for s in ENSEMBLE_INPUTS]
    assert [o.name for o in config.output] == ["text_output", "cum_log_probs", "output_log_probs"]
    assert _tensors(config.output) == _specs(ENSEMBLE_OUTPUTS) and _tensors(config.input) == _specs(ENSEMBLE_INPUTS)
    assert _params(config)["build_dir"] == str(serve_tiny_build.absolute())
    assert (repo / "tiny" / "1" / "model.py").is_file()


def test_trtllm_repo_filled_from_recipe(serve_tiny_build, tmp_path):
    recipe = _trt_recipe(serve_tiny_build, max_queue_size=7, batch_scheduler_policy="guaranteed_no_evict",
                         enable_kv_cache_reuse=False, instance_count=3)
    repo = generate_model_repo(serve_tiny_build, tmp_path / "repo", recipe=recipe, eos_token_ids=(2, 0),
                               engine_path="/models/tiny/engine")
    assert sorted(p.name for p in repo.iterdir()) == sorted(TRTLLM_MODELS)
    configs = {name: _parse_file(repo / name / "config.pbtxt") for name in TRTLLM_MODELS}
    for name, config in configs.items():
        assert config.max_batch_size == recipe.engine.max_batch_size, name
        assert not re.search(r"\$\{", (repo / name / "config.pbtxt").read_text()), name
    trt = configs["tensorrt_llm"]
    p = _params(trt)
    assert p["gpt_model_path"] == "/models/tiny/engine"
    assert p["gpt_model_type"] == "inflight_fused_batching"
    assert p["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert p["enable_kv_cache_reuse"] == "false" and p["enable_chunked_context"] == "true"
    assert float(p["kv_cache_free_gpu_mem_fraction"]) == recipe.kv_cache.memory_fraction
    assert p["exclude_input_in_output"] == "true"
    assert trt.model_transaction_policy.decoupled
    assert trt.dynamic_batching.default_queue_policy.max_queue_size == 7
    pre = _params(configs["preprocessing"])
    assert pre["eos_token_ids"] == "2,0" and pre["add_special_tokens"] == "true"
    assert pre["tokenizer_dir"] == str(serve_tiny_build.absolute() / "tokenizer")
    assert configs["preprocessing"].instance_group[0].count == 3
    assert configs["tensorrt_llm_bls"].model_transaction_policy.decoupled
    assert check_ensemble(repo) == []


def test_trtllm_repo_wires_return_log_probs_to_the_backend_and_back(serve_tiny_build, tmp_path):
    """tensorrtllm_backend's contract: the ensemble's return_log_probs input goes to the tensorrt_llm model, whose
    cum_log_probs [-1] / output_log_probs [-1, -1] FP32 outputs are the ensemble's (and the BLS model's)."""
    repo = generate_model_repo(serve_tiny_build, tmp_path / "repo", recipe=_trt_recipe(serve_tiny_build),
                               eos_token_ids=(2,))
    configs = {name: _parse_file(repo / name / "config.pbtxt") for name in TRTLLM_MODELS}
    for name in ("ensemble", "tensorrt_llm_bls"):
        assert _tensors(configs[name].input) == _specs(ENSEMBLE_INPUTS), name
        assert _tensors(configs[name].output) == _specs(ENSEMBLE_OUTPUTS), name
    trt = configs["tensorrt_llm"]
    assert ("return_log_probs", "TYPE_BOOL", [1]) in _tensors(trt.input)
    outputs = {n: (t, d) for n, t, d in _tensors(trt.output)}
    assert outputs["cum_log_probs"] == ("TYPE_FP32", [-1]) and outputs["output_log_probs"] == ("TYPE_FP32", [-1, -1])
    assert _params(trt)["normalize_log_probs"] == "false"
    (step,) = [s for s in configs["ensemble"].ensemble_scheduling.step if s.model_name == "tensorrt_llm"]
    assert step.input_map["return_log_probs"] == "return_log_probs"
    assert step.output_map["cum_log_probs"] == "cum_log_probs"
    assert step.output_map["output_log_probs"] == "output_log_probs"
    assert check_ensemble(repo) == []


def test_trtllm_repo_wires_the_guided_decoding_inputs_into_the_backend(serve_tiny_build, tmp_path):
    """tensorrtllm_backend's contract (ensemble, tensorrt_llm and tensorrt_llm_bls config.pbtxt): both guided inputs
    are TYPE_STRING [1] optional (ragged in the ensemble and tensorrt_llm), mapped under the same names into the
    tensorrt_llm step only, and the tensorrt_llm model turns on xgrammar with the tokenizer info written beside it."""
    repo = generate_model_repo(serve_tiny_build, tmp_path / "repo", recipe=_trt_recipe(serve_tiny_build),
                               eos_token_ids=(2,))
    configs = {name: _parse_file(repo / name / "config.pbtxt") for name in TRTLLM_MODELS}
    for name in ("ensemble", "tensorrt_llm", "tensorrt_llm_bls"):
        inputs = {t.name: t for t in configs[name].input}
        for guided in GUIDED:
            tensor = inputs[guided]
            assert (model_config_pb2.DataType.Name(tensor.data_type), list(tensor.dims)) == ("TYPE_STRING", [1])
            assert tensor.optional and not tensor.HasField("reshape"), (name, guided)
            assert tensor.allow_ragged_batch == (name != "tensorrt_llm_bls"), (name, guided)
    steps = {s.model_name: s for s in configs["ensemble"].ensemble_scheduling.step}
    assert {g: steps["tensorrt_llm"].input_map[g] for g in GUIDED} == {g: g for g in GUIDED}
    assert not set(GUIDED) & set(steps["preprocessing"].input_map.values())
    assert not set(GUIDED) & set(steps["postprocessing"].input_map.values())
    trt = configs["tensorrt_llm"]
    assert check_trtllm_model(trt) == [] and check_ensemble(repo) == []
    params = _params(trt)
    assert params["guided_decoding_backend"] == "xgrammar"
    info_path = (tmp_path / "repo" / "tensorrt_llm" / XGRAMMAR_INFO).absolute()
    assert params["xgrammar_tokenizer_info_path"] == str(info_path) and info_path.is_file()
    assert params["tokenizer_dir"] == ""  # the C++ backend ignores it; the JSON above is its tokenizer
    assert sorted(p.name for p in (repo / "tensorrt_llm").iterdir() if p.is_dir()) == ["1"]  # no stray version


def test_the_tokenizer_info_path_is_where_tritonserver_sees_the_repo(serve_tiny_build, tmp_path):
    build = tmp_path / ".tiny.tmp-7"  # llmc build writes <build>/model_repo before renaming the build folder
    shutil.copytree(serve_tiny_build, build)
    recipe = _trt_recipe(build)
    repo = generate_model_repo(build, build / "model_repo", recipe=recipe, eos_token_ids=(2,), build_path="/models/t")
    path = _params(_parse_file(repo / "tensorrt_llm" / "config.pbtxt"))["xgrammar_tokenizer_info_path"]
    assert path == f"/models/t/model_repo/tensorrt_llm/{XGRAMMAR_INFO}"
    repo = generate_model_repo(build, tmp_path / "out", recipe=recipe, eos_token_ids=(2,), repo_path="/srv/repo")
    path = _params(_parse_file(repo / "tensorrt_llm" / "config.pbtxt"))["xgrammar_tokenizer_info_path"]
    assert path == f"/srv/repo/tensorrt_llm/{XGRAMMAR_INFO}"


def test_torch_repo_has_no_tokenizer_info(serve_tiny_build, tmp_path):
    repo = generate_model_repo(serve_tiny_build, tmp_path / "repo")
    assert not list(repo.rglob(XGRAMMAR_INFO))


def test_temp_build_folder_paths_point_at_the_final_folder(serve_tiny_build, tmp_path):
    tmp_build = tmp_path / ".tiny.tmp-123"
    shutil.copytree(serve_tiny_build, tmp_build)
    repo = generate_model_repo(tmp_build, tmp_path / "repo")
    assert _params(_parse_file(repo / "tiny" / "config.pbtxt"))["build_dir"] == str(tmp_path / "tiny")


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t.replace('key: "input_ids" value: "_INPUT_ID"', 'key: "input_ids" value: "_NOPE"'), "_NOPE"),
    (lambda t: t.replace('key: "request_output_len" value: "max_tokens"', 'key: "request_output_len" value: "temperature"'),
     "TYPE_FP32"),
    (lambda t: t.replace('input_map { key: "input_lengths" value: "_REQUEST_INPUT_LEN" }', ''), "input_lengths"),
    (lambda t: t.replace('output_map { key: "OUTPUT" value: "text_output" }', 'output_map { key: "OUT" value: "x" }'),
     "text_output"),
])
def test_broken_ensemble_wiring_is_detected(serve_tiny_build, tmp_path, edit, expected):
    repo = generate_model_repo(serve_tiny_build, tmp_path / "repo", recipe=_trt_recipe(serve_tiny_build),
                               eos_token_ids=(2,))
    path = repo / "ensemble" / "config.pbtxt"
    path.write_text(edit(path.read_text()))
    problems = check_ensemble(repo)
    assert problems and any(expected in p for p in problems), problems


def test_pbtxt_helpers_reject_bad_text():
    with pytest.raises(BuildError, match="placeholder"):
        fill_template("max_batch_size: ${missing}", {})
    with pytest.raises(BuildError, match="does not parse"):
        parse_config('name: "x" max_batch_size: "eight"')
    assert parse_config('name: "x" max_batch_size: 8').max_batch_size == 8


def test_repo_command_writes_and_validates(serve_tiny_build, tmp_path):
    from click.testing import CliRunner

    from llmc.serve.commands import repo_cmd

    result = CliRunner().invoke(repo_cmd, [str(serve_tiny_build), str(tmp_path / "out"), "--build-path", "/models/t"])
    assert result.exit_code == 0, result.output
    assert _params(read_config(tmp_path / "out" / "tiny"))["build_dir"] == "/models/t"


def test_llmc_repo_passes_where_tritonserver_sees_the_repository(serve_tiny_build, tmp_path, monkeypatch):
    """``--repo-path`` (a container's mount point) reaches generate_model_repo, which names the xgrammar tokenizer
    info file by it."""
    from click.testing import CliRunner

    import llmc.serve.repo as repo_module
    from llmc.cli import cli

    seen = {}
    real = repo_module.generate_model_repo

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(repo_module, "generate_model_repo", spy)
    result = CliRunner().invoke(cli, ["repo", str(serve_tiny_build), str(tmp_path / "out"), "--repo-path",
                                      "/models/repo", "--build-path", "/models/build"])
    assert result.exit_code == 0, result.output
    assert seen["repo_path"] == "/models/repo" and seen["build_path"] == "/models/build"

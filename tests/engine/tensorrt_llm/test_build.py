"""build_engines: refuses bad input before any TensorRT-LLM call, then calls the documented Python API once
per rank (reference tensorrt-llm.md line 69) and writes build_config.json, trtllm-build.sh and the manifest,
leaving nothing in the working directory.

TensorRT-LLM is not installable here: the API is a recording test double passed in as ``importer``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from llmc.engine.tensorrt_llm.build import build_engines
from llmc.engine.tensorrt_llm.config import build_config_dict
from llmc.errors import BackendUnavailableError, CheckpointError, RecipeError
from tests.engine.tensorrt_llm.doubles import MissingModuleImporter, RecordingBuildApi
from tests.engine.tensorrt_llm.helpers import TINY_TRT_YAML, write_recipe, write_tiny_ir

# tp 2 needs features that are multiples of max(64, g) * 2 = 128 for int4; the tiny model's hidden is 64.
TP2_16BIT = {"tp_size: 1": "tp_size: 2", "{method: awq, group_size: 64}": "{method: none}"}


def recipe(tmp_path, **replace):
    return write_recipe(tmp_path, TINY_TRT_YAML, **replace)


def test_missing_config_is_refused_before_any_import(tmp_path):
    importer = MissingModuleImporter()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        build_engines(recipe(tmp_path), tmp_path / "nothing", tmp_path / "engine", importer=importer)
    assert importer.calls == [] and not (tmp_path / "engine").exists()


def test_missing_rank_file_is_refused_before_any_import(tmp_path):
    write_tiny_ir(tmp_path / "ckpt", tp_size=2, group_size=None)
    os.remove(tmp_path / "ckpt" / "rank1.safetensors")
    importer = MissingModuleImporter()
    with pytest.raises(CheckpointError, match="rank1.safetensors is missing"):
        build_engines(recipe(tmp_path, **TP2_16BIT), tmp_path / "ckpt", tmp_path / "engine", importer=importer)
    assert importer.calls == []


def test_missing_tensor_is_refused_before_any_import(tmp_path):
    write_tiny_ir(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "rank0.safetensors"
    tensors = load_file(str(path))
    del tensors["transformer.layers.1.mlp.proj.weights_scaling_factor"]
    save_file(tensors, str(path))
    importer = MissingModuleImporter()
    with pytest.raises(CheckpointError, match="1 tensors missing: transformer.layers.1.mlp.proj.weights_scaling"):
        build_engines(recipe(tmp_path), tmp_path / "ckpt", tmp_path / "engine", importer=importer)
    assert importer.calls == []


def test_recipe_and_ir_disagree(tmp_path):
    write_tiny_ir(tmp_path / "ckpt", dtype="bfloat16")
    with pytest.raises(CheckpointError, match="exported with tp_size 1 and dtype bfloat16"):
        build_engines(recipe(tmp_path), tmp_path / "ckpt", tmp_path / "engine", importer=MissingModuleImporter())


def test_bad_recipe_is_refused_before_any_import(tmp_path):
    write_tiny_ir(tmp_path / "ckpt")
    importer = MissingModuleImporter()
    with pytest.raises(RecipeError, match="quantization.group_size"):
        build_engines(recipe(tmp_path, **{"group_size: 64": "group_size: 32"}), tmp_path / "ckpt",
                      tmp_path / "engine", importer=importer)
    assert importer.calls == []


def test_fp8_kv_cache_without_scales_is_refused(tmp_path):
    write_tiny_ir(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="kv_cache.dtype fp8 needs a per-layer fp32"):
        build_engines(recipe(tmp_path, **{"dtype: auto": "dtype: fp8"}), tmp_path / "ckpt", tmp_path / "engine",
                      importer=MissingModuleImporter())


def test_missing_tensorrt_llm_after_checks(tmp_path):
    write_tiny_ir(tmp_path / "ckpt")
    importer = MissingModuleImporter()
    with pytest.raises(BackendUnavailableError, match="cannot import tensorrt_llm"):
        build_engines(recipe(tmp_path), tmp_path / "ckpt", tmp_path / "engine", importer=importer)
    assert importer.calls == ["tensorrt_llm"] and not (tmp_path / "engine").exists()


def test_unsupported_version_builds_nothing(tmp_path):
    write_tiny_ir(tmp_path / "ckpt")
    api = RecordingBuildApi(version="1.3.0")
    with pytest.raises(BackendUnavailableError, match="found TensorRT-LLM 1.3.0"):
        build_engines(recipe(tmp_path), tmp_path / "ckpt", tmp_path / "engine", importer=api.importer)
    assert [c for c in api.calls if c[0] != "import"] == []


def test_a_qwen2_ir_builds_through_tensorrt_llms_qwen_model(tmp_path):
    """A Qwen2 IR (architecture Qwen2ForCausalLM, qwen_type qwen2, q, k, v biases) is loaded by QWenForCausalLM,
    the class TensorRT-LLM's MODEL_MAP gives that architecture; its rank holds the biases the contract names."""
    config = write_tiny_ir(tmp_path / "ckpt", group_size=None, family="qwen2")
    assert (config["architecture"], config["qwen_type"], config["attn_bias"]) == ("Qwen2ForCausalLM", "qwen2", True)
    api = RecordingBuildApi()
    build_engines(recipe(tmp_path), tmp_path / "ckpt", tmp_path / "engine", importer=api.importer)
    loads = [args for name, args in api.calls if name.endswith("from_checkpoint")]
    assert [name for name, _ in api.calls if name.endswith("from_checkpoint")] == ["QWenForCausalLM.from_checkpoint"]
    assert loads == [{"ckpt_dir": str(tmp_path / "ckpt"), "rank": 0}]


def test_one_engine_per_rank_through_the_documented_api(tmp_path):
    config = write_tiny_ir(tmp_path / "ckpt", tp_size=2, group_size=None)
    r = recipe(tmp_path, **TP2_16BIT)
    api = RecordingBuildApi()
    engine_dir = tmp_path / "engine"
    report = build_engines(r, tmp_path / "ckpt", engine_dir, importer=api.importer)
    expected_config = build_config_dict(r, config)
    calls = [(name, args) for name, args in api.calls if name != "import"]
    assert [name for name, _ in calls] == [
        "LLaMAForCausalLM.from_checkpoint", "BuildConfig.from_dict", "builder.build", "engine.save"] * 2
    for rank in (0, 1):
        load, from_dict, build, save = calls[4 * rank: 4 * rank + 4]
        assert load[1] == {"ckpt_dir": str(tmp_path / "ckpt"), "rank": rank}
        timing_cache = from_dict[1]["config"]["output_timing_cache"]  # the only key beyond build_config.json's
        assert {k: v for k, v in from_dict[1]["config"].items() if k != "output_timing_cache"} == expected_config
        assert build[1]["model"].rank == rank and build[1]["build_config"].config == from_dict[1]["config"]
        assert save[1] == {"engine_dir": str(engine_dir), "rank": rank}
    assert json.loads((engine_dir / "build_config.json").read_text()) == expected_config
    script = engine_dir / "trtllm-build.sh"
    assert os.access(script, os.X_OK) and "--checkpoint_dir ../ckpt" in script.read_text()
    manifest = json.loads((engine_dir / "engine_manifest.json").read_text())
    assert manifest["tensorrt_version"] == "10.13.2" and manifest["tensorrt_llm_version"] == "1.2.0"
    assert manifest["world_size"] == 2 and manifest["backend"] == "tensorrt_llm"
    assert manifest["gpu_name"] is None and manifest["compute_capability"] is None  # no CUDA here
    assert report["tensorrt_llm_version"] == "1.2.0" and report["engine_dir"] == str(engine_dir)
    assert Path(timing_cache).parent.parent == tmp_path and not Path(timing_cache).parent.exists()


def test_timing_cache_is_not_left_in_the_working_directory(tmp_path, monkeypatch):
    """Issue 16 item 7: BuildConfig's output_timing_cache defaults to model.cache in the working directory."""
    write_tiny_ir(tmp_path / "ckpt")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    build_engines(recipe(tmp_path), tmp_path / "ckpt", tmp_path / "build" / "engine", importer=RecordingBuildApi().importer)
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "build").iterdir()) == ["engine"]
    assert "output_timing_cache" not in json.loads((tmp_path / "build" / "engine" / "build_config.json").read_text())


def test_fp8_kv_cache_with_scales_reaches_the_quantization_block(tmp_path):
    write_tiny_ir(tmp_path / "ckpt", kv_fp8=True)
    build_engines(recipe(tmp_path, **{"dtype: auto": "dtype: fp8"}), tmp_path / "ckpt", tmp_path / "engine",
                  importer=RecordingBuildApi().importer)
    quant = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization"]
    assert quant["kv_cache_quant_algo"] == "FP8" and quant["quant_algo"] == "W4A16_AWQ"

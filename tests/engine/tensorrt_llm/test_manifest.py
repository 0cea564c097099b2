"""engine_manifest.json and the version check at load (reference tensorrt-llm.md lines 15-17)."""

from __future__ import annotations

import pytest

from llmc.engine.tensorrt_llm.manifest import EngineManifest, check_engine_versions, read_engine_manifest
from llmc.errors import EngineError


def write_manifest(engine_dir, trt="10.13.2", trtllm="1.2.0"):
    EngineManifest(format_version=1, backend="tensorrt_llm", tensorrt_version=trt, tensorrt_llm_version=trtllm,
                   gpu_name="NVIDIA H100 80GB HBM3", compute_capability="9.0", world_size=1, build_time_s=12.5,
                   build_config={"max_batch_size": 8}).write(engine_dir)


def test_same_versions_load(tmp_path):
    write_manifest(tmp_path)
    manifest = check_engine_versions(tmp_path, {"tensorrt": "10.13.2", "tensorrt_llm": "1.2.0"})
    assert manifest.gpu_name == "NVIDIA H100 80GB HBM3" and manifest.compute_capability == "9.0"
    assert read_engine_manifest(tmp_path) == manifest


def test_other_tensorrt_version_asks_for_a_rebuild(tmp_path):
    write_manifest(tmp_path)
    with pytest.raises(EngineError) as exc:
        check_engine_versions(tmp_path, {"tensorrt": "10.11.0", "tensorrt_llm": "1.2.0"})
    assert str(exc.value).startswith(
        "engine built with TensorRT 10.13.2 / TensorRT-LLM 1.2.0, this machine has TensorRT 10.11.0 / "
        "TensorRT-LLM 1.2.0;")
    assert "rebuild with llmc build --force" in str(exc.value)


def test_machine_without_tensorrt(tmp_path):
    write_manifest(tmp_path)
    with pytest.raises(EngineError, match="this machine has TensorRT none / TensorRT-LLM none"):
        check_engine_versions(tmp_path, {"tensorrt": None, "tensorrt_llm": None})


def test_missing_manifest(tmp_path):
    with pytest.raises(EngineError, match="engine_manifest.json is missing.*rebuild with llmc build --force"):
        check_engine_versions(tmp_path, {"tensorrt": "10.13.2", "tensorrt_llm": "1.2.0"})


def test_malformed_manifest(tmp_path):
    (tmp_path / "engine_manifest.json").write_text("{\"backend\": 1}")
    with pytest.raises(EngineError, match="unreadable"):
        read_engine_manifest(tmp_path)

"""compile_engine for the torch backend: engine.json describes the engine; bad inputs fail clearly."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from llmc.engine.base import compile_engine
from llmc.engine.torch import cpu_ext
from llmc.engine.torch.compile import read_engine_config
from llmc.errors import CheckpointError, EngineError
from llmc.recipe import recipe_from_dict
from tests.engine.torch.helpers import forget_cpu_kernels


def recipe(tiny_hf_dir, **kv_cache):
    return recipe_from_dict(
        {"name": "tiny", "model": {"source": str(tiny_hf_dir), "dtype": "bfloat16"}, "kv_cache": kv_cache,
         "engine": {"max_batch_size": 4, "max_input_len": 128, "max_seq_len": 256}, "backend": "torch"},
        check_inputs=False,
    )


def test_engine_json_describes_the_engine(tiny_hf_dir, tiny_ir_dir, tmp_path):
    engine_dir = tiny_ir_dir.parent / "engine"
    report = compile_engine(recipe(tiny_hf_dir, tokens_per_block=16), tiny_ir_dir, engine_dir)
    engine = json.loads((engine_dir / "engine.json").read_text())
    assert engine["backend"] == "torch" and engine["format_version"] == 1
    assert engine["checkpoint"] == "../checkpoint" and (engine_dir / engine["checkpoint"]).resolve() == tiny_ir_dir
    assert engine["dtype"] == "float32"  # the IR's dtype
    assert engine["limits"]["max_batch_size"] == 4 and engine["limits"]["max_seq_len"] == 256
    assert engine["kv_cache"]["tokens_per_block"] == 16
    # 2 (k, v) x 2 layers x 2 kv heads x 16 head size x 4 bytes (auto = the float32 IR dtype)
    assert engine["kv_bytes_per_token"] == report["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert read_engine_config(engine_dir) == engine


def test_the_compile_step_itself_builds_the_cpu_kernels(tiny_hf_dir, tmp_path):
    """``llmc build`` loads llmc's CPU kernels (building them on a machine's first build, or finding torch's
    cached build) so that the first ``llmc generate`` does not: starting from a process that has not loaded them,
    the compile step is what loads them, for int4 and 16-bit engines alike, and its report says what it got."""
    from tests.engine.torch.helpers import rtn_quantize_hf, write_ir

    quantized, _ = rtn_quantize_hf(tiny_hf_dir, group_size=32)
    irs = {"int4": write_ir(tiny_hf_dir, tmp_path / "checkpoint", quantized=quantized, group_size=32),
           "16-bit": write_ir(tiny_hf_dir, tmp_path / "plain_checkpoint")}
    try:
        for name, ir in irs.items():
            forget_cpu_kernels()  # as in a fresh process: the kernels are not loaded
            report = compile_engine(recipe(tiny_hf_dir), ir, tmp_path / f"engine-{name}")
            assert cpu_ext._loaded, name  # loaded by compile_engine, not by this test
            built = cpu_ext.load() is not None
            assert report["cpu_kernels"] == ("llmc AVX-512 kernels" if built else
                                             f"PyTorch's ops ({cpu_ext._why_not})")
            assert built or torch.backends.cpu.get_cpu_capability() != "AVX512"
    finally:
        forget_cpu_kernels()


def test_a_failed_kernel_build_is_reported_by_the_compile_step(tiny_hf_dir, tiny_ir_dir, tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # so a build is attempted
    forget_cpu_kernels()
    try:
        report = compile_engine(recipe(tiny_hf_dir), tiny_ir_dir, tmp_path / "engine")
    finally:
        forget_cpu_kernels()  # later tests load the real kernels again
    assert report["cpu_kernels"] == "PyTorch's ops (building it failed (RuntimeError: no C++ compiler found))"


def test_the_build_report_says_the_cpu_prefill_path(tiny_hf_dir, tmp_path):
    from tests.engine.torch.helpers import write_ir

    report = compile_engine(recipe(tiny_hf_dir), write_ir(tiny_hf_dir, tmp_path / "fp32"), tmp_path / "engine")
    assert report["cpu_prefill"] == "float32 GEMMs (a float32 checkpoint)"
    ir16 = write_ir(tiny_hf_dir, tmp_path / "fp16", dtype="float16")  # this machine's path for 16-bit IRs
    report16 = compile_engine(recipe(tiny_hf_dir), ir16, tmp_path / "engine16")
    assert report16["cpu_prefill"] == cpu_ext.prefill_status()
    assert report16["cpu_prefill"].startswith("bfloat16" if cpu_ext.bf16_prefill_why_not() is None else "float32")


def test_missing_checkpoint_is_a_checkpoint_error(tiny_hf_dir, tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        compile_engine(recipe(tiny_hf_dir), tmp_path / "nope", tmp_path / "engine")


def test_foreign_engine_folder_is_an_engine_error(tmp_path):
    with pytest.raises(EngineError, match="engine.json"):
        read_engine_config(tmp_path)
    (tmp_path / "engine.json").write_text(json.dumps({"backend": "tensorrt_llm", "format_version": 1}))
    with pytest.raises(EngineError, match="tensorrt_llm"):
        read_engine_config(tmp_path)


def test_unknown_backend_is_an_engine_error(tiny_hf_dir, tiny_ir_dir, tmp_path):
    bad = dataclasses.replace(recipe(tiny_hf_dir), backend="onnx")
    with pytest.raises(EngineError, match="onnx"):
        compile_engine(bad, tiny_ir_dir, tmp_path / "engine")

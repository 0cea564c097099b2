"""``llmc tune``: what it refuses (with the fix) before any timing, where it writes, what it prints. The timing itself
runs on a GPU in tests/engine/torch/test_int4_tune.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llmc.bench import tune
from llmc.cli import cli
from llmc.engine.torch import int4_configs
from llmc.errors import LlmcError
from tests.engine.torch.helpers import w4a16_ir


def invoke(*args: str):
    return CliRunner().invoke(cli, ["tune", *args])


def test_a_build_without_int4_layers_is_refused_naming_the_fix(tmp_path):
    result = invoke(str(w4a16_ir(tmp_path / "bf16", quantized=False)))
    assert result.exit_code != 0 and "no W4A16 layer of whole 16 x 64 tiles to tune" in str(result.exception)


def test_without_a_gpu_for_the_kernels_it_says_why_and_where_to_run_it(tmp_path, monkeypatch):
    from llmc.engine.torch import cuda_ext

    monkeypatch.setattr(cuda_ext, "static_why_not", lambda *a: "no CUDA GPU is visible")
    monkeypatch.setattr(cuda_ext, "why_not", lambda: "no CUDA GPU is visible")
    monkeypatch.setattr(tune, "torch_cuda", lambda: False)
    result = invoke(str(w4a16_ir(tmp_path / "ir")))
    assert ("llmc tune times the int4 kernels on this machine's GPU, and none can run here: no CUDA GPU is visible. "
            "Fix: run it on the GPU the engine will serve on") in str(result.exception)
    result = invoke(str(tmp_path / "ir"), "--kernels", "cuda")
    assert ("times llmc's int4 CUDA kernels on this machine's GPU, and they cannot run here: no CUDA GPU is visible. "
            "Fix: run it on the GPU the engine will serve on (an NVIDIA GPU of sm_80 or newer, with the CUDA "
            "toolkit's nvcc), or tune the Triton kernels int4 engines run here instead: --kernels triton") in str(
        result.exception)
    assert not int4_configs.local_table_path().exists()


def test_where_the_cuda_library_cannot_run_it_tunes_the_triton_kernels_engines_run_instead(monkeypatch):
    from llmc.engine.torch import cuda_ext, triton_support

    nvcc = "nvcc was not found (CUDA_HOME, /usr/local/cuda, PATH)"
    monkeypatch.setattr(cuda_ext, "static_why_not", lambda *a: nvcc)
    monkeypatch.setattr(cuda_ext, "why_not", lambda: nvcc)
    monkeypatch.setattr(tune, "torch_cuda", lambda: True)
    monkeypatch.setattr(triton_support, "modules", lambda: ("triton", "tl"))
    said = []
    monkeypatch.setattr(tune.click, "echo", said.append)
    assert tune.choose_kernels("auto") == "triton" == tune.choose_kernels("triton")
    assert said == ["llmc's int4 CUDA kernels are not used here (nvcc was not found (CUDA_HOME, /usr/local/cuda, "
                    "PATH)): tuning the Triton kernels, which int4 engines run here"]
    monkeypatch.setattr(triton_support, "modules", lambda: None)
    with pytest.raises(LlmcError, match="none can run here: Triton is not installed. Fix: run it on the GPU the "
                                        "engine will serve on \\(an NVIDIA GPU with Triton installed"):
        tune.choose_kernels("auto")
    monkeypatch.setattr(cuda_ext, "static_why_not", lambda *a: None)  # the CUDA library builds and loads here
    monkeypatch.setattr(cuda_ext, "why_not", lambda: None)
    assert tune.choose_kernels("auto") == "cuda" == tune.choose_kernels("cuda")
    monkeypatch.setattr(triton_support, "modules", lambda: ("triton", "tl"))
    assert tune.choose_kernels("triton") == "triton"  # asked for: the fallback's configs on a machine that has both


def test_an_unreadable_table_to_merge_into_stops_it_before_any_timing(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "choose_kernels", lambda kernels: "cuda")
    monkeypatch.setattr("llmc.engine.torch.int4_tune.tune_build", lambda *a, **k: pytest.fail("timed anyway"))
    (tmp_path / "t.json").write_text("{")
    result = invoke(str(w4a16_ir(tmp_path / "ir")), "--out", str(tmp_path / "t.json"))
    assert f"--out {tmp_path / 't.json'}: not valid JSON" in str(result.exception)
    assert (tmp_path / "t.json").read_text() == "{"


def fake_timings(gpu: str) -> tuple[dict, dict]:
    """What ``tune_build`` returns for two shapes: the 1-row bucket 2x faster than before, the 8-row one unchanged;
    one shape's earlier 8-row config failed (left out of that row's sums)."""
    cell = {"best": [1, 1, 2, 8, 2], "us_32_layers": 500.0, "cublas_bf16_us_32_layers": 1500.0, "tried_us": {},
            "before": {"config": [1, 1, 4, 8, 2], "us_32_layers": 1000.0}}
    failed = {**cell, "before": {"config": [2, 1, 4, 8, 2], "us_32_layers": "failed: RuntimeError: ..."}}
    shapes = {"4608x3584g128": {"name": "qkv", "mma_1": cell, "mma_8": {**cell, "before": {
                  "config": [1, 1, 2, 8, 2], "us_32_layers": 500.0}}, "mma_dense_32": {}},
              "3584x3584g128": {"name": "o", "mma_1": cell, "mma_8": failed}}
    table = {"version": 2, "gpus": {gpu: {"capability": "9.0", "multiprocessors": 132}},
             "devices": {gpu: {"4608x3584g128": {"mma": {"buckets": [[1, 1, 2, 8, 2]], "dense_from_m": 96}}}}}
    step_order = {1: {"before_ms": 1.6, "per_shape_ms": 1.7, "chosen_ms": 1.5, "chosen": {}}}
    return table, {"device": gpu, "shapes": shapes, "step_order": step_order}


def test_it_writes_this_machines_table_and_says_what_the_tuning_gained(tmp_path, monkeypatch):
    local = tmp_path / "cache" / "cuda" / "int4_cuda_configs.json"
    monkeypatch.setattr(int4_configs, "local_table_path", lambda: local)
    monkeypatch.setattr(tune, "choose_kernels", lambda kernels: "cuda")
    seen = []
    monkeypatch.setattr("llmc.engine.torch.int4_tune.tune_build",
                        lambda shapes, log: seen.append(shapes) or fake_timings("GPU X"))
    result = invoke(str(w4a16_ir(tmp_path / "ir")), "--report", str(tmp_path / "r" / "report.json"))
    assert result.exit_code == 0, result.output
    assert [s[0] for s in seen[0]] == ["qkv", "o", "fc_gate", "down"]
    assert json.loads(local.read_text())["devices"]["GPU X"]["4608x3584g128"]["mma"]["dense_from_m"] == 96
    assert json.loads((tmp_path / "r" / "report.json").read_text())["device"] == "GPU X"
    assert "M=   1: before   2.000 ms  tuned   1.000 ms (2.00x faster)  bf16 cuBLAS   3.000 ms" in result.output
    assert "M=   8: before   0.500 ms  tuned   0.500 ms (1.00x faster)" in result.output  # the failed one left out
    assert "in step order, 32 layers (what the engine runs):\n  M=   1: before   1.600 ms  tuned   1.500 ms (1.07x" in (
        result.output)
    assert f"wrote GPU X's CUDA int4 kernel configs to {local}: llmc engines on this machine run them from now on" in (
        result.output)
    out = tmp_path / "elsewhere.json"
    result = invoke(str(tmp_path / "ir"), "--out", str(out))
    assert result.exit_code == 0 and f"serve with LLMC_INT4_CONFIGS={out} on a machine with this GPU" in result.output
    assert json.loads(out.read_text())["gpus"] == {"GPU X": {"capability": "9.0", "multiprocessors": 132}}


def test_the_triton_kernels_tuned_are_written_beside_the_cuda_librarys_and_summed_the_same_way(tmp_path, monkeypatch):
    """``--kernels triton``: the Triton tuner's entries (a shape's ``buckets`` and ``dense_from_m``) are merged into
    the table next to the CUDA library's ``mma`` entry of the same shape; its timings are summed per row count (its
    report keys are ``triton_<M>``); there is no step-order pass to print."""
    local = tmp_path / "cache" / "cuda" / "int4_cuda_configs.json"
    monkeypatch.setattr(int4_configs, "local_table_path", lambda: local)
    monkeypatch.setattr(tune, "choose_kernels", lambda kernels: kernels)
    table, timings = fake_timings("GPU X")
    monkeypatch.setattr("llmc.engine.torch.int4_tune.tune_build", lambda shapes, log: (table, timings))
    assert invoke(str(w4a16_ir(tmp_path / "ir")), "--kernels", "cuda").exit_code == 0  # the CUDA library's first
    monkeypatch.setattr("llmc.engine.torch.int4_tune.tune_build", lambda *a, **k: pytest.fail("the CUDA tuner ran"))
    cell = {"best": [16, 64, 1, 2, 3, 8], "us_32_layers": 800.0, "cublas_bf16_us_32_layers": 1600.0, "tried_us": {},
            "before": {"config": [16, 128, 1, 4, 3, 1], "us_32_layers": 1200.0}}
    triton = {"version": 2, "gpus": table["gpus"], "devices": {"GPU X": {"4608x3584g128": {
        "buckets": [[1, 16, 64, 1, 2, 3, 8]], "dense_from_m": 128}}}}
    monkeypatch.setattr("llmc.engine.torch.int4_tune_triton.tune_build_triton", lambda shapes, log: (triton, {
        "device": "GPU X", "kernels": "triton", "shapes": {"4608x3584g128": {"name": "qkv", "triton_1": cell}}}))
    result = invoke(str(tmp_path / "ir"), "--kernels", "triton")
    assert result.exit_code == 0, result.output
    assert "tuning the Triton int4 kernels for 4 layer shapes of" in result.output
    assert "M=   1: before   1.200 ms  tuned   0.800 ms (1.50x faster)  bf16 cuBLAS   1.600 ms" in result.output
    assert "step order" not in result.output and f"wrote GPU X's Triton int4 kernel configs to {local}" in result.output
    entry = json.loads(local.read_text())["devices"]["GPU X"]["4608x3584g128"]
    assert entry == {"mma": {"buckets": [[1, 1, 2, 8, 2]], "dense_from_m": 96}, "buckets": [[1, 16, 64, 1, 2, 3, 8]],
                     "dense_from_m": 128}

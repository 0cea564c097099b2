"""``llmc doctor`` on this CPU machine, and the backend verdicts for other machines (pure function)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from llmc.doctor import (CpuInfo, DoctorReport, GpuInfo, backend_statuses, collect_report, cuda_gpus, doctor_cmd,
                         format_report)
from llmc.engine.tensorrt_llm.versions import PIP_SPEC, probe_module
from llmc.engine.torch import cpu_ext
from tests.engine.tensorrt_llm.doubles import MissingModuleImporter, VersionOnlyImporter

H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", "9.0", 79.1)
B200 = GpuInfo(0, "NVIDIA B200", "10.0", 178.4)


def test_doctor_runs_here_and_reports_this_machine_as_json():
    """Whatever this machine has: the report's versions and verdicts are the ones its probes find."""
    result = CliRunner().invoke(doctor_cmd, ["--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report["versions"]) == {"torch", "transformers", "triton", "tritonclient", "llmcompressor",
                                       "tensorrt", "tensorrt_llm"}
    assert report["versions"]["torch"]
    assert report["versions"]["tensorrt_llm"] == probe_module("tensorrt_llm").version
    gpus = cuda_gpus()
    assert [g["name"] for g in report["gpus"]] == [g.name for g in gpus]
    expected = backend_statuses(gpus, report["versions"]["tensorrt_llm"], report["notes"].get("tensorrt_llm"),
                                report["versions"]["triton"])
    assert [(b["name"], b["usable"], b["detail"]) for b in report["backends"]] == \
        [(b.name, b.usable, b.detail) for b in expected]
    assert report["backends"][0]["name"] == "torch" and report["backends"][0]["usable"] is True


def test_doctor_text_output_names_every_backend_with_its_verdict():
    report = collect_report()
    result = CliRunner().invoke(doctor_cmd, [])
    assert result.exit_code == 0, result.output
    assert "backends:" in result.output
    for backend in report.backends:
        verdict = "usable" if backend.usable else "NOT usable"
        assert f"  {backend.name}: {verdict} - {backend.detail}" in result.output


def test_without_tensorrt_llm_the_backend_says_what_to_install():
    report = collect_report(importer=MissingModuleImporter())
    assert report.versions["tensorrt_llm"] is None and "No module named" in report.notes["tensorrt_llm"]
    trt = {b.name: b for b in report.backends}["tensorrt_llm"]
    assert not trt.usable and PIP_SPEC in trt.detail


def test_with_tensorrt_llm_1_2_the_verdict_depends_on_the_gpus_only():
    report = collect_report(importer=VersionOnlyImporter("1.2.0"))
    assert report.versions["tensorrt_llm"] == "1.2.0" and "tensorrt_llm" not in report.notes
    trt = {b.name: b for b in report.backends}["tensorrt_llm"]
    assert trt == backend_statuses(cuda_gpus(), "1.2.0", None, report.versions["triton"])[1]
    assert PIP_SPEC not in trt.detail


def test_tensorrt_llm_usable_on_hopper_with_1_2():
    torch_status, trt = backend_statuses((H100,), "1.2.0", None)
    assert torch_status.usable and "CUDA (NVIDIA H100 80GB HBM3)" in torch_status.detail
    assert trt.usable and trt.detail == "TensorRT-LLM 1.2.0 on NVIDIA H100 80GB HBM3 (SM90)"


def test_cuda_decode_and_int4_paths_named_by_triton_presence(monkeypatch):
    monkeypatch.delenv("LLMC_CUDA_PDL", raising=False)
    monkeypatch.delenv("LLMC_EMBEDDING", raising=False)
    monkeypatch.delenv("LLMC_ROPE_EPILOGUE", raising=False)
    monkeypatch.delenv("LLMC_NORM_EPILOGUE", raising=False)
    monkeypatch.delenv("LLMC_PREFILL_KERNEL", raising=False)
    monkeypatch.delenv("LLMC_PIECE_GRAPHS", raising=False)
    host = "; untied input embeddings in page-locked host memory (LLMC_EMBEDDING=device keeps them on the GPU)"
    with_triton, _ = backend_statuses((H100,), None, "missing", triton_version="3.6.0")
    assert "CUDA decode steps: Triton 3.6.0 paged attention and fused norm/RoPE kernels in CUDA graphs" \
        in with_triton.detail
    assert ("; prompt chunks over a cached context: one Triton paged-prefill kernel (LLMC_PREFILL_KERNEL=0 gathers); "
            "a mixed-step budget's steps: CUDA graphs in pieces (LLMC_PIECE_GRAPHS=0 eager)") in with_triton.detail
    # The shipped int4 configs were tuned on this H100 too.
    assert with_triton.detail.endswith("AWQ int4 (W4A16), weights kept packed: llmc's Triton W4A16 kernels (not "
                                       "checked) (tuned for NVIDIA H100 80GB HBM3; `llmc tune BUILD` tunes a build's "
                                       "own shapes on this GPU (the Triton kernels, which int4 engines run here))"
                                       + host)
    no_nvcc, _ = backend_statuses((H100,), None, "missing", "3.6.0", "nvcc was not found (CUDA_HOME, PATH)")
    assert "llmc's Triton W4A16 kernels (nvcc was not found (CUDA_HOME, PATH))" in no_nvcc.detail
    h200 = H100.__class__(**{**H100.__dict__, "name": "NVIDIA H200"})
    monkeypatch.setattr("llmc.engine.torch.cuda_ext.build_state", lambda sm: f"built for sm_{sm}")  # the next test
    tuned, _ = backend_statuses((h200,), None, "missing", triton_version="3.6.0", cuda_int4_why_not=None)
    assert tuned.detail.endswith("AWQ int4 (W4A16), weights kept packed: llmc's CUDA tensor-core kernels, with the "
                                 "warpgroup (wgmma) kernel where the tuned table picks it (built for sm_90; "
                                 "programmatic dependent launch (early up to 16 rows, late above; "
                                 "LLMC_CUDA_PDL=0 turns it off)); "
                                 "qkv layers rotate q, k and write the KV cache in their epilogue "
                                 "(LLMC_ROPE_EPILOGUE=0 turns it off); o and down add to the residual stream in "
                                 "their epilogue and the next int4 layer finishes the norm, up to 8 rows "
                                 "(LLMC_NORM_EPILOGUE=0 turns it off) (tuned for NVIDIA H200; `llmc tune BUILD` "
                                 "tunes a build's own shapes on this GPU)" + host)
    without, _ = backend_statuses((H100,), None, "missing")
    assert "eager reference attention, and AWQ int4 (W4A16) layers dequantized to 16-bit at load" in without.detail
    assert "Fix: pip install triton" in without.detail
    cpu_only, _ = backend_statuses((), None, "missing", triton_version="3.6.0")
    assert cpu_only.detail == "CPU; no CUDA GPU found"


def test_doctor_says_what_an_fp8_kv_cache_gets(monkeypatch):
    monkeypatch.delenv("LLMC_KV_FP8", raising=False)
    status, _ = backend_statuses((H100,), None, "missing", triton_version="3.6.0")
    assert "; kv_cache.dtype fp8: an fp8 KV cache (half the bytes a token); AWQ int4" in status.detail
    a100 = H100.__class__(**{**H100.__dict__, "name": "NVIDIA A100", "compute_capability": "8.0"})
    status, _ = backend_statuses((a100,), None, "missing", triton_version="3.6.0")
    assert "; kv_cache.dtype fp8 runs as a 16-bit cache (SM80: fp8 conversions need SM89+)" in status.detail
    monkeypatch.setenv("LLMC_KV_FP8", "0")
    status, _ = backend_statuses((H100,), None, "missing", triton_version="3.6.0")
    assert "; kv_cache.dtype fp8 runs as a 16-bit cache (LLMC_KV_FP8=0)" in status.detail


def test_doctor_says_how_cuda_steps_with_prompt_tokens_run(monkeypatch):
    from llmc.doctor import prompt_step_paths

    monkeypatch.setenv("LLMC_PREFILL_KERNEL", "0")
    monkeypatch.setenv("LLMC_PIECE_GRAPHS", "0")
    assert prompt_step_paths() == ("; prompt chunks over a cached context: gathered from the cache for SDPA "
                                   "(LLMC_PREFILL_KERNEL=0 gathers); a mixed-step budget's steps: eager "
                                   "(LLMC_PIECE_GRAPHS=0 eager)")


def test_doctor_says_where_cuda_engines_keep_the_input_embedding(monkeypatch):
    monkeypatch.setenv("LLMC_EMBEDDING", "device")
    status, _ = backend_statuses((H100,), None, "missing", triton_version="3.6.0")
    assert status.detail.endswith("; input embeddings on the GPU (LLMC_EMBEDDING=device)")
    monkeypatch.setenv("LLMC_EMBEDDING", "pcie")
    status, _ = backend_statuses((H100,), None, "missing", triton_version="3.6.0")
    assert "LLMC_EMBEDDING='pcie' is not a placement; Fix: set LLMC_EMBEDDING to host or device" in status.detail


def test_int4_awq_not_on_sm100():
    _, trt = backend_statuses((B200,), "1.2.0", None)
    assert trt.usable and "INT4 AWQ (W4A16_AWQ) engines are refused on SM100-SM119 (GPU 0 SM100)" in trt.detail


def test_wrong_version_or_no_gpu():
    _, trt = backend_statuses((H100,), "1.3.0", None)
    assert not trt.usable and "found TensorRT-LLM 1.3.0" in trt.detail
    _, trt = backend_statuses((), "1.2.0", None)
    assert not trt.usable and trt.detail == "it needs an NVIDIA GPU and none is visible"


def test_doctor_says_which_cpu_prefill_path_this_machine_gets(monkeypatch):
    report = json.loads(CliRunner().invoke(doctor_cmd, ["--json"]).output)
    cpu = report["cpu"]
    assert cpu["avx512_bf16"] == cpu_ext.has_avx512_bf16() and cpu["cores"] >= 1 and cpu["model"]
    bf16 = cpu["avx512_bf16"] and cpu_ext.static_why_not() is None
    assert cpu["prefill"].startswith("bfloat16 GEMMs" if bf16 else "float32 GEMMs (")
    monkeypatch.setenv(cpu_ext.PREFILL_ENV, "float32")  # turned off: float32, and why
    off = json.loads(CliRunner().invoke(doctor_cmd, ["--json"]).output)["cpu"]
    assert off["prefill"] == "float32 GEMMs (LLMC_CPU_PREFILL=float32)"


def test_doctor_text_names_the_cpu_path():
    cpu = CpuInfo("Some CPU", 8, "AVX2", False, "PyTorch's ops (this CPU's capability is AVX2, llmc's kernels need "
                  "AVX512)", "float32 GEMMs (this CPU has no AVX512-BF16)")
    text = format_report(DoctorReport((), cpu, None, None, {}, {}, ()))
    assert "CPU: Some CPU, 8 cores, AVX2\n" in text
    assert "  prefill (16-bit and AWQ checkpoints): float32 GEMMs (this CPU has no AVX512-BF16)" in text
    bf16 = CpuInfo("EPYC", 2, "AVX512", True, "llmc's AVX-512 kernels", "bfloat16 GEMMs ...")
    report = format_report(DoctorReport((), bf16, None, None, {}, {}, ()))
    assert "CPU: EPYC, 2 cores, AVX512 with AVX512-BF16" in report
    assert "float32 GEMMs (calibration" not in text  # no line without a finding


def test_doctor_says_where_llmc_build_sends_its_float32_gemms(gemm_library):
    from llmc.doctor import build_gemm

    gemm_library("mkl")
    forced = build_gemm()
    gemm_library("auto")
    measured = build_gemm()
    assert forced == "MKL (PyTorch's default) (LLMC_CPU_GEMM=mkl)"
    assert measured.startswith(("oneDNN (measured on 2048x576x1536, ", "MKL (PyTorch's default) (measured on"))
    assert "oneDNN" in measured.split(": ")[-1] and "GFLOP/s" in measured
    cpu = CpuInfo("EPYC", 2, "AVX512", True, "llmc's AVX-512 kernels", "bfloat16 GEMMs ...", measured)
    text = format_report(DoctorReport((), cpu, None, None, {}, {}, ()))
    assert f"  llmc build's float32 GEMMs (calibration, gate): {measured}" in text


def test_the_int4_path_says_how_its_kernels_launch(monkeypatch):
    from llmc.doctor import int4_cuda_path

    monkeypatch.delenv("LLMC_CUDA_PDL", raising=False)
    monkeypatch.delenv("LLMC_ROPE_EPILOGUE", raising=False)
    monkeypatch.delenv("LLMC_NORM_EPILOGUE", raising=False)
    assert "programmatic dependent launch (early up to 16 rows, late above;" in int4_cuda_path(None, 90)
    assert "; plain launches); " in int4_cuda_path(None, 80)  # Ampere has no griddepcontrol
    assert "warpgroup (wgmma)" in int4_cuda_path(None, 90) and "wgmma" not in int4_cuda_path(None, 80)
    monkeypatch.setenv("LLMC_CUDA_PDL", "early")
    assert "programmatic dependent launch (early;" in int4_cuda_path(None, 90)
    monkeypatch.setenv("LLMC_CUDA_PDL", "late")
    assert "programmatic dependent launch (late;" in int4_cuda_path(None, 90)
    monkeypatch.setenv("LLMC_CUDA_PDL", "lates")  # a typo is named with the fix, not taken for a mode
    assert ("; LLMC_CUDA_PDL='lates' is not a launch mode: set it to auto (the default), early, late or 0 "
            "(plain launches), or unset it); ") in int4_cuda_path(None, 90)
    monkeypatch.setenv("LLMC_CUDA_PDL", "0")
    assert "; plain launches (LLMC_CUDA_PDL=0)); " in int4_cuda_path(None, 90)
    assert "KV cache in their epilogue (LLMC_ROPE_EPILOGUE=0 turns it off); " in int4_cuda_path(None, 90)
    assert int4_cuda_path(None, 90).endswith("finishes the norm, up to 8 rows (LLMC_NORM_EPILOGUE=0 turns it off)")
    monkeypatch.setenv("LLMC_ROPE_EPILOGUE", "0")
    assert "; RoPE + KV write in a Triton kernel (LLMC_ROPE_EPILOGUE=0); " in int4_cuda_path(None, 90)
    monkeypatch.setenv("LLMC_NORM_EPILOGUE", "64")
    assert int4_cuda_path(None, 90).endswith("up to 64 rows (LLMC_NORM_EPILOGUE=0 turns it off)")
    monkeypatch.setenv("LLMC_NORM_EPILOGUE", "0")
    assert int4_cuda_path(None, 90).endswith("; residual add + RMSNorm in a Triton kernel (LLMC_NORM_EPILOGUE=0)")
    monkeypatch.setenv("LLMC_NORM_EPILOGUE", "all")  # a typo is named with the fix
    assert int4_cuda_path(None, 90).endswith("LLMC_NORM_EPILOGUE='all': give a row count (e.g. 64) or 0 to switch "
                                             "it off")
    assert "epilogue" not in int4_cuda_path("no nvcc")  # the Triton kernels


def test_doctor_says_how_the_steps_triton_kernels_launch(monkeypatch):
    monkeypatch.delenv("LLMC_CUDA_PDL", raising=False)
    monkeypatch.delenv("LLMC_TRITON_PDL", raising=False)
    status, _ = backend_statuses((H100,), None, "missing", triton_version="3.6.0")
    assert ("fused norm/RoPE kernels in CUDA graphs (launched programmatically; LLMC_TRITON_PDL=0 turns it off); "
            "prompt chunks") in status.detail
    monkeypatch.setenv("LLMC_TRITON_PDL", "0")
    status, _ = backend_statuses((H100,), None, "missing", triton_version="3.6.0")
    assert "kernels in CUDA graphs (plain launches: LLMC_TRITON_PDL=0); prompt chunks" in status.detail
    monkeypatch.setenv("LLMC_CUDA_PDL", "0")  # the int4 kernels launch plainly: nothing would trigger them
    status, _ = backend_statuses((H100,), None, "missing", triton_version="3.6.0")
    assert "kernels in CUDA graphs; prompt chunks" in status.detail
    monkeypatch.delenv("LLMC_CUDA_PDL")
    a100 = GpuInfo(0, "NVIDIA A100-SXM4-80GB", "8.0", 79.2)
    status, _ = backend_statuses((a100,), None, "missing", triton_version="3.6.0")
    assert "kernels in CUDA graphs; prompt chunks" in status.detail


def test_the_int4_path_says_whether_the_cuda_library_is_built_or_what_its_first_use_compiles(tmp_path, monkeypatch):
    """On a fresh machine the first int4 engine waits for nvcc: doctor says so (parts, jobs, where it goes), and
    names the library once it is built for this GPU's architecture."""
    from llmc.doctor import int4_cuda_path
    from llmc.engine.torch import cuda_ext

    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text('#!/bin/sh\necho "release 13.0"\n')
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(cuda_ext.JOBS_ENV, "3")
    path = cuda_ext.library_path(str(nvcc), "90a", tmp_path / "cache" / "cuda")
    assert (f"(not built yet: the first int4 engine compiles them with nvcc (8 parts, 3 at a time; about 2 minutes "
            f"on 2 cores) into {path.parent}; ") in int4_cuda_path(None, 90)
    monkeypatch.setenv(cuda_ext.JOBS_ENV, "many")  # a typo is named with the fix (the build would fall back)
    assert ("(8 parts, LLMC_CUDA_BUILD_JOBS='many' is not a number of processes: set it to a whole number >= 1; "
            in int4_cuda_path(None, 90))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"lib")
    assert f"(built: {path}; programmatic dependent launch" in int4_cuda_path(None, 90)
    assert "not built yet" in int4_cuda_path(None, 80)  # another architecture: another library
    assert cuda_ext.library_path(str(nvcc), "80", path.parent).name.startswith("libllmc_cuda_80_")


def test_doctor_names_whose_int4_configs_an_untuned_gpu_borrows():
    """A GPU the table has no entry for runs the configs of the tuned GPU of its compute capability closest in
    multiprocessors (both shipped Hopper GPUs have 132: the tie goes by name); another capability gets the
    heuristics."""
    from llmc.doctor import tuned_gpus

    pcie = GpuInfo(0, "NVIDIA H100 PCIe", "9.0", 79.6, 114)
    assert tuned_gpus((pcie,)) == ["NVIDIA H100 80GB HBM3, used on NVIDIA H100 PCIe: same compute capability 9.0"]
    assert tuned_gpus((H100, pcie)) == ["NVIDIA H100 80GB HBM3",
                                        "NVIDIA H100 80GB HBM3, used on NVIDIA H100 PCIe: same compute capability 9.0"]
    assert tuned_gpus((GpuInfo(0, "NVIDIA A100-SXM4-80GB", "8.0", 79.2, 108),)) == []
    untuned, _ = backend_statuses((B200,), None, "missing", triton_version="3.6.0")
    # the CUDA library cannot run there: llmc tune tunes the Triton kernels int4 engines run instead
    assert ("(tuned for no GPU here: heuristic configs; `llmc tune BUILD` tunes a build's own shapes on this GPU (the "
            "Triton kernels, which int4 engines run here))") in untuned.detail


def test_doctor_says_an_unreadable_users_config_table_instead_of_failing(tmp_path, monkeypatch):
    from llmc.doctor import tuned_gpus
    from llmc.engine.torch import int4_configs

    monkeypatch.setenv("LLMC_INT4_CONFIGS", str(tmp_path / "missing.json"))
    int4_configs._tuned_table.cache_clear()
    try:
        said = tuned_gpus((H100,))
    finally:
        int4_configs._tuned_table.cache_clear()
    assert said == [f"no GPU: LLMC_INT4_CONFIGS={tmp_path / 'missing.json'}: cannot be read (No such file or "
                    "directory). Fix: point it at a table written by `llmc tune BUILD --out FILE`, or unset "
                    "LLMC_INT4_CONFIGS"]
    mine = {"gpus": {"NVIDIA L40S": {"capability": "8.9", "multiprocessors": 142}},
            "devices": {"NVIDIA L40S": {"4096x4096g128": {"mma": {"buckets": [[1, 1, 2, 8, 2]]}}}}}
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    monkeypatch.setenv("LLMC_INT4_CONFIGS", str(tmp_path / "mine.json"))
    try:
        said = tuned_gpus((GpuInfo(0, "NVIDIA L40S", "8.9", 44.4, 142),))
    finally:
        int4_configs._tuned_table.cache_clear()
    assert said == ["NVIDIA L40S", f"the shipped table with LLMC_INT4_CONFIGS={tmp_path / 'mine.json'} over it"]


def test_doctor_names_the_table_llmc_tune_wrote_on_this_machine(tmp_path, monkeypatch):
    from llmc.doctor import tuned_gpus
    from llmc.engine.torch import int4_configs

    local = tmp_path / "int4_cuda_configs.json"
    monkeypatch.setattr(int4_configs, "local_table_path", lambda: local)
    mine = {"gpus": {"NVIDIA L40S": {"capability": "8.9", "multiprocessors": 142}},
            "devices": {"NVIDIA L40S": {"4096x4096g128": {"mma": {"buckets": [[1, 1, 2, 8, 2]]}}}}}
    local.write_text(json.dumps(mine))
    (tmp_path / "env.json").write_text(json.dumps({"devices": {}}))
    monkeypatch.setenv("LLMC_INT4_CONFIGS", str(tmp_path / "env.json"))
    int4_configs._tuned_table.cache_clear()
    try:
        said = tuned_gpus((GpuInfo(0, "NVIDIA L40S", "8.9", 44.4, 142),))
    finally:
        int4_configs._tuned_table.cache_clear()
    assert said == ["NVIDIA L40S", f"the shipped table with llmc tune's table {local} and "
                                   f"LLMC_INT4_CONFIGS={tmp_path / 'env.json'} over it"]

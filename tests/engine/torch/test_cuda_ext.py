"""llmc's CUDA library loader on a CPU machine: why it is unavailable, the nvcc build's cache, lock and errors
(with a stand-in nvcc), and the real source compiled for sm_90 where nvcc is installed. The kernels themselves
run on a GPU in tests/engine/torch/test_int4_cuda_gpu.py."""

from __future__ import annotations

import ctypes
import os
import stat
from pathlib import Path

import pytest

from llmc.engine.torch import cuda_ext


def fake_nvcc(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "bin" / "nvcc"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_without_a_gpu_or_with_the_override_the_reason_is_named(monkeypatch):
    assert cuda_ext.static_why_not() == "no CUDA GPU is visible"
    monkeypatch.setenv(cuda_ext.ENV, "triton")
    assert cuda_ext.static_why_not() == f"{cuda_ext.ENV}=triton"


def test_build_runs_nvcc_once_per_source_and_arch_and_publishes_complete_files(tmp_path):
    calls = tmp_path / "calls"
    # A stand-in nvcc: --version prints a version; a build appends to `calls` and writes the -o file.
    nvcc = fake_nvcc(tmp_path, f"""if [ "$1" = --version ]; then echo "release 13.0"; exit 0; fi
echo x >> {calls}
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then echo lib > "$2"; fi; shift; done
""")
    out = tmp_path / "cache"
    first = cuda_ext.build(str(nvcc), "90a", out)
    assert first.exists() and first.parent == out and "90a" in first.name
    assert cuda_ext.build(str(nvcc), "90a", out) == first  # cached: nvcc ran once
    other = cuda_ext.build(str(nvcc), "80", out)
    assert other != first and calls.read_text().count("x") == 2
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".so") == sorted([first.name, other.name])


def test_a_failed_build_names_nvcc_and_leaves_nothing_behind(tmp_path):
    nvcc = fake_nvcc(tmp_path, """if [ "$1" = --version ]; then echo "release 13.0"; exit 0; fi
echo "w4a16_mma.cu(12): error: identifier undefined" >&2; exit 2
""")
    out = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="nvcc failed: .*identifier undefined"):
        cuda_ext.build(str(nvcc), "90a", out)
    assert not [p for p in out.rglob("*") if p.suffix == ".so"]


def test_the_real_source_compiles_for_hopper_where_nvcc_is_installed(tmp_path, monkeypatch):
    nvcc = cuda_ext.nvcc_path()
    if nvcc is None:  # a machine without the CUDA toolkit: the GPU path would fall back and say why
        monkeypatch.setattr(cuda_ext.torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda_ext.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert cuda_ext.static_why_not() == "nvcc was not found (CUDA_HOME, /usr/local/cuda, PATH)"
        return
    lib_path = cuda_ext.build(nvcc, "90a", tmp_path)
    lib = ctypes.CDLL(str(lib_path))
    assert lib.llmc_w4a16_abi_version() == cuda_ext.ABI_VERSION
    assert os.path.getsize(lib_path) > 100_000  # the kernels of every config were compiled in


def test_programmatic_dependent_launch_is_on_for_hopper_unless_turned_off(monkeypatch):
    import torch

    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    cuda_ext.pdl.cache_clear()
    try:
        assert cuda_ext.pdl(0) == 3  # auto: early or late by the product's rows (launch_mode)
        monkeypatch.setenv(cuda_ext.PDL_ENV, "late")
        cuda_ext.pdl.cache_clear()
        assert cuda_ext.pdl(0) == 2  # the next kernel may start once each block's loads are done
        monkeypatch.setenv(cuda_ext.PDL_ENV, "early")
        cuda_ext.pdl.cache_clear()
        assert cuda_ext.pdl(0) == 1
        capability["value"] = (8, 0)  # Ampere has no griddepcontrol
        cuda_ext.pdl.cache_clear()
        assert cuda_ext.pdl(0) == 0
        capability["value"] = (9, 0)
        monkeypatch.setenv(cuda_ext.PDL_ENV, "0")
        cuda_ext.pdl.cache_clear()
        assert cuda_ext.pdl(0) == 0
        monkeypatch.setenv(cuda_ext.PDL_ENV, "erly")
        cuda_ext.pdl.cache_clear()
        with pytest.raises(ValueError, match="LLMC_CUDA_PDL='erly' is not a launch mode: set it to auto"):
            cuda_ext.pdl(0)
    finally:
        cuda_ext.pdl.cache_clear()


def test_the_default_launch_lets_the_next_kernel_start_early_only_for_decode_sized_products():
    """auto (3) hands the library early (1) up to PDL_EARLY_MAX_ROWS rows and late (2) above; the other modes pass
    through whatever the rows."""
    edge = cuda_ext.PDL_EARLY_MAX_ROWS
    assert [cuda_ext.launch_mode(3, rows) for rows in (1, 8, edge, edge + 1, 64, 2048)] == [1, 1, 1, 2, 2, 2]
    for mode in (0, 1, 2):
        assert {cuda_ext.launch_mode(mode, rows) for rows in (1, edge, edge + 1, 2048)} == {mode}
    assert cuda_ext.PDL_MODES[3] == f"early up to {edge} rows, late above"


def test_triton_kernels_before_an_int4_kernel_let_it_start_early_only_where_it_launches_so(monkeypatch):
    import torch

    from llmc.engine.torch import triton_support

    triton_support.modules()  # Triton imported as the suite has it (interpreted), before the switch below
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda = torch.device("cuda")
    try:
        for env, expected in (("auto", True), ("late", True), ("early", True), ("0", False)):
            monkeypatch.setenv(cuda_ext.PDL_ENV, env)
            cuda_ext.pdl.cache_clear()
            triton_support.early_launch.cache_clear()
            assert triton_support.early_launch(cuda) is expected, env
        assert triton_support.early_launch(torch.device("cpu")) is False
        monkeypatch.setenv(cuda_ext.PDL_ENV, "late")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no griddepcontrol
        triton_support.early_launch.cache_clear()
        assert triton_support.early_launch(cuda) is False
    finally:
        cuda_ext.pdl.cache_clear()
        triton_support.early_launch.cache_clear()


def test_step_triton_kernels_launch_programmatically_only_where_int4_kernels_do_and_not_when_switched_off(
        monkeypatch):
    import torch

    from llmc.engine.torch import triton_support

    triton_support.modules()  # Triton imported as the suite has it (interpreted), before the switch below
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda = torch.device("cuda")

    def launch(int4_pdl: str, triton_pdl: str | None, device=cuda) -> dict:
        monkeypatch.setenv(cuda_ext.PDL_ENV, int4_pdl)
        if triton_pdl is None:
            monkeypatch.delenv(triton_support.PDL_ENV, raising=False)
        else:
            monkeypatch.setenv(triton_support.PDL_ENV, triton_pdl)
        for cached in (cuda_ext.pdl, triton_support.early_launch, triton_support.pdl_launch):
            cached.cache_clear()
        assert triton_support.pdl_launch(device) == bool(triton_support.launch_options(device))
        return triton_support.launch_options(device)

    try:
        assert launch("late", None) == {"launch_pdl": True}  # the default on sm_90+
        assert launch("early", "1") == {"launch_pdl": True}
        assert launch("late", "0") == {}  # switched off alone
        assert launch("0", None) == {}  # int4 kernels launch plainly: nothing would trigger the Triton kernels
        assert launch("late", None, torch.device("cpu")) == {}
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert launch("late", None) == {}  # no griddepcontrol before sm_90
    finally:
        for cached in (cuda_ext.pdl, triton_support.early_launch, triton_support.pdl_launch):
            cached.cache_clear()

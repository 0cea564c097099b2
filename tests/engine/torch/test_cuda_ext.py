"""llmc's CUDA library loader on a CPU machine: why it is unavailable, the nvcc build's parts, parallelism, cache,
lock and errors (with a stand-in nvcc), and the real source compiled for sm_90 where nvcc is installed (its dispatch
probed with no GPU visible). The kernels themselves
run on a GPU in tests/engine/torch/test_int4_cuda_gpu.py."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
import time
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


def test_build_runs_nvcc_once_per_source_and_arch_and_publishes_complete_files(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    # A stand-in nvcc: --version prints a version; a build appends its arguments to `calls` and writes the -o file.
    nvcc = fake_nvcc(tmp_path, f"""if [ "$1" = --version ]; then echo "release 13.0"; exit 0; fi
echo "$*" >> {calls}
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then echo lib > "$2"; fi; shift; done
""")
    monkeypatch.setenv(cuda_ext.JOBS_ENV, "3")
    out = tmp_path / "cache"
    first = cuda_ext.build(str(nvcc), "90a", out)
    assert first.exists() and first.parent == out and "90a" in first.name
    # The source's parts, each compiled once with its own LLMC_PART, then one link of all their objects.
    compiles, (link,) = calls.read_text().splitlines()[:-1], calls.read_text().splitlines()[-1:]
    assert sorted(line.split("-DLLMC_PART=")[1].split()[0] for line in compiles) == [
        str(i) for i in range(cuda_ext.PARTS)]
    assert all(f"-DLLMC_PARTS={cuda_ext.PARTS} " in line and " -c " in line for line in compiles)
    assert "-shared" in link and "--no-undefined" in link
    assert sorted(word.rsplit("/", 1)[1] for word in link.split() if word.endswith(".o")) == sorted(
        f"part{i}.o" for i in range(cuda_ext.PARTS))
    assert cuda_ext.build(str(nvcc), "90a", out) == first  # cached: nvcc ran no more
    other = cuda_ext.build(str(nvcc), "80", out)
    assert other != first and len(calls.read_text().splitlines()) == 2 * (cuda_ext.PARTS + 1)
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".so") == sorted([first.name, other.name])
    assert [p.name for p in out.iterdir() if p.is_dir()] == []  # the parts' objects went with their folder


def test_the_parts_compile_in_parallel_up_to_the_jobs_asked_for(tmp_path, monkeypatch):
    """Each stand-in compile records how many compiles were running when it started; with 3 jobs at most 3 run at
    once and more than one does (the parts' wall time is what the build's parallelism buys)."""
    log = tmp_path / "log"
    nvcc = fake_nvcc(tmp_path, f"""if [ "$1" = --version ]; then echo "release 13.0"; exit 0; fi
mkdir -p {tmp_path}/running; touch {tmp_path}/running/$$; ls {tmp_path}/running | wc -l >> {log}; sleep 0.3
rm {tmp_path}/running/$$
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then echo lib > "$2"; fi; shift; done
""")
    monkeypatch.setenv(cuda_ext.JOBS_ENV, "3")
    cuda_ext.build(str(nvcc), "90a", tmp_path / "cache")
    running = [int(line) for line in log.read_text().split()]
    assert len(running) == cuda_ext.PARTS + 1 and max(running) == 3 and running[-1] == 1  # the link runs alone


def test_build_jobs_default_to_the_usable_cpus_and_refuse_a_bad_value(monkeypatch):
    monkeypatch.delenv(cuda_ext.JOBS_ENV, raising=False)
    assert cuda_ext.build_jobs() == min(cuda_ext.PARTS, len(os.sched_getaffinity(0)))
    monkeypatch.setenv(cuda_ext.JOBS_ENV, "1")
    assert cuda_ext.build_jobs() == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(cuda_ext.JOBS_ENV, bad)
        with pytest.raises(ValueError, match=f"LLMC_CUDA_BUILD_JOBS='{bad}' is not a number of processes"):
            cuda_ext.build_jobs()


def test_a_failed_build_names_nvcc_and_leaves_nothing_behind(tmp_path):
    nvcc = fake_nvcc(tmp_path, """if [ "$1" = --version ]; then echo "release 13.0"; exit 0; fi
echo "w4a16_mma.cu(12): error: identifier undefined" >&2; exit 2
""")
    out = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="nvcc failed: .*identifier undefined"):
        cuda_ext.build(str(nvcc), "90a", out)
    assert not [p for p in out.rglob("*") if p.suffix in (".so", ".o")]


def test_a_part_that_fails_stops_the_others(tmp_path, monkeypatch):
    """Part 3 fails after a second while parts 0-2, started before it, would run for a minute: the build raises with
    part 3's error without waiting for them, and no process is left running."""
    nvcc = fake_nvcc(tmp_path, f"""if [ "$1" = --version ]; then echo "release 13.0"; exit 0; fi
case "$*" in *-DLLMC_PART=3*) sleep 1; echo "part 3: error: bad" >&2; exit 1;; esac
echo $$ >> {tmp_path}/pids; exec sleep 60
""")
    monkeypatch.setenv(cuda_ext.JOBS_ENV, "4")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="nvcc failed: part 3: error: bad"):
        cuda_ext.build(str(nvcc), "90a", tmp_path / "cache")
    assert time.monotonic() - started < 30
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 3  # parts 0-2 had started beside part 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_real_source_compiles_for_hopper_where_nvcc_is_installed(monkeypatch):
    nvcc = cuda_ext.nvcc_path()
    if nvcc is None:  # a machine without the CUDA toolkit: the GPU path would fall back and say why
        monkeypatch.setattr(cuda_ext.torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda_ext.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert cuda_ext.static_why_not() == "nvcc was not found (CUDA_HOME, /usr/local/cuda, PATH)"
        return
    # Into the machine's llmc cache, where the engine puts it: keyed by a hash of this source, the flags and nvcc's
    # version, so a later run of the same source on this machine loads what this build wrote (2 of CI's minutes).
    lib_path = cuda_ext.build(nvcc, "90a", cuda_ext.cache_dir())
    assert lib_path == cuda_ext.library_path(nvcc, "90a", cuda_ext.cache_dir())
    lib = ctypes.CDLL(str(lib_path))
    assert lib.llmc_w4a16_abi_version() == cuda_ext.ABI_VERSION
    assert os.path.getsize(lib_path) > 100_000  # the kernels of every config were compiled in
    # The dispatch reaches every ring-kernel unit of both dtypes across the parts: with no GPU visible, a valid
    # config's launch fails with a CUDA error (> 0), an unsupported one returns -1 before launching anything.
    probe = subprocess.run([sys.executable, "-c", DISPATCH_PROBE, str(lib_path)], capture_output=True, text=True,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert probe.returncode == 0, probe.stderr
    codes = json.loads(probe.stdout)
    for dtype in ("0", "1"):
        assert all(code > 0 for code in codes[dtype]["ring"]), codes  # row tiles 1, 2, 4
        assert all(code > 0 for code in codes[dtype]["register"]), codes  # row tiles 1, 2
        assert codes[dtype]["unsupported"] == [-1, -1, -1, -1], codes  # 3 or 8 row tiles, register at 4, a bad n


# Calls llmc_w4a16_mma of the library in argv[1] with null pointers (nothing is read: no GPU is visible) and prints
# the return codes per dtype.
DISPATCH_PROBE = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
i, p, ll = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
lib.llmc_w4a16_mma.argtypes = [i, i, i, i, i, p, i, p, p, p, p, i, i, i, i, i, i, i, p, ll, p, i, p, i,
                               ctypes.c_float, i, p]
def call(dtype, mtiles, stages, n=64):
    return lib.llmc_w4a16_mma(dtype, mtiles, 1, 4, stages, None, 128, None, None, None, None, n, 8 * mtiles, n, 128,
                              64, 0, 0, None, 0, None, 0, None, 0, 0.0, 0, None)
print(json.dumps({dtype: {"ring": [call(dtype, m, 2) for m in (1, 2, 4)],
                          "register": [call(dtype, m, 0) for m in (1, 2)],
                          "unsupported": [call(dtype, 3, 2), call(dtype, 8, 2), call(dtype, 4, 0),
                                          call(dtype, 1, 2, n=24)]} for dtype in (0, 1)}))
"""


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

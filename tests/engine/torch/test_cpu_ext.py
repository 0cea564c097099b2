"""Loading llmc's CPU kernels: one build per process, started in the background or on first use, whichever comes
first; a failed build falls back with one reason. torch's build is replaced by stubs here (the real kernels:
test_cpu_kernels.py)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.utils.cpp_extension

from llmc.engine.torch import cpu_ext
from tests.engine.torch.helpers import forget_cpu_kernels


class SlowBuild:
    """A stand-in for torch's ``cpp_extension.load``: counts its calls, blocks until released, then returns a
    module or raises."""

    def __init__(self, error: Exception | None = None):
        self.calls = 0
        self.started = threading.Event()
        self.release = threading.Event()
        self.error = error
        self.module = object()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.kwargs = kwargs
        self.started.set()
        assert self.release.wait(timeout=30), "the test never released the build"
        if self.error is not None:
            raise self.error
        return self.module


@pytest.fixture
def stub_build(monkeypatch, tmp_path):
    """Install a :class:`SlowBuild` (a builder function) as torch's build, on a CPU that can run the kernels; the
    kernels' state is forgotten before and after."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # where cpu_ext's build lock file goes
    monkeypatch.delenv(cpu_ext.ENV, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu_ext, "static_why_not", lambda: None)  # no compiler or ninja needed
    builds: list[SlowBuild] = []

    def install(error: Exception | None = None) -> SlowBuild:
        build = SlowBuild(error)
        monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
        builds.append(build)
        return build

    forget_cpu_kernels()
    yield install
    for build in builds:
        build.release.set()
    if cpu_ext._background is not None:
        cpu_ext._background.join(timeout=30)
    forget_cpu_kernels()


def test_each_checkout_environment_and_source_version_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """torch rewrites build.ninja with absolute paths (the sources', its headers') and runs ninja at every load: a
    folder shared by two checkouts or environments is rebuilt whenever they alternate. The folder is keyed by the
    sources' bytes and folder, torch and the flags."""
    import shutil

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    base = cpu_ext.build_directory()
    assert base.parent == tmp_path / "ext" and base.name.startswith(cpu_ext.NAME + "_")
    assert cpu_ext.build_directory() == base and cpu_ext.build_directory(tmp_path / "x").name == base.name
    folders = {}
    for checkout in ("a", "b"):
        shutil.copytree(cpu_ext.SOURCES[0].parent, tmp_path / checkout / "csrc")
        monkeypatch.setattr(cpu_ext, "SOURCES", sorted((tmp_path / checkout / "csrc").glob("*.cpp")))
        monkeypatch.setattr(cpu_ext, "HEADERS", sorted((tmp_path / checkout / "csrc").glob("*.h")))
        folders[checkout] = cpu_ext.build_directory()
    assert len({base, folders["a"], folders["b"]}) == 3  # the same bytes in another checkout: its own folder
    header = cpu_ext.HEADERS[0]
    header.write_bytes(header.read_bytes() + b"\n")  # a header edited: torch alone would not notice
    assert cpu_ext.build_directory() not in (base, folders["a"], folders["b"])
    header.write_bytes(header.read_bytes()[:-1])
    assert cpu_ext.build_directory() == folders["b"]
    monkeypatch.setattr(cpu_ext.torch, "__version__", "0.0.0")  # another environment's torch
    assert cpu_ext.build_directory() != folders["b"]


def test_the_build_runs_in_its_own_folder_and_holds_the_lock_there(stub_build):
    build = stub_build()
    build.release.set()
    assert cpu_ext.load() is build.module
    assert build.kwargs["build_directory"] == str(cpu_ext.build_directory())
    assert (cpu_ext.build_directory() / "llmc.flock").exists()


def test_the_background_build_starts_at_once_and_load_waits_for_it(stub_build):
    build = stub_build()
    cpu_ext.load_in_background()
    assert build.started.wait(timeout=10)  # compiling while the caller goes on
    assert not cpu_ext._loaded
    threading.Timer(0.3, build.release.set).start()
    started = time.perf_counter()
    assert cpu_ext.load() is build.module  # waited for the background build's answer...
    assert time.perf_counter() - started >= 0.25
    assert build.calls == 1  # ...instead of building again
    cpu_ext.load_in_background()  # answered already: no second thread, no second build
    assert cpu_ext.load() is build.module and build.calls == 1


def test_concurrent_loads_build_once(stub_build):
    build = stub_build()
    answers: list[object] = []
    threads = [threading.Thread(target=lambda: answers.append(cpu_ext.load())) for _ in range(4)]
    for thread in threads:
        thread.start()
    assert build.started.wait(timeout=10)
    build.release.set()
    for thread in threads:
        thread.join(timeout=30)
    assert answers == [build.module] * 4 and build.calls == 1


def test_a_failed_background_build_falls_back_with_one_reason(stub_build, caplog):
    build = stub_build(RuntimeError("g++: internal compiler error"))
    with caplog.at_level(logging.WARNING, logger=cpu_ext.__name__):
        cpu_ext.load_in_background()
        build.release.set()
        assert cpu_ext.load() is None and cpu_ext.load() is None
        assert cpu_ext.status() == "PyTorch's ops (building it failed (RuntimeError: g++: internal compiler error))"
    assert build.calls == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "g++: internal compiler error" in warnings[0].getMessage()


def test_nothing_is_built_where_the_kernels_cannot_run(stub_build, monkeypatch):
    build = stub_build()
    monkeypatch.setenv(cpu_ext.ENV, "torch")
    monkeypatch.setattr(cpu_ext, "static_why_not", lambda: f"{cpu_ext.ENV}=torch")
    cpu_ext.load_in_background()
    assert cpu_ext.load() is None and build.calls == 0
    assert cpu_ext.status() == f"PyTorch's ops ({cpu_ext.ENV}=torch)"


def test_the_background_build_imports_setuptools_in_the_calling_thread():
    """Importing setuptools mutates sys.meta_path (its distutils shim); from the build thread that races with imports
    in the main thread, so it must already be imported when the thread starts."""
    code = """
import sys, threading
from llmc.engine.torch import cpu_ext
assert "setuptools" not in sys.modules and "torch.utils.cpp_extension" not in sys.modules
release = threading.Event()
seen = {}
def build():
    seen["setuptools"] = "setuptools" in sys.modules  # at the thread's start, before anything it imports
    release.wait(timeout=10)  # a failed assertion below must not leave the process waiting on this thread
cpu_ext._build = build
cpu_ext.load_in_background()
assert "setuptools" in sys.modules and "torch.utils.cpp_extension" in sys.modules
release.set()
assert cpu_ext.load() is None and seen == {"setuptools": True}
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

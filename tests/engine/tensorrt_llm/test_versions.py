"""The guarded import and the version window [1.0, 1.3) (reference tensorrt-llm.md lines 10-14)."""

from __future__ import annotations

import sys

import pytest

from llmc.engine.tensorrt_llm.versions import check_version, probe_module, require_tensorrt_llm
from llmc.errors import BackendUnavailableError
from tests.engine.tensorrt_llm.doubles import MissingModuleImporter, VersionOnlyImporter


@pytest.mark.parametrize("found", ["1.0.0", "1.1.0", "1.2.0", "1.2.0rc3", "1.2.1.post1"])
def test_supported_versions_pass(found):
    check_version(found)


@pytest.mark.parametrize("found", ["0.9", "0.21.0", "1.3.0", "1.3.0rc1", "2.0.0"])
def test_unsupported_versions_name_the_version_and_the_way_out(found):
    with pytest.raises(BackendUnavailableError) as exc:
        check_version(found)
    msg = str(exc.value)
    assert f"found TensorRT-LLM {found}" in msg
    assert "tensorrt-llm>=1.0,<1.3" in msg
    assert "1.3 and later removed the TensorRT engine workflow" in msg
    assert "`backend: torch`" in msg
    assert "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3" in msg
    assert "--extra-index-url https://pypi.nvidia.com" in msg


def test_unparseable_version_is_refused():
    with pytest.raises(BackendUnavailableError, match="cannot read the TensorRT-LLM version 'unknown'"):
        check_version("unknown")


def test_missing_module_error_says_what_is_needed():
    importer = MissingModuleImporter()
    with pytest.raises(BackendUnavailableError) as exc:
        require_tensorrt_llm(importer)
    msg = str(exc.value)
    assert importer.calls == ["tensorrt_llm"]
    assert msg.startswith("cannot import tensorrt_llm (No module named 'tensorrt_llm')")
    assert "TensorRT-LLM 1.0 - 1.2" in msg and "`backend: torch`" in msg and "nvcr.io/nvidia/" in msg


@pytest.mark.parametrize("version", ["1.3.0", "0.9.0"])
def test_injected_module_with_wrong_version_is_refused(version):
    with pytest.raises(BackendUnavailableError, match=f"found TensorRT-LLM {version}"):
        require_tensorrt_llm(VersionOnlyImporter(version))


def test_injected_module_with_supported_version_is_returned():
    module = require_tensorrt_llm(VersionOnlyImporter("1.2.0"))
    assert module.__version__ == "1.2.0"


def test_nothing_is_registered_under_the_real_name():
    require_tensorrt_llm(VersionOnlyImporter("1.2.0"))
    assert "tensorrt_llm" not in sys.modules


def test_probe_reports_import_errors_instead_of_raising():
    probe = probe_module("tensorrt", MissingModuleImporter())
    assert probe.version is None and probe.error == "ModuleNotFoundError: No module named 'tensorrt'"
    assert probe_module("tensorrt", VersionOnlyImporter("10.13.2")).version == "10.13.2"

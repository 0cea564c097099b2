"""The patches llmc applies to llm-compressor: each checks the installed release first, and each is undone.

(Whole runs through llmcompressor_driver are in test_quantize.py and test_gptq.py.)
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch

from llmc.builder import llmcompressor_driver, llmcompressor_patches as patches
from llmc.errors import BuildError

PATCHES = {
    "set_execution_device": lambda stack: patches.set_execution_device(stack, torch.device("cpu")),
    "skip_pin_memory": lambda stack: patches.skip_pin_memory(stack),
    "quiet_compression_logger": lambda stack: patches.quiet_compression_logger(stack),
    "report_progress": lambda stack: patches.report_progress(stack, None, ("awq",)),
}


def patched_objects() -> list[tuple[object, str]]:
    """(owner, attribute) of every attribute the named patches replace."""
    import compressed_tensors.quantization.lifecycle.apply as apply_mod
    import llmcompressor.modifiers.gptq.base as gptq_base
    import llmcompressor.modifiers.transform.awq.base as awq_base
    import llmcompressor.pipelines.cache as cache_mod
    import llmcompressor.pipelines.data_free.pipeline as free_mod
    import llmcompressor.pipelines.sequential.pipeline as seq_mod

    return [(seq_mod, "get_main_device"), (free_mod, "get_main_device"), (cache_mod.IntermediatesCache, "pin_memory"), (gptq_base, "CompressionLogger"),
            *((m, "tqdm") for m in (seq_mod, awq_base, cache_mod, apply_mod))]


def fake_versions(monkeypatch: pytest.MonkeyPatch, **versions: str | None) -> None:
    real = patches.installed_version
    monkeypatch.setattr(patches, "installed_version", lambda package: versions.get(package, real(package)))


def test_the_installed_libraries_are_the_series_the_patches_were_written_for() -> None:
    patches.require_series(patches.LLMCOMPRESSOR_SERIES, "this test")
    patches.require_series(patches.COMPRESSED_TENSORS_SERIES, "this test")


@pytest.mark.parametrize("name", sorted(PATCHES))
def test_each_patch_refuses_another_llmcompressor_release_naming_both(monkeypatch, name) -> None:
    fake_versions(monkeypatch, llmcompressor="0.15.2")
    before = [getattr(owner, attr) for owner, attr in patched_objects()]
    with pytest.raises(BuildError, match=r"written for llmcompressor 0\.14\.x, and llmcompressor 0\.15\.2 is "
                                         r"installed\. Fix: pip install 'llmc\[quant\]'"):
        with contextlib.ExitStack() as stack:
            PATCHES[name](stack)
    assert [getattr(owner, attr) for owner, attr in patched_objects()] == before  # nothing left patched


def test_the_compressed_tensors_patch_checks_its_own_release(monkeypatch) -> None:
    fake_versions(monkeypatch, **{"compressed-tensors": "0.20.0"})
    with pytest.raises(BuildError, match=r"compressed-tensors 0\.19\.x, and compressed-tensors 0\.20\.0"):
        with contextlib.ExitStack() as stack:
            patches.report_progress(stack, None, ("awq",))


def test_a_missing_library_is_named(monkeypatch) -> None:
    fake_versions(monkeypatch, llmcompressor=None)
    with pytest.raises(BuildError, match="llmcompressor is not installed"):
        patches.require_series(patches.LLMCOMPRESSOR_SERIES, "AWQ subset search")


def test_patches_replace_their_attributes_and_restore_them() -> None:
    before = {(id(owner), attr): getattr(owner, attr) for owner, attr in patched_objects()}
    with contextlib.ExitStack() as stack:
        for patch in PATCHES.values():
            patch(stack)
        during = {(id(owner), attr): getattr(owner, attr) for owner, attr in patched_objects()}
        assert all(during[key] is not before[key] for key in before)
    assert {(id(owner), attr): getattr(owner, attr) for owner, attr in patched_objects()} == before


def test_an_attribute_gone_under_the_same_release_is_a_clear_error() -> None:
    owner = SimpleNamespace(__name__="llmcompressor.pipelines.cache")
    with contextlib.ExitStack() as stack, pytest.raises(BuildError, match=r"expects llmcompressor\.pipelines\.cache"
                                                                          r"\.pin_memory in llmcompressor 0\.14"):
        patches._replace(stack, owner, "pin_memory", None, patches.LLMCOMPRESSOR_SERIES, "CPU-only patch")


def test_quiet_library_logs_restores_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("LLM_COMPRESSOR_LOG_DISABLED", "false")
    with contextlib.ExitStack() as stack:
        patches.quiet_library_logs(stack)
    assert os.environ["LLM_COMPRESSOR_LOG_DISABLED"] == "false"


@pytest.mark.parametrize("factory", [llmcompressor_driver._awq_modifier_class,
                                     llmcompressor_driver._gptq_modifier_class])
def test_modifier_subclasses_check_the_release_too(monkeypatch, factory) -> None:
    fake_versions(monkeypatch, llmcompressor="0.13.1")
    factory.cache_clear()
    try:
        with pytest.raises(BuildError, match=r"0\.14\.x, and llmcompressor 0\.13\.1"):
            factory()
    finally:
        factory.cache_clear()

"""The narrow patches llmc applies around one llm-compressor run, each a named function undone on exit.

They reach into llm-compressor's and compressed-tensors' private modules, so each first checks that the
installed release is the series it was written for (:data:`LLMCOMPRESSOR_SERIES`,
:data:`COMPRESSED_TENSORS_SERIES`) and fails with a BuildError naming both versions otherwise; an attribute
gone under the same release is a BuildError too. :func:`library_context` applies them all.
"""

from __future__ import annotations

import contextlib
import os
import re
from importlib import metadata
from typing import Any, Callable, Iterator

import torch
from packaging.version import InvalidVersion, Version

from llmc.errors import BuildError

# The release series whose private modules the patches (and the driver's modifier subclasses) were read against.
# Raising one means reading those modules again (pyproject.toml pins llmcompressor to the same series, and
# llmcompressor pins compressed-tensors).
LLMCOMPRESSOR_SERIES = ("llmcompressor", (0, 14))
COMPRESSED_TENSORS_SERIES = ("compressed-tensors", (0, 19))
ProgressFn = Callable[[str, int, int], None]  # (what is running, e.g. "calibrating 3/31", done, total)
_STAGE = re.compile(r"\((\d+)/(\d+)\): (\w+)")


def installed_version(package: str) -> str | None:
    """The installed release of ``package`` (a distribution name), None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def require_series(series: tuple[str, tuple[int, int]], what: str) -> None:
    """BuildError unless the installed ``series[0]`` is of release series ``series[1]`` (major.minor), which
    ``what`` (a patch or subclass of its private code) was written for."""
    package, (major, minor) = series
    installed = installed_version(package)
    try:
        release = Version(installed).release[:2] if installed is not None else None
    except InvalidVersion:
        release = None
    if release != (major, minor):
        raise BuildError(
            f"llmc's {what} was written for {package} {major}.{minor}.x, and {package} {installed or 'is not'} "
            f"{'is ' if installed else ''}installed. Fix: pip install 'llmc[quant]' (which pins {package} to "
            f"{major}.{minor}.x), or update llmc"
        )


def _replace(stack: contextlib.ExitStack, owner: Any, name: str, value: Any, series: tuple[str, tuple[int, int]],
             what: str) -> None:
    """Set ``owner.name`` to ``value`` until ``stack`` closes, after checking the series ``what`` was written for.

    A missing attribute means the library changed under the same version: BuildError naming the version too."""
    require_series(series, what)
    if not hasattr(owner, name):
        package, (major, minor) = series
        raise BuildError(f"llmc's {what} expects {getattr(owner, '__name__', owner)}.{name} in {package} "
                         f"{installed_version(package)} (written for {major}.{minor}.x), and it is missing. Fix: "
                         f"pip install 'llmc[quant]' in a fresh environment, or update llmc")
    original = getattr(owner, name)
    setattr(owner, name, value)
    stack.callback(setattr, owner, name, original)


@contextlib.contextmanager
def library_context(progress: ProgressFn | None = None, passes: tuple[str, ...] = ("awq",),
                    device: torch.device | None = None, timer: Any = None) -> Iterator[None]:
    """Narrow, reversible patches around one llm-compressor run (library imports belong inside it), each undone
    when the context exits: :func:`quiet_library_logs`, :func:`set_execution_device` (``device``, default the
    CPU), :func:`skip_pin_memory` (only on the CPU), :func:`quiet_compression_logger`, :func:`report_progress`
    (``timer.start(pass)`` at each calibration pass, when given) and :func:`fused_calibration_attention`."""
    device = device if device is not None else torch.device("cpu")
    with contextlib.ExitStack() as stack:
        quiet_library_logs(stack)
        set_execution_device(stack, device)
        if device.type == "cpu":
            skip_pin_memory(stack)
        quiet_compression_logger(stack)
        report_progress(stack, progress, passes, timer)
        fused_calibration_attention(stack)
        yield


FUSED_ATTENTION_MODULES = ("llama", "qwen2", "qwen3")  # transformers' model modules whose eager attention is fused


def fused_calibration_attention(stack: contextlib.ExitStack) -> None:
    """Llama's (and Qwen2's, Qwen3's) attention computes through one fused ``scaled_dot_product_attention`` call
    while calibrating.

    llm-compressor forces transformers' eager attention during calibration (its traced graphs add the causal mask
    unconditionally), and the eager function materialises the scores, adds the mask and takes the softmax in
    separate passes: 106 s of the 2-core SmolLM2 build (the scale search and the layer-by-layer forwards). This
    replaces ``modeling_llama.eager_attention_forward`` with the same product through SDPA on the same additive
    mask (4 x 9 heads x 512 tokens: 59 -> 15 ms, outputs within 6e-7); the same function of ``modeling_qwen2`` and
    ``modeling_qwen3`` too (Qwen2's window, where a config uses one, is in the mask it is given). Other
    architectures keep the eager function. Skipped (nothing patched) where transformers has no such function: a
    pure speed-up."""
    import importlib

    for name in FUSED_ATTENTION_MODULES:
        try:
            module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        if not callable(getattr(module, "eager_attention_forward", None)):
            continue
        stack.callback(setattr, module, "eager_attention_forward", module.eager_attention_forward)
        module.eager_attention_forward = sdpa_attention_forward


def sdpa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                           **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``eager_attention_forward`` contract (query ``[b, h, q, d]``, key/value ``[b, kv, k, d]``, an
    additive mask broadcastable to ``[b, h, q, k]``) through one SDPA call; returns ``([b, q, h, d], None)``
    (no attention weights: calibration never asks for them)."""
    mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def set_execution_device(stack: contextlib.ExitStack, device: torch.device) -> None:
    """The sequential and data-free pipelines compute on ``device``.

    They pick it with ``get_main_device()``, which answers CUDA whenever torch sees any accelerator; with
    ``set_onload_device(model, device)`` every module then stays where it was loaded and is copied to ``device``
    when it runs (one decoder layer at a time in the sequential pipeline). So ``cpu`` stays on the CPU on a GPU
    machine, and ``cuda`` runs there."""
    import llmcompressor.pipelines.data_free.pipeline as free_mod
    import llmcompressor.pipelines.sequential.pipeline as seq_mod

    for module in (seq_mod, free_mod):
        _replace(stack, module, "get_main_device", lambda: device, LLMCOMPRESSOR_SERIES,
                 f"execution device of {module.__name__}")


def quiet_library_logs(stack: contextlib.ExitStack) -> None:
    """llm-compressor's and compressed-tensors' loguru messages off until ``stack`` closes.

    llm-compressor configures its logger and logs on first import, so that import runs with
    ``LLM_COMPRESSOR_LOG_DISABLED=true`` set just for the import (the documented switch)."""
    from loguru import logger

    previous = os.environ.get("LLM_COMPRESSOR_LOG_DISABLED")
    os.environ["LLM_COMPRESSOR_LOG_DISABLED"] = "true"
    try:
        import llmcompressor  # noqa: F401 - its first import configures its logger (here: off) and logs
    finally:
        if previous is None:
            del os.environ["LLM_COMPRESSOR_LOG_DISABLED"]
        else:
            os.environ["LLM_COMPRESSOR_LOG_DISABLED"] = previous
    for name in ("llmcompressor", "compressed_tensors"):
        logger.disable(name)
        stack.callback(logger.enable, name)


def skip_pin_memory(stack: contextlib.ExitStack) -> None:
    """``IntermediatesCache.pin_memory`` becomes a no-op (on the CPU): AWQ pins cached activations before its grid
    search, and ``Tensor.pin_memory()`` raises on a CPU-only torch build. Pinning only speeds up host-to-GPU
    copies, so skipping it changes nothing else."""
    import llmcompressor.pipelines.cache as cache_mod

    _replace(stack, cache_mod.IntermediatesCache, "pin_memory", _no_pin, LLMCOMPRESSOR_SERIES,
             "CPU-only patch of IntermediatesCache.pin_memory")


def quiet_compression_logger(stack: contextlib.ExitStack) -> None:
    """GPTQ's per-module ``CompressionLogger`` logs at a loguru level ("METRIC") that only the library's own
    logger setup registers; with that setup off it is replaced by a silent stand-in."""
    import llmcompressor.modifiers.gptq.base as gptq_base

    _replace(stack, gptq_base, "CompressionLogger", _QuietCompressionLogger, LLMCOMPRESSOR_SERIES,
             "silent GPTQ CompressionLogger")


def report_progress(stack: contextlib.ExitStack, progress: ProgressFn | None, passes: tuple[str, ...],
                    timer: Any = None) -> None:
    """The libraries' tqdm bars (sequential pipeline, AWQ, cache, applying the scheme) become a silent shim that
    reports ``(phase, done, total)`` per decoder layer to ``progress`` (the build's rich bar). The library walks
    the layers once per calibration pass (``passes``: AWQ, then GPTQ when it rounds); the bar counts all passes
    and the phase names the pass; ``timer.start(pass)`` marks where each pass begins."""
    import compressed_tensors.quantization.lifecycle.apply as apply_mod
    import llmcompressor.modifiers.transform.awq.base as awq_base
    import llmcompressor.pipelines.cache as cache_mod
    import llmcompressor.pipelines.sequential.pipeline as seq_mod

    shim = _tqdm_shim(progress, passes, timer)
    for module in (seq_mod, awq_base, cache_mod):
        _replace(stack, module, "tqdm", shim, LLMCOMPRESSOR_SERIES, f"progress shim of {module.__name__}.tqdm")
    _replace(stack, apply_mod, "tqdm", shim, COMPRESSED_TENSORS_SERIES, f"progress shim of {apply_mod.__name__}.tqdm")


def _no_pin(self: Any, batch_index: int, input_names: list[str] | None = None) -> None:
    """Stand-in for ``IntermediatesCache.pin_memory`` on machines without an accelerator."""


class _QuietCompressionLogger:
    """Stand-in for llm-compressor's ``CompressionLogger`` (a context manager that logs time and loss)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def set_results(self, name: str | None = None, loss: float | None = None) -> None:
        return None

    def __enter__(self) -> "_QuietCompressionLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _tqdm_shim(progress: ProgressFn | None, passes: tuple[str, ...] = ("awq",), timer: Any = None
               ) -> Callable[..., Any]:
    """A tqdm replacement that prints nothing and turns "(i/N): Calibrating" stages into progress calls.

    Stage 1 of a walk after the first starts the next of ``passes``; progress counts the stages of all passes;
    ``timer.start(pass)`` is called when a pass begins.
    """
    seen = {"pass": -1}

    class _Bar:
        def __init__(self, iterable: Any = None, desc: str | None = None, total: int | None = None, **_: Any):
            self.iterable = iterable if iterable is not None else ()
            match = _STAGE.match(desc or "")
            if match is None:
                return
            done, total_stages, phase = int(match.group(1)) - 1, int(match.group(2)), match.group(3)
            if done == 0 and phase == "Calibrating":
                seen["pass"] = min(seen["pass"] + 1, len(passes) - 1)
                if timer is not None:
                    timer.start(passes[seen["pass"]])
            if progress is None:
                return
            index = max(seen["pass"], 0)
            label = f"{phase.lower()} {done + 1}/{total_stages}"
            if len(passes) > 1:
                label = f"{passes[index]} pass {index + 1}/{len(passes)}: {label}"
            progress(label, index * total_stages + done, len(passes) * total_stages)

        def __iter__(self) -> Iterator[Any]:
            return iter(self.iterable)

        def __enter__(self) -> "_Bar":
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def set_postfix(self, *args: Any, **kwargs: Any) -> None:
            return None

        def update(self, n: int = 1) -> None:
            return None

        def close(self) -> None:
            return None

    return _Bar

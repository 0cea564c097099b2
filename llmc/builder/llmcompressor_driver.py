"""llmc's driver of llm-compressor 0.14: run AWQ, GPTQ and round-to-nearest int4, and read the results back.

Everything that knows llm-compressor's API lives here:
- :func:`int4_recipe` builds the modifiers: ``AWQModifier`` (the scale search) followed by the int4 quantizer
  (symmetric int4, groups of ``group_size`` along the input, scales rounded to the IR dtype so the stored
  checkpoint is exactly what the library evaluated; ``lm_head`` ignored, embeddings are not Linear and never
  quantized). The quantizer rounds either to nearest (``QuantizationModifier``) or with GPTQ
  (``GPTQModifier``, the library's second calibration pass over the AWQ-scaled model: each column's rounding
  error is compensated in the columns not yet rounded, weighted by the layer inputs' Hessian; columns taken in
  order of decreasing Hessian diagonal; same scales, same groups, same storage). Round-to-nearest is the
  ``QuantizationModifier`` alone: the same quantizer with identity AWQ scales, so the methods differ only by
  AWQ and by the rounding.
- GPTQ's Hessian can honour the same loss mask as AWQ (``gptq_use_loss_mask``): special-token rows of every
  layer input are then zeroed before they are accumulated (:func:`_gptq_modifier_class`). Off by default:
  AWQ's averaged per-channel statistics are what outliers wreck, while GPTQ minimises the layer's output
  error over its inputs, and chat markers are part of every real input (measured in docs/AWQ.md).
- :func:`run_oneshot` calls ``oneshot`` with our own DataLoader (``input_ids``, ``attention_mask`` and the
  ``loss_mask`` column) and ``use_loss_mask`` to exclude special tokens.
- :func:`extract_int4` reads each quantized Linear back as (q int8 [O, K], scales [O, K/g], prequant [K]).
  llm-compressor folds every AWQ scale into the previous op (RMSNorm weights, v_proj / up_proj rows), so
  prequant is all ones and the folded weights are in the model's state dict.
- :func:`library_context` applies the narrow patches this needs (on a CPU-only torch, and for quiet logs and
  llmc's own progress bar), one named function each. They reach into the libraries' private modules, so each
  first checks that the installed release is the series it was written for (:data:`LLMCOMPRESSOR_SERIES`,
  :data:`COMPRESSED_TENSORS_SERIES`) and fails with a BuildError naming both versions otherwise; so do the
  two modifier subclasses, which override private methods.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Iterator

import torch
from packaging.version import InvalidVersion, Version

from llmc.builder.calibrate import CalibrationSet
from llmc.errors import BuildError

# The release series whose private modules the patches and subclasses below were read against. Raising one means
# reading those modules again (pyproject.toml pins llmcompressor to the same series; it pins compressed-tensors).
LLMCOMPRESSOR_SERIES = ("llmcompressor", (0, 14))
COMPRESSED_TENSORS_SERIES = ("compressed-tensors", (0, 19))
GPTQ_ACTORDER = "static"  # GPTQ's column order (see int4_recipe); the IR format needs no g_idx with it
ProgressFn = Callable[[str, int, int], None]  # (what is running, e.g. "calibrating 3/31", done, total)

# Tensors the quantization lifecycle attaches to a module; not model weights.
QUANT_PARAM = re.compile(r"\.(weight|input|output)_(scale|zero_point|global_scale|g_idx)$")
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


@functools.cache
def _awq_modifier_class() -> type:
    """``AWQModifier`` with ``search_batches``: the grid search scores scales on the first N cached batches.

    The activation statistic still averages every calibration token (masked); only the error that ranks the
    grid's candidates is measured on a subset, which is what makes 128 x 512 calibration fit in minutes on CPU.
    It overrides the private ``_run_samples`` and reads ``_parent_args_cache``.
    """
    require_series(LLMCOMPRESSOR_SERIES, "AWQ subset search (AWQModifier._run_samples)")
    from llmcompressor.modifiers.transform.awq import AWQModifier

    class SubsetSearchAWQModifier(AWQModifier):
        search_batches: int | None = None

        @torch.no_grad()
        def _run_samples(self, module: torch.nn.Module) -> list[torch.Tensor]:
            cache = self._parent_args_cache[module]
            n = len(cache) if self.search_batches is None else min(self.search_batches, len(cache))
            outputs = [module(**cache.fetch(i)) for i in range(n)]
            return [out[0] if isinstance(out, tuple) else out for out in outputs]

    return SubsetSearchAWQModifier


@functools.cache
def _gptq_modifier_class() -> type:
    """``GPTQModifier`` whose Hessian can leave out the positions the loss mask excludes (special tokens).

    llm-compressor applies ``use_loss_mask`` to AWQ only; its GPTQ hook accumulates ``X^T X`` over every input
    row. With ``mask_hessian=True`` the hook multiplies the layer input by the current batch's mask first (the
    sequential pipeline records ``current_batch_idx``), so a masked position contributes nothing. It also keeps
    the names of the modules where the Hessian could not be inverted and the library fell back to
    round-to-nearest (``summary()["fallback_to_nearest"]``), which the library only logs (private attributes).
    """
    require_series(LLMCOMPRESSOR_SERIES, "masked GPTQ Hessian (GPTQModifier private state)")
    from llmcompressor.core import active_session
    from llmcompressor.modifiers.gptq import GPTQModifier
    from pydantic import PrivateAttr

    class MaskedGPTQModifier(GPTQModifier):
        mask_hessian: bool = False
        _llmc_fallback: list[str] = PrivateAttr(default_factory=list)
        _llmc_compressed: int = PrivateAttr(default=0)

        def calibrate_module(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                             _output: torch.Tensor) -> None:
            state = active_session().state
            if self.mask_hessian and state.loss_masks is not None:
                if state.current_batch_idx < 0:
                    raise RuntimeError("GPTQ masking needs the sequential pipeline's current_batch_idx")
                mask = state.loss_masks[state.current_batch_idx]  # [b, seq]: 1 = keep
                inp = args[0]  # [b, seq, in_features]
                args = (inp * mask.to(inp.device, inp.dtype).unsqueeze(-1), *args[1:])
            return super().calibrate_module(module, args, _output)

        def _log_rtn_fallback_summary(self) -> None:
            self._llmc_fallback = list(self._rtn_fallback_module_names)
            self._llmc_compressed = self._num_compressed_modules
            super()._log_rtn_fallback_summary()

        def summary(self) -> dict[str, Any]:
            return {"modules": self._llmc_compressed, "fallback_to_nearest": self._llmc_fallback,
                    "hessian_excludes_special_tokens": self.mask_hessian}

    return MaskedGPTQModifier


@dataclass(frozen=True)
class Int4Options:
    """What to run: ``method`` "awq" | "rtn", ``rounding`` "nearest" | "gptq" (AWQ only), int4 group size, the IR
    dtype the scales are rounded to, AWQ knobs."""

    method: str
    group_size: int
    scale_dtype: torch.dtype
    duo_scaling: bool | str = True
    n_grid: int = 20
    search_batches: int | None = None  # None: the grid search scores every cached batch
    batch_size: int = 4
    use_loss_mask: bool = True
    rounding: str = "nearest"
    gptq_dampening: float = 0.01  # fraction of the Hessian's mean diagonal added before inverting it
    gptq_use_loss_mask: bool = False  # also leave masked positions out of GPTQ's Hessian


def int4_recipe(options: Int4Options) -> list[Any]:
    """llm-compressor modifiers: AWQ + int4 quantizer ("awq") or the int4 quantizer alone ("rtn").

    The quantizer rounds to nearest, or with GPTQ when ``options.rounding == "gptq"`` (AWQ only). GPTQ runs
    with ``actorder="static"`` (the library's default, an alias of "weight"): columns are rounded in order of
    decreasing Hessian diagonal, but every column keeps the scale of its own contiguous group, so the storage
    format is unchanged (no ``g_idx``; the "group"/"dynamic" ordering, which would need one, is not used).
    Measured on SmolLM2 g64: mean KL 0.141 with static ordering vs 0.186 without.
    """
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=options.group_size, scale_dtype=options.scale_dtype)
    groups = {"int4": QuantizationScheme(targets=["Linear"], weights=weights)}
    if options.method == "rtn":
        assert options.rounding == "nearest", "round-to-nearest has no other rounding"
        return [QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    assert options.method == "awq", options.method
    awq = _awq_modifier_class()(duo_scaling=options.duo_scaling, n_grid=options.n_grid,
                                search_batches=options.search_batches)
    if options.rounding == "gptq":
        gptq = _gptq_modifier_class()(config_groups=groups, ignore=["lm_head"], actorder=GPTQ_ACTORDER,
                                      dampening_frac=options.gptq_dampening,
                                      mask_hessian=options.gptq_use_loss_mask and options.use_loss_mask)
        return [awq, gptq]
    assert options.rounding == "nearest", options.rounding
    return [awq, QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def calibration_batches(calib: CalibrationSet, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The calibration set as ready-made batches (each [b, seq_len]) with the ``loss_mask`` column."""
    batches = []
    for start in range(0, calib.n_samples, batch_size):
        ids = calib.input_ids[start:start + batch_size]  # [b, seq_len]
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                        "loss_mask": calib.loss_mask[start:start + batch_size]})
    return batches


def run_oneshot(model: torch.nn.Module, options: Int4Options, calib: CalibrationSet | None,
                progress: ProgressFn | None = None) -> dict[str, Any]:
    """Quantize ``model`` in place with llm-compressor's ``oneshot`` (afterwards read it with extract_int4).

    ``calib`` is required for AWQ and ignored for round-to-nearest (data-free). Error propagation between
    layers is off: AWQ only moves scales between ops (function-preserving in float), so the propagated
    activations would be the same; GPTQ then sees each layer's float inputs. Returns the GPTQ summary
    (``{"modules", "fallback_to_nearest", "hessian_excludes_special_tokens"}``) when GPTQ rounded, else ``{}``.
    """
    passes = ("awq", "gptq") if options.method == "awq" and options.rounding == "gptq" else ("awq",)
    with library_context(progress, passes=passes):
        from llmcompressor import oneshot
        from torch.utils.data import DataLoader

        modifiers = int4_recipe(options)
        if options.method == "rtn":
            oneshot(model=model, recipe=modifiers)
            return {}
        assert calib is not None, "AWQ needs a calibration set"
        loader = DataLoader(calibration_batches(calib, options.batch_size), batch_size=None, shuffle=False)
        oneshot(model=model, recipe=modifiers, dataset=loader, use_loss_mask=options.use_loss_mask,
                num_calibration_samples=calib.n_samples, shuffle_calibration_samples=False, propagate_error=False)
        return modifiers[-1].summary() if options.rounding == "gptq" else {}


@contextlib.contextmanager
def library_context(progress: ProgressFn | None = None, passes: tuple[str, ...] = ("awq",)) -> Iterator[None]:
    """Narrow, reversible patches around one llm-compressor run (library imports belong inside it), each undone
    when the context exits: :func:`quiet_library_logs`, :func:`skip_pin_memory` (only without an accelerator),
    :func:`quiet_compression_logger` and :func:`report_progress`."""
    with contextlib.ExitStack() as stack:
        quiet_library_logs(stack)
        if not torch.accelerator.is_available():
            skip_pin_memory(stack)
        quiet_compression_logger(stack)
        report_progress(stack, progress, passes)
        yield


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
    """``IntermediatesCache.pin_memory`` becomes a no-op: AWQ pins cached activations before its grid search, and
    ``Tensor.pin_memory()`` raises on a CPU-only torch build. Pinning only speeds up host-to-GPU copies, so
    skipping it changes nothing else."""
    import llmcompressor.pipelines.cache as cache_mod

    _replace(stack, cache_mod.IntermediatesCache, "pin_memory", _no_pin, LLMCOMPRESSOR_SERIES,
             "CPU-only patch of IntermediatesCache.pin_memory")


def quiet_compression_logger(stack: contextlib.ExitStack) -> None:
    """GPTQ's per-module ``CompressionLogger`` logs at a loguru level ("METRIC") that only the library's own
    logger setup registers; with that setup off it is replaced by a silent stand-in."""
    import llmcompressor.modifiers.gptq.base as gptq_base

    _replace(stack, gptq_base, "CompressionLogger", _QuietCompressionLogger, LLMCOMPRESSOR_SERIES,
             "silent GPTQ CompressionLogger")


def report_progress(stack: contextlib.ExitStack, progress: ProgressFn | None, passes: tuple[str, ...]) -> None:
    """The libraries' tqdm bars (sequential pipeline, AWQ, cache, applying the scheme) become a silent shim that
    reports ``(phase, done, total)`` per decoder layer to ``progress`` (the build's rich bar). The library walks
    the layers once per calibration pass (``passes``: AWQ, then GPTQ when it rounds); the bar counts all passes
    and the phase names the pass."""
    import compressed_tensors.quantization.lifecycle.apply as apply_mod
    import llmcompressor.modifiers.transform.awq.base as awq_base
    import llmcompressor.pipelines.cache as cache_mod
    import llmcompressor.pipelines.sequential.pipeline as seq_mod

    shim = _tqdm_shim(progress, passes)
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


def _tqdm_shim(progress: ProgressFn | None, passes: tuple[str, ...] = ("awq",)) -> Callable[..., Any]:
    """A tqdm replacement that prints nothing and turns "(i/N): Calibrating" stages into progress calls.

    Stage 1 of a walk after the first starts the next of ``passes``; progress counts the stages of all passes.
    """
    seen = {"pass": -1}

    class _Bar:
        def __init__(self, iterable: Any = None, desc: str | None = None, total: int | None = None, **_: Any):
            self.iterable = iterable if iterable is not None else ()
            match = _STAGE.match(desc or "")
            if match is not None and progress is not None:
                done, total_stages, phase = int(match.group(1)) - 1, int(match.group(2)), match.group(3)
                if done == 0:
                    seen["pass"] = min(seen["pass"] + 1, len(passes) - 1)
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


def extract_int4(model: torch.nn.Module, group_size: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every quantized Linear as {HF module path: (q int8 [O, K] in [-8, 7], scales [O, K/g] f32, prequant [K])}.

    q comes from the library's own ``quantize`` with the module's scale, so ``q * scale`` equals the library's
    fake-quantized weight bit for bit. prequant is ones: the AWQ scales are folded into the previous op.
    """
    from compressed_tensors.quantization.lifecycle.forward import quantize

    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if not isinstance(module, torch.nn.Linear) or scheme is None or scheme.weights is None:
            continue
        args = scheme.weights
        assert args.symmetric and args.num_bits == 4 and args.group_size == group_size, args
        scale = module.weight_scale.detach()  # [O, K/g]
        zero = getattr(module, "weight_zero_point", None)
        assert zero is None or not bool(zero.any()), f"{name}: symmetric int4 must have zero points of 0"
        g_idx = getattr(module, "weight_g_idx", None)  # W4A16_AWQ stores contiguous groups only
        assert g_idx is None or torch.equal(g_idx.long(), torch.arange(module.in_features) // group_size), name
        q = quantize(x=module.weight.detach(), scale=scale, zero_point=zero, args=args, dtype=torch.int8)
        prequant = torch.ones(module.in_features, dtype=torch.float32)  # [K]
        out[name] = (q.contiguous(), scale.float().contiguous(), prequant)
    return out


def library_dequantized_weight(module: torch.nn.Linear) -> torch.Tensor:
    """The library's fake-quantized (quantize-dequantize) weight of a quantized Linear, in its dtype [O, K]."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    return forward_quantize(module, module.weight.detach(), "weight", module.quantization_scheme.weights)


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's HF state dict without the quantization parameters (folded norms, embeddings, weights)."""
    return {k: v.detach() for k, v in model.state_dict().items() if not QUANT_PARAM.search(k)}


def library_versions() -> dict[str, str]:
    """Versions of the libraries that produced the int4 weights (for the build report)."""
    from importlib.metadata import PackageNotFoundError, version

    result = {}
    for package in ("llmcompressor", "compressed-tensors", "torch", "transformers"):
        try:
            result[package] = version(package)
        except PackageNotFoundError:
            result[package] = "not installed"
    return result

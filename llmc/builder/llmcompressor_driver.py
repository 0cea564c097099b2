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
- every run happens inside :func:`llmc.builder.llmcompressor_patches.library_context` (the narrow, version-
  checked patches this needs); the two modifier subclasses here override private methods, so they check the
  installed release the same way (:func:`~llmc.builder.llmcompressor_patches.require_series`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import types
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from llmc.builder.calibrate import CalibrationSet
from llmc.builder.llmcompressor_patches import (
    LLMCOMPRESSOR_SERIES, ProgressFn, installed_version, library_context, require_series,
)
from llmc.engine.torch import cpu_gemm

GPTQ_ACTORDER = "static"  # GPTQ's column order (see int4_recipe); the IR format needs no g_idx with it

# Tensors the quantization lifecycle attaches to a module; not model weights.
QUANT_PARAM = re.compile(r"\.(weight|input|output)_(scale|zero_point|global_scale|g_idx)$")


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


def hessian_increment(inp: torch.Tensor, module: torch.nn.Module, hessian: torch.Tensor, num_samples: torch.Tensor,
                      accumulate: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One input batch's GPTQ statistics added to (zero) ``hessian`` and ``num_samples``: the library's
    ``accumulate`` (``accumulate_hessian``), or for a linear's ``[b, seq, in]`` float32 CPU input with oneDNN chosen
    (:mod:`llmc.engine.torch.cpu_gemm`) the same sums, ``2 X^T X`` over the batch's rows and ``b`` samples, through
    oneDNN."""
    if isinstance(module, torch.nn.Linear) and inp.dim() == 3 and cpu_gemm.uses_onednn(inp) \
            and hessian.device.type == "cpu":
        hessian += cpu_gemm.gram(math.sqrt(2) * inp.reshape(-1, inp.shape[-1]))  # as the library scales its inputs
        return hessian, num_samples + inp.shape[0]
    return accumulate(inp, module, hessian, num_samples)


@functools.cache
def _gptq_modifier_class() -> type:
    """``GPTQModifier`` whose Hessian can leave out the positions the loss mask excludes (special tokens).

    llm-compressor applies ``use_loss_mask`` to AWQ only; its GPTQ hook accumulates ``X^T X`` over every input
    row. With ``mask_hessian=True`` the hook multiplies the layer input by the current batch's mask first (the
    sequential pipeline records ``current_batch_idx``), so a masked position contributes nothing. It also keeps
    the names of the modules where the Hessian could not be inverted and the library fell back to
    round-to-nearest (``summary()["fallback_to_nearest"]``), which the library only logs (private attributes).

    Linears that read the same input tensor (q, k and v; gate and up) get the same ``2 X^T X`` increment: it is
    computed once (the library's own ``accumulate_hessian`` on a zero matrix) and added to each of their Hessians,
    which is bit for bit what the library computes three (two) times. On 2 CPU cores the Hessians were 92 s of
    SmolLM2's build; sharing removes 6 of every 10 q/k/v/gate/up products.
    """
    require_series(LLMCOMPRESSOR_SERIES, "masked GPTQ Hessian (GPTQModifier private state)")
    from llmcompressor.core import active_session
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.gptq import base as gptq_base
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian
    from pydantic import PrivateAttr

    class MaskedGPTQModifier(GPTQModifier):
        mask_hessian: bool = False
        _llmc_fallback: list[str] = PrivateAttr(default_factory=list)
        _llmc_last_increment: Any = PrivateAttr(default=None)  # (weakref to an input, its 2 X^T X, its count)
        _llmc_compressed: int = PrivateAttr(default=0)

        def calibrate_module(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                             _output: torch.Tensor) -> None:
            source = args[0]  # [b, seq, in_features], the same tensor object for linears that share an input
            if module not in self._num_samples:  # as the library's hook starts a Hessian
                device = gptq_base.get_execution_device(module)
                self._hessians[module] = make_empty_hessian(module, device=device)
                self._num_samples[module] = torch.zeros(tuple(), device=device)
            last = self._llmc_last_increment
            if last is None or last[0]() is not source or last[1].shape != self._hessians[module].shape:
                inp = source
                state = active_session().state
                if self.mask_hessian and state.loss_masks is not None:
                    if state.current_batch_idx < 0:
                        raise RuntimeError("GPTQ masking needs the sequential pipeline's current_batch_idx")
                    mask = state.loss_masks[state.current_batch_idx]  # [b, seq]: 1 = keep
                    inp = inp * mask.to(inp.device, inp.dtype).unsqueeze(-1)
                increment, count = hessian_increment(inp, module, torch.zeros_like(self._hessians[module]),
                                                     torch.zeros_like(self._num_samples[module]), accumulate_hessian)
                last = self._llmc_last_increment = (weakref.ref(source), increment, count)
            self._hessians[module] += last[1]
            self._num_samples[module] += last[2]

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
                progress: ProgressFn | None = None, device: torch.device | None = None,
                timer: Any = None) -> dict[str, Any]:
    """Quantize ``model`` in place with llm-compressor's ``oneshot`` (afterwards read it with extract_int4).

    ``calib`` is required for AWQ and ignored for round-to-nearest (data-free). Error propagation between
    layers is off: AWQ only moves scales between ops (function-preserving in float), so the propagated
    activations would be the same; GPTQ then sees each layer's float inputs. Returns the GPTQ summary
    (``{"modules", "fallback_to_nearest", "hessian_excludes_special_tokens"}``) when GPTQ rounded, else ``{}``.

    ``device`` (default CPU) is where the library computes: its sequential pipeline keeps the model where it was
    loaded (the CPU) and onloads one decoder layer at a time to ``device``, keeping it there while the layer's
    calibration batches run, so GPU memory holds one layer, its cached inputs and the modifiers' statistics,
    never the whole model. Afterwards the model's weights are plain CPU tensors again. ``timer`` (a
    ``devices.PassTimer``) gets ``start(pass)`` at each calibration pass (awq, then gptq).
    """
    device = device if device is not None else torch.device("cpu")
    passes = ("awq", "gptq") if options.method == "awq" and options.rounding == "gptq" else ("awq",)
    if options.method == "rtn":
        passes = ("rtn",)
    with library_context(progress, passes=passes, device=device, timer=timer), skip_logits(model):
        from compressed_tensors.offload import remove_dispatch
        from llmcompressor import oneshot
        from torch.utils.data import DataLoader

        modifiers = int4_recipe(options)
        try:
            if options.method == "rtn":
                if timer is not None:
                    timer.start("rtn")
                oneshot(model=model, recipe=modifiers)
                return {}
            assert calib is not None, "AWQ needs a calibration set"
            loader = DataLoader(calibration_batches(calib, options.batch_size), batch_size=None, shuffle=False)
            with cpu_gemm.fp32_linears(device):  # the passes' float32 GEMMs through oneDNN where it is faster
                oneshot(model=model, recipe=modifiers, dataset=loader, use_loss_mask=options.use_loss_mask,
                        num_calibration_samples=calib.n_samples, shuffle_calibration_samples=False,
                        propagate_error=False,
                        sequential_offload_device=str(device) if device.type == "cuda" else "cpu")
            return modifiers[-1].summary() if options.rounding == "gptq" else {}
        finally:
            if timer is not None:
                timer.stop()
            remove_dispatch(model)  # offloaded (CPU) tensors stay where they are; no GPU copy of the model


@contextlib.contextmanager
def skip_logits(model: torch.nn.Module) -> Iterator[None]:
    """Within: the model's ``lm_head`` returns an empty tensor instead of logits.

    The sequential pipeline runs every subgraph on every calibration batch, the last one (final norm +
    lm_head) included, although nothing reads its output: no modifier hooks lm_head (it is ignored) and the
    last subgraph's outputs are not kept. Its logits cost 2 x hidden x vocab FLOP per token per pass (SmolLM2:
    ~20 % of a forward pass; 65,536 tokens x 2 passes ~ 7.4 TFLOP, ~50 s on 2 cores). Skipping them changes no
    result (tested: bit-identical IR).
    """
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Module):
        yield
        return
    # A bound method, as compressed-tensors' offload wrapper expects (it wraps ``forward.__func__``).
    head.forward = types.MethodType(_empty_logits, head)
    try:
        yield
    finally:
        del head.forward  # the class's forward again


def _empty_logits(self: torch.nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return hidden[..., :0]  # [b, seq, 0]: nothing to compute


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
    return {package: installed_version(package) or "not installed"
            for package in ("llmcompressor", "compressed-tensors", "torch", "transformers")}

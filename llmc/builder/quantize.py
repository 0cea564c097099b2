"""int4 weight-only quantization (AWQ or round-to-nearest) of a model source into the W4A16_AWQ checkpoint IR.

Library choice: **llm-compressor** (``llmcompressor>=0.14,<0.15``, the ``quant`` extra), because
- it is maintained (vLLM project) and supports exactly the calibration we need: a ``loss_mask`` dataset
  column with ``use_loss_mask=True`` keeps special-token positions in the model's input but out of AWQ's
  activation statistics and of its scale-search error;
- it pins transformers 5.15-5.17, the range llmc uses. Its only CPU issue is ``IntermediatesCache.pin_memory``
  (pinning fails on a CPU-only torch), patched to a no-op in a narrow context
  (``llmcompressor_patches.skip_pin_memory``).
Rejected: nvidia-modelopt 0.47 (``INT4_AWQ_CFG``) can export the TensorRT-LLM checkpoint directly but has no
token mask, its TensorRT-LLM export is deprecated in 0.48 and removed in 0.49, and its ``[hf]`` extra pins
transformers < 5.15 and pulls deepspeed and diffusers; autoawq is deprecated upstream.

Method: int4, symmetric (no zero point), one scale per group of ``group_size`` inputs, scales rounded to the IR
dtype by the library itself, so the checkpoint holds exactly the weights the library evaluated. Embeddings
and lm_head stay 16-bit. ``awq`` = AWQModifier (AWQ_N_GRID candidates) then the quantizer, which by default
(``rounding: gptq``) is the library's GPTQModifier: a second calibration pass over the AWQ-scaled model whose
Hessian decides the int4 values with the same scales and groups. The special-token mask applies to AWQ's
statistics and scale search; GPTQ's Hessian sees every position unless ``gptq_exclude_special_tokens``
(measured: mean KL 0.131 with all positions, 0.141 with the mask, 0.133 with no mask anywhere);
``rounding: nearest`` rounds to nearest (AWQ alone). ``rtn`` = the quantizer alone, rounding to nearest
(baseline, no calibration). ``exclude_special_tokens: false`` is the unmasked comparison mode.
Measured on SmolLM2-135M g64 (docs/AWQ.md): mean KL 0.211 (AWQ alone) -> 0.131 (AWQ + GPTQ), RTN 0.390;
GPTQ adds ~3 minutes on 2 cores (its Hessians cost about one more forward pass).

CPU budget knobs (measured in docs/AWQ.md): activations are averaged over every calibration token, but the
grid search scores its candidates on the first AWQ_SEARCH_SAMPLES samples (``search_batches``), and layer
outputs are not re-propagated after smoothing (AWQ's folding preserves the float function; measured: the
library's propagation changed perplexity by 0.0003). The scales are folded into the previous RMSNorm / v_proj /
up_proj, so every prequant scale is 1. AWQ_DUO_SCALING = "both" with AWQ_N_GRID = 16 scores 8 ratios
alpha = i/7 twice, with scales x^alpha (activation only) and x^alpha / w^(1-alpha) (duo), and keeps the best
of the 16 per mapping; AWQ_SEARCH_SAMPLES = 8 samples (4,096 tokens) rank the candidates while the
per-channel statistic still averages all calibration tokens. Measured on SmolLM2-135M g64 (docs/AWQ.md):
against duo-only with 10 candidates, mean KL 0.227 -> 0.211 and perplexity 17.14 -> 17.01 at ~1.6 x the grid
search, which keeps the whole quantization within 10 minutes on 2 cores.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from llmc.builder import llmcompressor_driver
from llmc.builder.calibrate import CalibrationSet, build_calibration_set, check_calibration_spec
from llmc.builder.devices import PassTimer, describe_device, free_gpu_memory, resolve_build_device
from llmc.builder.export import kv_cache_quant_algo, write_w4a16_checkpoint
from llmc.checkpoint.convert import torch_dtype
from llmc.errors import BuildError
from llmc.recipe import Recipe
from llmc.recipe.checks import check_recipe_against_model
from llmc.source.load import SourceModel
from llmc.tokenizer import load_tokenizer

AWQ_N_GRID = 16
AWQ_DUO_SCALING = "both"
AWQ_SEARCH_SAMPLES = 8
CALIBRATION_BATCH = 4
LIBRARY_PASSES = ("awq", "gptq", "rtn")


class StepProgress(Protocol):
    """What quantize reports progress to (``llmc.builder.progress.StepHandle``)."""

    def update(self, completed: float, total: float | None = None) -> None: ...

    def note(self, text: str) -> None: ...


def quantize_checkpoint(source: SourceModel, recipe: Recipe, checkpoint_dir: str | Path,
                        progress: StepProgress | None = None, device: torch.device | None = None) -> dict[str, Any]:
    """Quantize ``source`` (a SourceModel) per ``recipe.quantization`` and write the W4A16_AWQ IR.

    Bad input (method, group size vs. the model's features, calibration dataset/file/sizes, ``device: cuda``
    without a GPU) raises RecipeError / BuildError before any model is loaded. ``device``: where the work runs
    (default: ``quantization.device`` resolved). ``progress`` (optional) gets a per-layer bar. Returns the
    report: method, group size, mask on/off, calibration summary (and the self-generation report), the device,
    seconds and peak GPU memory of each pass, CPU seconds, library versions.
    """
    quant = recipe.quantization
    recipe_file = str(recipe.path) if getattr(recipe, "path", None) else None
    check_inputs(recipe, source.hf_config, recipe_file)
    device = device if device is not None else resolve_build_device(quant.device)
    started, cpu_started = time.perf_counter(), time.process_time()
    timer = PassTimer(device)
    calib, writer = None, None
    if quant.method == "awq":
        _note(progress, "calibration data")
        timer.start("calibration_data")
        if any(s.dataset == "self" for s in quant.calibration.effective_sources):
            from llmc.builder.selfgen import SelfTextWriter

            writer = SelfTextWriter(source, recipe, device, progress)
        calib = make_calibration_set(source, recipe, recipe_file, writer)
        free_gpu_memory(device)
    _note(progress, "loading model")
    timer.start("load_model")
    model = load_float32_model(source.hf_dir)
    timer.stop()
    gptq = llmcompressor_driver.run_oneshot(model, int4_options(recipe), calib, progress=_layer_progress(progress),
                                            device=device, timer=timer)
    free_gpu_memory(device)
    _note(progress, "writing checkpoint")
    timer.start("export")
    written = export_int4(model, source, recipe, checkpoint_dir)
    timer.stop()
    report = make_report(recipe, calib, timer.passes, time.perf_counter() - started,
                         time.process_time() - cpu_started, written, gptq)
    report["device"] = {"requested": quant.device, **describe_device(device)}
    report["self_generation"] = writer.report if writer is not None else None
    return report


def int4_options(recipe: Recipe) -> llmcompressor_driver.Int4Options:
    """The library run a recipe asks for (AWQ knobs are this module's constants, see the docstring)."""
    quant = recipe.quantization
    return llmcompressor_driver.Int4Options(
        method=quant.method, group_size=quant.group_size, scale_dtype=torch_dtype(recipe.model.dtype),
        duo_scaling=AWQ_DUO_SCALING, n_grid=AWQ_N_GRID,
        search_batches=math.ceil(AWQ_SEARCH_SAMPLES / CALIBRATION_BATCH), batch_size=CALIBRATION_BATCH,
        use_loss_mask=bool(quant.exclude_special_tokens), rounding=quant.effective_rounding,
        gptq_dampening=quant.gptq_dampening, gptq_use_loss_mask=bool(quant.gptq_exclude_special_tokens),
    )


def check_inputs(recipe: Recipe, hf_config: dict[str, Any], recipe_file: str | None) -> None:
    """Every check that can fail before work starts: method, recipe vs. model (group size), calibration spec."""
    quant = recipe.quantization
    if quant.method not in ("awq", "rtn"):
        raise BuildError(f"quantize_checkpoint handles quantization.method awq or rtn, not {quant.method!r}; "
                         "use llmc.builder.export.export_checkpoint for method none")
    check_recipe_against_model(recipe, hf_config)
    if quant.method == "awq":
        check_calibration_spec(quant.calibration, recipe_file)


def make_calibration_set(source: SourceModel, recipe: Recipe, recipe_file: str | None, self_text: Any = None
                         ) -> CalibrationSet:
    """The recipe's calibration windows, tokenized with the source's tokenizer and chat template (``self_text``:
    the model's own text for dataset ``self``, a :class:`llmc.builder.selfgen.SelfTextWriter`)."""
    quant = recipe.quantization
    return build_calibration_set(
        quant.calibration, load_tokenizer(source.hf_dir),
        exclude_special_tokens=bool(quant.exclude_special_tokens), chat_template=source.chat_template,
        add_special_tokens=bool(recipe.model.add_special_tokens),
        extra_special_ids=(*source.special_token_ids, *source.eos_token_ids), recipe_file=recipe_file,
        self_text=self_text,
    )


def load_float32_model(hf_dir: str | Path) -> torch.nn.Module:
    """The HF causal LM in ``hf_dir`` in float32 on CPU, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def export_int4(model: torch.nn.Module, source: SourceModel, recipe: Recipe, checkpoint_dir: str | Path
                ) -> dict[str, Any]:
    """Write the library's int4 results (and the folded 16-bit tensors) as the W4A16_AWQ IR."""
    group_size = recipe.quantization.group_size
    layers = llmcompressor_driver.extract_int4(model, group_size)
    state = llmcompressor_driver.plain_state_dict(model)
    return write_w4a16_checkpoint(source.hf_config, recipe.model.dtype, state, layers, group_size,
                                  recipe.engine.tp_size, checkpoint_dir, kv_cache_quant_algo(recipe.kv_cache.dtype))


def make_report(recipe: Recipe, calib: CalibrationSet | None, passes: list[dict[str, Any]], total_seconds: float,
                cpu_seconds: float, written: dict[str, Any], gptq: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-able quantization report for build_report.json.

    ``passes``: ``{name, seconds, peak_gpu_memory_bytes}`` in order (calibration_data, load_model, awq, gptq |
    rtn, export); ``seconds`` repeats their times by name, with ``quantize`` = the library passes together.
    """
    quant = recipe.quantization
    awq = quant.method == "awq"
    seconds = {p["name"]: p["seconds"] for p in passes}
    seconds["quantize"] = round(sum(p["seconds"] for p in passes if p["name"] in LIBRARY_PASSES), 2)
    seconds["total"] = round(total_seconds, 2)
    peaks = [p["peak_gpu_memory_bytes"] for p in passes if p["peak_gpu_memory_bytes"] is not None]
    return {
        "method": quant.method,
        "bits": 4,
        "symmetric": True,
        "group_size": quant.group_size,
        "rounding": quant.effective_rounding,
        "loss_mask": bool(quant.exclude_special_tokens) if awq else None,
        "calibration": calib.summary() if calib is not None else None,
        "awq": {"duo_scaling": AWQ_DUO_SCALING, "n_grid": AWQ_N_GRID, "search_samples": AWQ_SEARCH_SAMPLES,
                "batch_size": CALIBRATION_BATCH} if awq else None,
        "gptq": {**gptq, "dampening": quant.gptq_dampening, "actorder": llmcompressor_driver.GPTQ_ACTORDER} if gptq else None,
        "passes": passes,
        "seconds": seconds,
        "peak_gpu_memory_bytes": max(peaks) if peaks else None,
        "cpu_seconds": round(cpu_seconds, 1),
        "checkpoint": written,
        "library": llmcompressor_driver.library_versions(),
    }


def _layer_progress(progress: StepProgress | None) -> llmcompressor_driver.ProgressFn | None:
    if progress is None:
        return None

    def report(phase: str, done: int, total: int) -> None:
        progress.update(done, total)
        progress.note(phase)

    return report


def _note(progress: StepProgress | None, text: str) -> None:
    if progress is not None:
        progress.note(text)



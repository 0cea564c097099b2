"""Accuracy gate: the int4 checkpoint against the 16-bit model, token by token, on held-out text.

Both sides run through the same Hugging Face ``LlamaForCausalLM`` in float32 on CPU: the 16-bit model from
``source.hf_dir``, and the int4 model built by dequantizing the written W4A16_AWQ IR (``dequantize_w4a16``:
``(q * scale) * prequant``) back into HF tensors -- including the AWQ-folded norms and the IR's 16-bit
embedding -- so the gate scores exactly the weights that ship, and any difference comes from them alone (not
from two attention implementations). The portable engine loads the same IR with the same dequantization.

Text: held-out pydoc topics (:func:`llmc.builder.calib_text.heldout_text`, disjoint from calibration), cut into
ceil(n_tokens / GATE_WINDOW) windows. Metrics: perplexity of both models, per-position KL(p16 || pint4)
mean / p99 / max, top-1 agreement. Chat check: for CHAT_PROMPTS held-out prompts in the chat template, greedy
decoding must end the turn with an end token (``source.eos_token_ids``) within 2 x CHAT_BUDGET tokens for the
int4 model wherever the 16-bit model ends it within CHAT_BUDGET.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from llmc.builder import gate_report
from llmc.builder.calib_text import heldout_chat_prompts, heldout_text
from llmc.checkpoint import names
from llmc.checkpoint.convert import dequantized_weights, trtllm_to_hf
from llmc.checkpoint.io import read_checkpoint
from llmc.errors import AccuracyGateError, BuildError
from llmc.recipe import Recipe
from llmc.source.load import SourceModel

GATE_WINDOW = 512
CHAT_PROMPTS = 4
CHAT_BUDGET = 64


def accuracy_gate(source: SourceModel, recipe: Recipe, checkpoint_dir: str | Path, console: Console | None = None
                  ) -> dict[str, Any]:
    """Compare the int4 IR in ``checkpoint_dir`` with ``source``'s 16-bit model; return the gate report.

    Prints a rich table to ``console`` (default: stderr). Raises AccuracyGateError (with ``.report`` holding the
    full report) when mean KL exceeds ``quantization.gate.max_mean_kl``, the perplexity ratio exceeds
    ``max_ppl_ratio`` (when set), or the int4 model loses the chat end token; its message lists the worst
    positions.
    """
    from llmc.builder.quantize import load_float32_model
    from llmc.tokenizer import load_tokenizer

    gate = recipe.quantization.gate
    started = time.perf_counter()
    tokenizer = load_tokenizer(source.hf_dir)
    windows = heldout_windows(tokenizer, gate.n_tokens)
    model_16 = load_float32_model(source.hf_dir)
    model_int4 = load_float32_model(source.hf_dir)
    load_ir_weights(model_int4, checkpoint_dir, source.hf_config)
    scores = score(model_16, model_int4, windows)
    metrics = gate_report.summarize(scores)
    chat = chat_end_check(model_16, model_int4, tokenizer, source)
    failures = gate_report.check_thresholds(metrics, gate.max_mean_kl, gate.max_ppl_ratio, chat["failed"])
    report = {
        "passed": not failures,
        "failures": failures,
        "thresholds": {"max_mean_kl": gate.max_mean_kl, "max_ppl_ratio": gate.max_ppl_ratio},
        "metrics": metrics,
        "worst_positions": gate_report.worst_positions(scores, tokenizer),
        "special_token_check": chat,
        "text": "pydoc held-out topics",
        "seconds": round(time.perf_counter() - started, 2),
    }
    (console or Console(stderr=True)).print(gate_report.metrics_table(report))
    if failures:
        error = AccuracyGateError(
            "the int4 model failed the accuracy gate: " + "; ".join(failures) + ".\nWorst positions:\n"
            + gate_report.worst_positions_text(report["worst_positions"])
            + "\nFix: use quantization.method awq with exclude_special_tokens: true and rounding: gptq, a smaller "
            "group_size, more calibration samples, or relax quantization.gate if this model is known to be fragile "
            "under int4"
        )
        error.report = report
        raise error
    return report


def heldout_windows(tokenizer: Any, n_tokens: int, window: int = GATE_WINDOW) -> torch.Tensor:
    """ceil(n_tokens / window) consecutive windows [W, window] of the held-out text (BuildError if too short)."""
    ids = tokenizer(heldout_text(), add_special_tokens=False)["input_ids"]
    count = math.ceil(n_tokens / window)
    if len(ids) < count * window:
        raise BuildError(f"the held-out gate text has {len(ids)} tokens, fewer than quantization.gate.n_tokens="
                         f"{n_tokens} rounded up to windows of {window}. Fix: lower quantization.gate.n_tokens "
                         f"to at most {len(ids) // window * window}")
    return torch.tensor(ids[: count * window], dtype=torch.long).view(count, window)


@torch.no_grad()
def score(model_16: torch.nn.Module, model_int4: torch.nn.Module, windows: torch.Tensor) -> gate_report.Scores:
    """Per-position KL / NLL / top-1 of both models over ``windows`` [W, L]."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for ids in windows:
        logits_16 = model_16(input_ids=ids[None]).logits[0]  # [L, V]
        logits_int4 = model_int4(input_ids=ids[None]).logits[0]  # [L, V]
        parts.append(gate_report.window_scores(ids, logits_16, logits_int4))
    kl, nll_16, nll_int4, top_16, top_int4 = (torch.stack(column) for column in zip(*parts))
    return gate_report.Scores(windows, kl, nll_16, nll_int4, top_16, top_int4)


@torch.no_grad()
def chat_end_check(model_16: torch.nn.Module, model_int4: torch.nn.Module, tokenizer: Any, source: SourceModel
                   ) -> dict[str, Any]:
    """Greedy chat answers of both models: does int4 end its turn wherever the 16-bit model does?"""
    eos = list(source.eos_token_ids)
    results, failed = [], []
    if not eos or source.chat_template is None:
        return {"prompts": 0, "ended_16bit": 0, "ended_int4": 0, "failed": [], "results": [],
                "skipped": "the model has no chat template or end token"}
    for index, prompt in enumerate(heldout_chat_prompts(CHAT_PROMPTS)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True, chat_template=source.chat_template)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        end_16 = _greedy_end(model_16, ids, eos, CHAT_BUDGET)
        end_int4 = _greedy_end(model_int4, ids, eos, 2 * CHAT_BUDGET)
        results.append({"prompt": index, "end_16bit": end_16, "end_int4": end_int4})
        if end_16 is not None and end_int4 is None:
            failed.append(f"prompt {index}: the 16-bit model ends its turn after {end_16} tokens, the int4 model "
                          f"not within {2 * CHAT_BUDGET}")
    return {
        "prompts": len(results),
        "ended_16bit": sum(r["end_16bit"] is not None for r in results),
        "ended_int4": sum(r["end_16bit"] is not None and r["end_int4"] is not None for r in results),
        "failed": failed,
        "results": results,
    }


def _greedy_end(model: torch.nn.Module, ids: torch.Tensor, eos: list[int], budget: int) -> int | None:
    """Number of tokens greedy decoding produces up to and including the first end token (None: not in budget)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=budget, eos_token_id=eos, pad_token_id=eos[0])
    out = model.generate(ids, generation_config=config)[0, ids.shape[1]:]  # [generated]
    hits = [i for i, t in enumerate(out.tolist()) if t in eos]
    return hits[0] + 1 if hits else None


def load_ir_weights(model: torch.nn.Module, checkpoint_dir: str | Path, hf_config: dict[str, Any]) -> None:
    """Replace ``model``'s weights (a HF Llama of the same shape) by the IR's, dequantized."""
    result = model.load_state_dict(ir_to_hf_state_dict(checkpoint_dir, hf_config), strict=False)
    missing = [k for k in result.missing_keys if k != names.HF_LM_HEAD or not hf_config.get("tie_word_embeddings")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)


def ir_to_hf_state_dict(checkpoint_dir: str | Path, hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The IR's weights as a float32 HF Llama state dict (int4 layers dequantized, TP merged, padding removed)."""
    config, ranks = read_checkpoint(Path(checkpoint_dir))
    weights = dequantized_weights(config, ranks)
    return trtllm_to_hf({k: v.float() for k, v in weights.items()}, hf_config)

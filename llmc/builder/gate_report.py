"""Accuracy-gate metrics and their presentation: per-token KL / perplexity / top-1 summaries, thresholds, tables.

Pure functions over the scores :mod:`llmc.builder.verify` computes, so they are tested without models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from rich.table import Table

WORST_POSITIONS = 10


@dataclass(frozen=True)
class Scores:
    """Per-position scores of the 16-bit and int4 models on W held-out windows of L tokens."""

    input_ids: torch.Tensor  # [W, L] int64
    kl: torch.Tensor  # [W, L] float64: KL(p16 || pint4) of the next-token distribution at each position
    nll_16: torch.Tensor  # [W, L-1] float64: -log p16(next token)
    nll_int4: torch.Tensor  # [W, L-1] float64
    top1_16: torch.Tensor  # [W, L] int64: argmax of the 16-bit model
    top1_int4: torch.Tensor  # [W, L] int64


def window_scores(input_ids: torch.Tensor, logits_16: torch.Tensor, logits_int4: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    """(kl [L], nll_16 [L-1], nll_int4 [L-1], top1_16 [L], top1_int4 [L]) of one window.

    input_ids [L]; logits [L, V] (any float dtype; computed in float64 for a stable KL).
    """
    logp = torch.log_softmax(logits_16.double(), dim=-1)  # [L, V]
    logq = torch.log_softmax(logits_int4.double(), dim=-1)  # [L, V]
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)  # [L]
    targets = input_ids[1:].unsqueeze(-1)  # [L-1, 1]
    nll_16 = -logp[:-1].gather(-1, targets).squeeze(-1)  # [L-1]
    nll_int4 = -logq[:-1].gather(-1, targets).squeeze(-1)
    return kl, nll_16, nll_int4, logp.argmax(-1), logq.argmax(-1)


def summarize(scores: Scores) -> dict[str, float | int]:
    """Perplexities, their ratio, KL mean/p99/max and top-1 agreement (JSON-able floats)."""
    kl = scores.kl.flatten()
    ppl_16 = math.exp(float(scores.nll_16.mean()))
    ppl_int4 = math.exp(float(scores.nll_int4.mean()))
    return {
        "windows": int(scores.input_ids.shape[0]),
        "tokens": int(scores.input_ids.numel()),
        "ppl_16bit": round(ppl_16, 4),
        "ppl_int4": round(ppl_int4, 4),
        "ppl_ratio": round(ppl_int4 / ppl_16, 4),
        "kl_mean": round(float(kl.mean()), 5),
        "kl_p99": round(float(torch.quantile(kl, 0.99)), 5),
        "kl_max": round(float(kl.max()), 5),
        "top1_agreement": round(float((scores.top1_16 == scores.top1_int4).double().mean()), 4),
    }


def worst_positions(scores: Scores, tokenizer: Any, k: int = WORST_POSITIONS) -> list[dict[str, Any]]:
    """The ``k`` positions with the largest KL: window, position, input token, KL, both models' top-1."""
    flat = scores.kl.flatten()
    length = scores.kl.shape[1]
    rows = []
    for index in torch.topk(flat, min(k, flat.numel())).indices.tolist():
        w, p = divmod(index, length)
        rows.append({
            "window": w,
            "position": p,
            "token": _token(tokenizer, int(scores.input_ids[w, p])),
            "kl": round(float(flat[index]), 4),
            "top1_16bit": _token(tokenizer, int(scores.top1_16[w, p])),
            "top1_int4": _token(tokenizer, int(scores.top1_int4[w, p])),
        })
    return rows


def _token(tokenizer: Any, token_id: int) -> str:
    return repr(tokenizer.decode([token_id]))


def check_thresholds(metrics: dict[str, Any], max_mean_kl: float, max_ppl_ratio: float | None,
                     special_failures: Sequence[str]) -> list[str]:
    """Human-readable reasons the gate fails (empty when it passes)."""
    failures = []
    if metrics["kl_mean"] > max_mean_kl:
        failures.append(f"mean KL {metrics['kl_mean']:.4f} > max_mean_kl {max_mean_kl:g}")
    if max_ppl_ratio is not None and metrics["ppl_ratio"] > max_ppl_ratio:
        failures.append(f"perplexity ratio {metrics['ppl_ratio']:.3f} > max_ppl_ratio {max_ppl_ratio:g}")
    failures += [f"chat end token: {f}" for f in special_failures]
    return failures


def metrics_table(report: dict[str, Any]) -> Table:
    """Rich table of the gate's metrics next to their thresholds."""
    m, t = report["metrics"], report["thresholds"]
    table = Table(title=f"accuracy gate: {'PASS' if report['passed'] else 'FAIL'} "
                        f"({m['tokens']} held-out tokens)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("threshold", justify="right")
    table.add_row("perplexity 16-bit", f"{m['ppl_16bit']:.3f}", "")
    table.add_row("perplexity int4", f"{m['ppl_int4']:.3f}", "")
    ratio_limit = t["max_ppl_ratio"]
    table.add_row("perplexity ratio", f"{m['ppl_ratio']:.3f}", f"<= {ratio_limit:g}" if ratio_limit else "-")
    table.add_row("KL mean", f"{m['kl_mean']:.4f}", f"<= {t['max_mean_kl']:g}")
    table.add_row("KL p99", f"{m['kl_p99']:.4f}", "")
    table.add_row("KL max", f"{m['kl_max']:.4f}", "")
    table.add_row("top-1 agreement", f"{m['top1_agreement']:.3f}", "")
    chat = report["special_token_check"]
    table.add_row("chat end token kept", f"{chat['ended_int4']}/{chat['ended_16bit']}", "all")
    return table


def worst_positions_text(rows: Sequence[dict[str, Any]]) -> str:
    """Plain-text table of the worst positions (for the AccuracyGateError message)."""
    header = f"{'window':>6} {'pos':>5} {'KL':>8}  {'token':<18} {'top-1 16-bit':<18} {'top-1 int4':<18}"
    lines = [header]
    for r in rows:
        lines.append(f"{r['window']:>6} {r['position']:>5} {r['kl']:>8.3f}  {r['token'][:18]:<18} "
                     f"{r['top1_16bit'][:18]:<18} {r['top1_int4'][:18]:<18}")
    return "\n".join(lines)

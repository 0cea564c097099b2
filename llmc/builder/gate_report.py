"""Accuracy-gate metrics and their presentation: per-token KL / perplexity / top-1 summaries per domain, the
build / RTN ratios, the mean over domains, bounds, tables.

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


SCORE_ROWS = 64  # positions scored at a time on the CPU (see window_scores)


def window_scores(input_ids: torch.Tensor, logits_16: torch.Tensor, logits_int4: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    """(kl [L], nll_16 [L-1], nll_int4 [L-1], top1_16 [L], top1_int4 [L]) of one window.

    input_ids [L]; logits [L, V] (any float dtype, any device; computed in float64 for a stable KL). The results
    are CPU tensors. On the CPU the positions go SCORE_ROWS at a time: each row's arithmetic is the same as over
    the whole window (bit for bit: every op is per row), but the float64 temporaries of 64 rows (25 MB for a
    49,152-token vocabulary) stay in the cache where a whole window's (200 MB each) went through memory: the
    gate's scoring of SmolLM2 took a third of the time (2-core Xeon), the 16-bit side recomputed per model
    included. On CUDA the window goes in one piece (the GPU's reductions may split rows differently by shape).
    """
    length = logits_int4.shape[0]
    rows = SCORE_ROWS if logits_int4.device.type == "cpu" else length
    parts = [_rows_scores(input_ids, logits_16[start:start + rows], logits_int4[start:start + rows], start)
             for start in range(0, length, rows)]
    return tuple(torch.cat(column).cpu() for column in zip(*parts))


def _rows_scores(input_ids: torch.Tensor, logits_16: torch.Tensor, logits_int4: torch.Tensor, start: int
                 ) -> tuple[torch.Tensor, ...]:
    """:func:`window_scores` of the window's positions ``start`` to ``start + len(logits_16)``."""
    logp = torch.log_softmax(logits_16.double(), dim=-1)  # [r, V]
    logq = torch.log_softmax(logits_int4.double(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)  # [r]
    targets = input_ids[start + 1:start + 1 + logp.shape[0]].unsqueeze(-1)  # [r, 1]; [r-1, 1] at the window's end
    nll_16 = -logp[:targets.shape[0]].gather(-1, targets).squeeze(-1)
    nll_int4 = -logq[:targets.shape[0]].gather(-1, targets).squeeze(-1)
    return kl, nll_16, nll_int4, logp.argmax(-1), logq.argmax(-1)


def stack_scores(windows: torch.Tensor, parts: Sequence[tuple[torch.Tensor, ...]]) -> Scores:
    """The :class:`Scores` of ``windows`` [W, L] from their per-window :func:`window_scores`."""
    kl, nll_16, nll_q, top_16, top_q = (torch.stack(column) for column in zip(*parts))
    return Scores(windows, kl, nll_16, nll_q, top_16, top_q)


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


def domain_metrics(by_model: dict[str, Scores]) -> dict[str, Any]:
    """One domain's figures: tokens, 16-bit perplexity, the int4 (and RTN) metrics, the int4 / RTN ratios."""
    int4 = summarize(by_model["int4"])
    out: dict[str, Any] = {"tokens": int4.pop("tokens"), "windows": int4.pop("windows"),
                           "ppl_16bit": int4.pop("ppl_16bit"), "int4": int4}
    if "rtn" in by_model:
        rtn = summarize(by_model["rtn"])
        out["rtn"] = {k: v for k, v in rtn.items() if k not in ("tokens", "windows", "ppl_16bit")}
        out["kl_vs_rtn"] = round(int4["kl_mean"] / max(out["rtn"]["kl_mean"], 1e-12), 4)
        out["ppl_vs_rtn"] = round(int4["ppl_int4"] / out["rtn"]["ppl_int4"], 4)
    return out


def mean_over_domains(domains: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Unweighted means over the scored domains: int4 (and RTN) KL, perplexity ratio, top-1, and the KL and
    perplexity ratios to RTN (the mean KL ratio is mean int4 KL / mean RTN KL)."""
    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 5)

    rows = list(domains.values())
    out: dict[str, Any] = {"domains": len(rows)}
    for model in ("int4", "rtn"):
        if all(model in r for r in rows):
            out[model] = {k: mean([r[model][k] for r in rows]) for k in ("kl_mean", "ppl_ratio", "top1_agreement")}
    if "rtn" in out:
        out["kl_vs_rtn"] = round(out["int4"]["kl_mean"] / max(out["rtn"]["kl_mean"], 1e-12), 4)
        out["ppl_vs_rtn"] = mean([r["ppl_vs_rtn"] for r in rows])
    return out


def check_domains(domains: dict[str, dict[str, Any]], gate: Any) -> list[str]:
    """Human-readable reasons the gate fails (empty when every domain is within every bound of ``gate``)."""
    failures = []
    for name, d in domains.items():
        m = d["int4"]
        if m["kl_mean"] > gate.max_mean_kl:
            failures.append(f"{name}: mean KL {m['kl_mean']:.4f} > max_mean_kl {gate.max_mean_kl:g}")
        if gate.max_ppl_ratio is not None and m["ppl_ratio"] > gate.max_ppl_ratio:
            failures.append(f"{name}: perplexity ratio {m['ppl_ratio']:.3f} > max_ppl_ratio {gate.max_ppl_ratio:g}")
        if gate.max_kl_vs_rtn is not None and d.get("kl_vs_rtn", 0) > gate.max_kl_vs_rtn:
            failures.append(f"{name}: mean KL {d['kl_vs_rtn']:.3f} x RTN's > max_kl_vs_rtn {gate.max_kl_vs_rtn:g}")
        if gate.max_ppl_vs_rtn is not None and d.get("ppl_vs_rtn", 0) > gate.max_ppl_vs_rtn:
            failures.append(f"{name}: perplexity {d['ppl_vs_rtn']:.3f} x RTN's > max_ppl_vs_rtn "
                            f"{gate.max_ppl_vs_rtn:g}")
    return failures


def worst_domain(domains: dict[str, dict[str, Any]]) -> str:
    """The domain with the largest int4 mean KL."""
    return max(domains, key=lambda name: domains[name]["int4"]["kl_mean"])


def domains_table(report: dict[str, Any]) -> Table:
    """Rich table: per domain, perplexity of the 16-bit, RTN and int4 models, RTN's and int4's mean KL, their
    ratio and int4's top-1 agreement; then the mean over domains."""
    t = report["thresholds"]
    limits = [f"KL <= {t['max_mean_kl']:g}"]
    limits += [f"ppl ratio <= {t['max_ppl_ratio']:g}"] if t["max_ppl_ratio"] else []
    limits += [f"KL <= {t['max_kl_vs_rtn']:g} x RTN"] if t["max_kl_vs_rtn"] else []
    limits += [f"ppl <= {t['max_ppl_vs_rtn']:g} x RTN"] if t["max_ppl_vs_rtn"] else []
    chat = report["special_token_check"]
    table = Table(title=f"accuracy gate: {'PASS' if report['passed'] else 'FAIL'} ({'; '.join(limits)}, per domain; "
                        f"chat end token kept {chat['ended_int4']}/{chat['ended_16bit']})")
    for column in ("domain", "tokens", "ppl 16", "ppl RTN", "ppl int4", "KL RTN", "KL int4", "KL/RTN", "top-1"):
        table.add_column(column, justify="left" if column == "domain" else "right", no_wrap=True)
    for name, d in report["domains"].items():
        r = d.get("rtn", {})
        table.add_row(name, str(d["tokens"]), _ppl(d["ppl_16bit"]), _ppl(r.get("ppl_int4")),
                      _ppl(d["int4"]["ppl_int4"]), _fmt(r.get("kl_mean"), ".3f"), f"{d['int4']['kl_mean']:.3f}",
                      _fmt(d.get("kl_vs_rtn"), ".2f"), f"{d['int4']['top1_agreement']:.3f}")
    m = report["mean"]
    table.add_row("mean", "", "", "", "", _fmt(m.get("rtn", {}).get("kl_mean"), ".3f"), f"{m['int4']['kl_mean']:.3f}",
                  _fmt(m.get("kl_vs_rtn"), ".2f"), f"{m['int4']['top1_agreement']:.3f}")
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ppl(value: float | None) -> str:
    """A perplexity: two decimals, or 4 significant digits from 100,000 on (a random model's are ~1e12)."""
    return _fmt(value, ".2f" if value is None or value < 1e5 else ".4g")


def worst_positions_text(rows: Sequence[dict[str, Any]]) -> str:
    """Plain-text table of the worst positions (for the AccuracyGateError message)."""
    header = f"{'window':>6} {'pos':>5} {'KL':>8}  {'token':<18} {'top-1 16-bit':<18} {'top-1 int4':<18}"
    lines = [header]
    for r in rows:
        lines.append(f"{r['window']:>6} {r['position']:>5} {r['kl']:>8.3f}  {r['token'][:18]:<18} "
                     f"{r['top1_16bit'][:18]:<18} {r['top1_int4'][:18]:<18}")
    return "\n".join(lines)

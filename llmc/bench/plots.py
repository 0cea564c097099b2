"""PNG plots of a benchmark report (matplotlib, Agg backend: no display needed).

``itl_by_token_index.png`` (mean ITL over the output token index, one line per concurrency level),
``ttft_vs_prompt_length.png`` (one point per request) and ``tgs_vs_concurrency.png``; the baseline, when
present, is drawn next to llmc with dashed lines / cross markers. Every plot carries the run's prefix-caching
line (:func:`~llmc.bench.report.prefix_caching_caption`) under its title and in the PNG's ``Description``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from llmc.bench.report import prefix_caching_caption

PLOT_FILES = ("itl_by_token_index.png", "ttft_vs_prompt_length.png", "tgs_vs_concurrency.png")


def _systems(report: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]], str]]:
    """``(label, levels, line style)`` for llmc and, when present, the baseline."""
    out = [("llmc", report["levels"], "-")]
    if report.get("baseline"):
        out.append((report["baseline"].get("name", "baseline"), report["baseline"]["levels"], "--"))
    return out


def write_plots(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write the three PNGs into ``out_dir`` (created) and return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in PLOT_FILES]
    caption = prefix_caching_caption(report)
    reuse = bool((report.get("prefix_caching") or {}).get("llmc"))
    for path, draw in zip(paths, (_itl_by_index, _ttft_vs_length, _tgs_vs_concurrency)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        draw(ax, report)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        lines = textwrap.wrap(caption, 120)
        fig.text(0.5, 0.01, "\n".join(lines), ha="center", va="bottom", fontsize=7,
                 color="darkred" if reuse else "dimgray")
        fig.tight_layout(rect=(0, 0.035 * len(lines), 1, 1))  # room for the caption
        fig.savefig(path, dpi=100, metadata={"Description": caption})
        plt.close(fig)
    return paths


def _itl_by_index(ax: Any, report: dict[str, Any]) -> None:
    for label, levels, style in _systems(report):
        for lv in levels:
            values = [v * 1000 for v in lv["itl_by_token_index_s"]]
            ax.plot(range(1, len(values) + 1), values, style, label=f"{label} c={lv['concurrency']}")
    ax.set_xlabel("output token index")
    ax.set_ylabel("mean inter-token latency (ms)")
    ax.set_title("ITL over the token index")


def _ttft_vs_length(ax: Any, report: dict[str, Any]) -> None:
    for label, levels, style in _systems(report):
        for lv in levels:
            points = lv["ttft_vs_prompt_tokens"]
            ax.scatter([p[0] for p in points], [p[1] * 1000 for p in points], s=16,
                       marker="x" if style == "--" else "o", label=f"{label} c={lv['concurrency']}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT vs prompt length")


def _tgs_vs_concurrency(ax: Any, report: dict[str, Any]) -> None:
    for label, levels, style in _systems(report):
        ax.plot([lv["concurrency"] for lv in levels], [lv["tgs"] or 0.0 for lv in levels], style, marker="o",
                label=label)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("TGS vs concurrency")

"""Plots: the three PNG files are written and are real PNGs."""

from __future__ import annotations

from llmc.bench.plots import PLOT_FILES, write_plots
from llmc.bench.report import build_report
from llmc.bench.plan import BenchPlan
from tests.bench.test_report import PROMPTS, level

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_write_plots_with_and_without_baseline(tmp_path):
    plan = BenchPlan(warmup=(), levels=((1, PROMPTS), (4, PROMPTS)))
    run = {"mode": "offline", "engine_dir": "x", "device": "cpu"}
    for name, baseline in (("with", [level(1, 3.0), level(4, 2.0)]), ("without", None)):
        report = build_report(run, [level(1, 2.0), level(4, 1.0)], plan, {"temperature": 0.0}, baseline,
                              {"name": "hf"})
        paths = write_plots(report, tmp_path / name)
        assert [p.name for p in paths] == list(PLOT_FILES)
        for p in paths:
            data = p.read_bytes()
            assert data.startswith(PNG_SIGNATURE) and len(data) > 1000

"""``llmc bench`` end to end on the tiny build (JSON report, plots, baseline) and its input errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llmc.bench.commands import bench_cmd, parse_levels
from llmc.bench.plots import PLOT_FILES
from llmc.errors import RequestError


def test_offline_cli_writes_json_and_plots(bench_build_dir, tmp_path):
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    result = CliRunner().invoke(bench_cmd, [str(bench_build_dir), "--isl", "20", "--osl", "5", "--num-prompts", "3",
                                            "--concurrency", "1,2", "--baseline", "hf", "--json", str(out),
                                            "--plots", str(plots), "--device", "cpu", "--isl-dist", "normal"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["mode"] == "offline" and report["device"] == "cpu" and report["warmup_requests"] == 1
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    assert [lv["generated_tokens"] for lv in report["levels"]] == [15, 15]
    assert [lv["generated_tokens"] for lv in report["baseline"]["levels"]] == [15, 15]
    assert report["workload"]["isl"]["dist"] == "normal" and report["sampling"]["ignore_eos"] is True
    assert report["engine"]["prefix_caching"] in (True, False)
    assert [r["concurrency"] for r in report["ratios"]] == [1, 2]
    assert all((plots / name).stat().st_size > 0 for name in PLOT_FILES)
    assert "llmc / baseline" in result.output


def test_offline_cli_repeats_every_level(bench_build_dir, tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench_cmd, [str(bench_build_dir), "--isl", "12", "--osl", "3", "--num-prompts", "2",
                                            "--concurrency", "1,2", "--repeat", "2", "--json", str(out), "--device",
                                            "cpu"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["repeat"] == 2 and [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert len(lv["repetitions"]) == 2 and lv["generated_tokens"] == 2 * 2 * 3
        assert lv["tgs"] in [r["tgs"] for r in lv["repetitions"]]
    assert "measured 2 times" in result.output


@pytest.mark.parametrize("text", ["0", "a,b", "", "2,2"])
def test_bad_concurrency(text):
    with pytest.raises(RequestError):
        parse_levels(text)


def test_url_needs_a_tokenizer():
    with pytest.raises(RequestError, match="--tokenizer"):
        CliRunner().invoke(bench_cmd, ["--url", "http://127.0.0.1:9"], catch_exceptions=False)


def test_baseline_is_offline_only(tmp_path):
    with pytest.raises(RequestError, match="in-process"):
        CliRunner().invoke(bench_cmd, ["--url", "http://127.0.0.1:9", "--baseline", "hf"], catch_exceptions=False)

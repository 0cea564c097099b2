"""``llmc bench`` end to end on the tiny build (JSON report, plots, baseline) and its input errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llmc.bench.commands import bench_cmd, parse_levels, prefix_caching_override
from llmc.bench.plots import PLOT_FILES
from llmc.errors import RequestError

PROMPT = "The same long prompt, sent again and again, so every request after the first finds its prefix cached."


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
    # transformers recomputes every prompt, so llmc's reuse is off by default next to it
    assert report["engine"]["prefix_caching"] is False
    assert report["prefix_caching"]["mode"] == "auto" and report["prefix_caching"]["llmc"] is False
    assert [lv["prefix_cache"]["hit_tokens"] for lv in report["levels"]] == [0, 0]
    assert [lv["prefix_cache"]["queried_tokens"] for lv in report["levels"]] == [
        lv["prompt_tokens"] for lv in report["levels"]]
    assert "prefix caching off (auto: the hf baseline cannot reuse a prefix" in result.output
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


@pytest.mark.parametrize("mode, hits", [("auto", False), ("on", True)])
def test_identical_prompts_hit_the_cache_only_when_reuse_is_asked_for(bench_build_dir, tmp_path, tokenizer, mode,
                                                                      hits):
    from PIL import Image

    prompts = tmp_path / "same.txt"
    prompts.write_text((PROMPT + "\n") * 3)
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    result = CliRunner().invoke(bench_cmd, [str(bench_build_dir), "--prompts", str(prompts), "--osl", "3",
                                            "--concurrency", "1,2", "--baseline", "hf", "--prefix-caching", mode,
                                            "--json", str(out), "--plots", str(plots), "--device", "cpu"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    length = len(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    cached = (length - 1) // 8 * 8 if hits else 0  # full 8-token blocks, never the one of the last token
    # the warm-up request computed the prompt, so every measured request (3 per level) finds it cached
    assert [lv["prefix_cache"]["hit_tokens"] for lv in report["levels"]] == [3 * cached, 3 * cached]
    assert all(lv["prefix_cache"]["hit_tokens"] == 0 for lv in report["baseline"]["levels"])
    assert report["prefix_caching"]["llmc"] is hits and report["engine"]["prefix_caching"] is hits
    flagged = "prefix caching ON (--prefix-caching on)" if hits else "prefix caching off"
    assert flagged in " ".join(result.output.split())
    for name in PLOT_FILES:
        caption = Image.open(plots / name).text["Description"]
        assert caption.startswith(flagged) and ("not like for like" in caption) is hits


def test_prefix_caching_modes():
    assert prefix_caching_override("auto", "hf")[0] is False
    assert prefix_caching_override("auto", None)[0] is None  # the build's setting
    assert prefix_caching_override("on", "hf") == (True, "--prefix-caching on")
    assert prefix_caching_override("off", None) == (False, "--prefix-caching off")
    with pytest.raises(RequestError, match="auto, on, off"):
        prefix_caching_override("maybe", None)


def test_prefix_caching_is_offline_only():
    with pytest.raises(RequestError, match="drop --prefix-caching"):
        CliRunner().invoke(bench_cmd, ["--url", "http://127.0.0.1:9", "--prefix-caching", "off"],
                           catch_exceptions=False)


def test_mixed_step_budget_is_a_bench_option(bench_build_dir, tmp_path):
    # 4 prompts of 40 tokens at concurrency 4: without a budget a step with decodes takes up to max_num_tokens
    # (128) of prefill; with 12, later prompts are cut into chunks that ride along with the decodes.
    def run(extra):
        out = tmp_path / f"r{len(extra)}.json"
        result = CliRunner().invoke(bench_cmd, [str(bench_build_dir), "--isl", "40", "--osl", "6", "--num-prompts",
                                                "4", "--concurrency", "4", "--json", str(out), "--device", "cpu",
                                                "--warmup", "0", *extra], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())

    build_default, budget = run([]), run(["--mixed-step-tokens", "12"])
    assert build_default["engine"]["mixed_step_tokens"] == 0
    assert build_default["engine"]["mixed_step_tokens_from"] == "the build's recipe"
    assert budget["engine"]["mixed_step_tokens"] == 12 and budget["engine"]["mixed_step_tokens_from"] == "--mixed-step-tokens"
    assert budget["engine"]["piece_graph_buckets"] == []  # CPU: no CUDA graphs in pieces
    assert budget["levels"][0]["generated_tokens"] == build_default["levels"][0]["generated_tokens"] == 24
    assert budget["levels"][0]["steps"]["count"] > build_default["levels"][0]["steps"]["count"]


def test_speculative_tokens_are_a_bench_option(bench_build_dir, tmp_path):
    out = tmp_path / "spec.json"
    result = CliRunner().invoke(bench_cmd, [str(bench_build_dir), "--isl", "40", "--osl", "24", "--num-prompts", "2",
                                            "--concurrency", "2", "--json", str(out), "--device", "cpu", "--warmup",
                                            "0", "--temperature", "0", "--speculative-tokens", "3"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    engine = json.loads(out.read_text())["engine"]
    assert engine["speculative_tokens"] == 3 and engine["draft_tokens"] >= engine["accepted_draft_tokens"] > 0
    with pytest.raises(RequestError, match="drop --speculative-tokens"):
        CliRunner().invoke(bench_cmd, ["--url", "http://127.0.0.1:9", "--speculative-tokens", "2"],
                           catch_exceptions=False)


def test_mixed_step_budget_is_offline_only():
    with pytest.raises(RequestError, match="drop --mixed-step-tokens"):
        CliRunner().invoke(bench_cmd, ["--url", "http://127.0.0.1:9", "--mixed-step-tokens", "512"],
                           catch_exceptions=False)


def test_step_log_keeps_every_step(bench_build_dir, tmp_path):
    log, out = tmp_path / "logs" / "steps.jsonl", tmp_path / "r.json"
    result = CliRunner().invoke(bench_cmd, [str(bench_build_dir), "--isl", "40", "--osl", "6", "--num-prompts", "4",
                                            "--concurrency", "4", "--json", str(out), "--device", "cpu", "--warmup",
                                            "0", "--mixed-step-tokens", "12", "--step-log", str(log)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["type"] for r in records} == {"step", "request"}
    assert sum(r["type"] == "request" for r in records) == 4
    steps = [r for r in records if r["type"] == "step"]
    report = json.loads(out.read_text())
    assert len(steps) == report["levels"][0]["steps"]["count"]
    assert sum(s["decode_tokens"] + s["prefill_tokens"] for s in steps) == sum(s["scheduled_tokens"] for s in steps)
    assert sum(s["prefill_tokens"] for s in steps) >= 4 * 40 - 4  # every prompt token was prefilled in a step
    assert all(s["decode_tokens"] + s["prefill_tokens"] <= 12 for s in steps if s["decode_tokens"])
    by_kind = report["levels"][0]["steps"]["by_kind"]
    assert sum(k["count"] for k in by_kind.values()) == sum(1 for s in steps if s["scheduled_tokens"])
    assert by_kind["mixed"]["count"] > 0  # the budget made later prompts ride along with decodes
    assert "engine steps at concurrency 4: decode" in result.output
    assert not list(log.parent.glob(".*partial"))


def test_step_log_never_overwrites(bench_build_dir, tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text("an earlier run\n")
    with pytest.raises(RequestError, match="exists; pass a new file name"):
        CliRunner().invoke(bench_cmd, [str(bench_build_dir), "--device", "cpu", "--step-log", str(log)],
                           catch_exceptions=False)
    assert log.read_text() == "an earlier run\n"
    with pytest.raises(RequestError, match="drop --step-log with --url"):
        CliRunner().invoke(bench_cmd, ["--url", "http://127.0.0.1:9", "--step-log", str(tmp_path / "new.jsonl")],
                           catch_exceptions=False)

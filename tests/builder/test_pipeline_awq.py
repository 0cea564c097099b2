"""`llmc build` end to end with AWQ on a tiny model: quantize -> gate -> engine -> Triton repo -> generate.

The embedded model's full AWQ build takes minutes on 2 cores (README's main job); this covers the same
wiring in seconds. The gate-failure case runs through the CLI: one `error:` line, exit 2, no build folder.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from click.testing import CliRunner

from llmc.builder.pipeline import build
from llmc.cli import cli
from llmc.recipe import load_recipe
from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine


def write_recipe(tmp_path, hf_dir, max_mean_kl=10.0, name="tiny-awq"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""
        name: {name}
        model: {{source: {hf_dir}, dtype: float16}}
        quantization:
          method: awq
          group_size: 32
          calibration:
            n_samples: 4
            seq_len: 64
            sources: [{{dataset: pydoc, weight: 1}}, {{dataset: self, weight: 1}}]
            self_generation: {{max_new_tokens: 8, max_batch_size: 4}}
          gate: {{max_mean_kl: {max_mean_kl}, n_tokens: 256, domains: [pydoc, chat, chinese]}}
        engine: {{max_batch_size: 4, max_input_len: 128, max_seq_len: 256, max_num_tokens: 128}}
        kv_cache: {{tokens_per_block: 8, cpu_budget_mb: 16}}
    """))
    return path


def test_awq_build_writes_w4a16_ir_report_and_runs(tiny_hf_dir, tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, tiny_hf_dir))
    result = build(recipe, tmp_path / "out" / "tiny-awq")
    out = result.build_dir
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ" and config["quantization"]["group_size"] == 32
    report = json.loads((out / "build_report.json").read_text())
    assert report["quantize"]["method"] == "awq" and report["quantize"]["loss_mask"] is True
    q = report["quantize"]
    assert q["calibration"]["excluded_special_positions"] > 0 and q["calibration"]["dataset"] == "pydoc+self"
    assert [(s["dataset"], s["samples"]) for s in q["calibration"]["sources"]] == [("pydoc", 2), ("self", 2)]
    assert q["self_generation"]["tokens"] >= 2 * 64 and q["self_generation"]["device"] == "cpu"
    assert [p["name"] for p in q["passes"]] == ["calibration_data", "load_model", "awq", "gptq", "export"]
    assert q["seconds"]["quantize"] == pytest.approx(q["seconds"]["awq"] + q["seconds"]["gptq"], abs=0.02)
    assert q["device"]["type"] == "cpu" and q["peak_gpu_memory_bytes"] is None and q["gptq"]["dampening"] == 0.01
    gate = report["gate"]
    assert gate["passed"] is True and sorted(gate["domains"]) == ["chat", "chinese", "pydoc"]
    assert gate["mean"]["int4"]["kl_mean"] >= 0 and gate["mean"]["kl_vs_rtn"] > 0
    assert (out / "model_repo" / "tiny-awq" / "config.pbtxt").is_file()
    assert result.manifest.quantization["method"] == "awq"
    engine = Engine.from_dir(out, device="cpu")
    done = engine.generate(["Hello"], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(done[0].token_ids) == 4


def test_gate_failure_fails_the_build_with_a_table_and_leaves_nothing(tiny_hf_dir, tmp_path):
    recipe = write_recipe(tmp_path, tiny_hf_dir, max_mean_kl="0.000001", name="tiny-strict")
    out = tmp_path / "out2" / "tiny-strict"
    result = CliRunner().invoke(cli, ["build", str(recipe), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "accuracy gate" in result.output.lower() and "KL" in result.output
    assert not out.exists() and not any(p.name.startswith(".tiny-strict") for p in out.parent.iterdir())

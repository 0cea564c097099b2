"""`llmc build` and `llmc inspect` through click's CliRunner: output, JSON plan, and exit codes."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from llmc.builder.commands import build_cmd, inspect_cmd
from tests.builder.test_pipeline import write_recipe


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory, tiny_hf_dir):
    root = tmp_path_factory.mktemp("cli")
    recipe = write_recipe(root, tiny_hf_dir)
    out = root / "out" / "tiny"
    result = CliRunner().invoke(build_cmd, [str(recipe), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"output: {out}" in result.stdout.splitlines()  # one line, however long the path (a log is 180 wide)
    assert "compile engine" in result.stdout
    return recipe, out


def test_second_build_is_up_to_date_and_force_rebuilds(built_dir):
    recipe, out = built_dir
    again = CliRunner().invoke(build_cmd, [str(recipe), "-o", str(out)])
    assert again.exit_code == 0 and "up to date" in again.stdout
    forced = CliRunner().invoke(build_cmd, [str(recipe), "-o", str(out), "--force"])
    assert forced.exit_code == 0 and "up to date" not in forced.stdout and "built tiny" in forced.stdout


def test_inspect_json_kv_plan_and_weight_bytes(built_dir, tiny_hf_dir):
    _, out = built_dir
    result = CliRunner().invoke(inspect_cmd, [str(out), "--json", "--kv-gib", "0.5"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    assert info["model"] == {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
                             "vocab": cfg["vocab_size"], "intermediate": 128}
    per_token = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head dim x float32 bytes
    kv = info["kv_cache"]
    assert kv["bytes_per_token"] == per_token and kv["dtype"] == "float32"
    assert kv["tokens_in_budget"] == math.floor(0.5 * 2**30 / per_token)
    assert kv["tokens_in_budget_80pct"] == math.floor(0.8 * 0.5 * 2**30 / per_token)
    assert kv["max_batch_x_max_seq_len"]["bytes"] == per_token * 2 * 128
    numel = 0
    with safe_open(str(out / "checkpoint" / "rank0.safetensors"), "pt") as f:
        for name in f.keys():
            numel += f.get_tensor(name).numel()
    assert info["weights"]["bytes_by_dtype"] == {"F32": numel * 4}
    assert info["eos_token_ids"] == [2] and info["quantization"]["recipe"]["method"] == "none"
    assert info["architecture"] == "LlamaForCausalLM"  # the IR's (a Qwen2 build: Qwen2ForCausalLM)


def test_inspect_human_output(built_dir):
    _, out = built_dir
    result = CliRunner().invoke(inspect_cmd, [str(out)])
    assert result.exit_code == 0, result.output
    for text in ("tiny", "model: LlamaForCausalLM, layers 2", "kv_heads 2", "bytes per token", "512", "eos ids: [2]",
                 "quantization: none"):
        assert text in result.stdout, text
    lines = result.stdout.splitlines()
    assert f"tiny  {out}" in lines  # a long path is not broken across lines where the output is not a terminal
    weights = [line for line in lines if line.startswith("weights: ")]
    assert len(weights) == 1 and "held on a CUDA GPU by the torch engine: " in weights[0], lines
    assert any(line.startswith("timings: ") and "total" in line for line in lines), lines


@pytest.mark.parametrize("setup,match", [("absent", "does not exist"), ("empty", "has no manifest.json"),
                                         ("corrupt", "corrupt")])
def test_inspect_errors_exit_2(tmp_path, setup, match):
    target = tmp_path / "b"
    if setup != "absent":
        target.mkdir()
    if setup == "corrupt":
        (target / "manifest.json").write_text("{")
    result = CliRunner().invoke(inspect_cmd, [str(target)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and match in result.stderr
    assert "Traceback" not in result.output


def test_build_missing_model_path_exits_2_without_a_folder(tmp_path):
    recipe = write_recipe(tmp_path, "absent-model")
    out = tmp_path / "out" / "tiny"
    result = CliRunner().invoke(build_cmd, [str(recipe), "-o", str(out)])
    assert result.exit_code == 2 and "error: " in result.stderr and "absent-model" in result.stderr
    assert not out.exists()


def test_build_bad_recipe_exits_2(tmp_path, tiny_hf_dir):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(f"name: tiny\nmodel:\n  source: {tiny_hf_dir}\n  dtpye: float16\n")
    result = CliRunner().invoke(build_cmd, [str(recipe), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "error: " in result.stderr and "dtpye" in result.stderr
    assert not (tmp_path / "out").exists()


def test_build_output_not_writable_exits_2(tmp_path, tiny_hf_dir):
    (tmp_path / "some_file").write_text("x")
    recipe = write_recipe(tmp_path, tiny_hf_dir)
    result = CliRunner().invoke(build_cmd, [str(recipe), "-o", str(tmp_path / "some_file" / "sub")])
    assert result.exit_code == 2 and "is a file, not a folder" in result.stderr


def test_build_a_file_that_is_not_a_model_exits_2(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("hello")
    result = CliRunner().invoke(build_cmd, [str(write_recipe(tmp_path, fake)), "-o", str(tmp_path / "o" / "t")])
    assert result.exit_code == 2 and "neither a GGUF file" in result.stderr
    assert not (tmp_path / "o" / "t").exists()


def test_build_prints_wide_tables_whole_into_a_log(tmp_path, tiny_hf_dir, monkeypatch):
    # `llmc build ... > build.log`: the gate's 9-column table goes to the build's console, which must not cut
    # cells to 80 columns ("0.8…") when the output is not a terminal.
    from rich.table import Table

    from llmc.builder import pipeline
    from llmc.errors import AccuracyGateError

    def fake_build(recipe, out_dir=None, force=False, console=None):
        table = Table(title="accuracy gate")
        for i in range(9):
            table.add_column(f"column {i}", no_wrap=True)
        table.add_row(*[f"{1234.5678 + i:.4f}" for i in range(9)])
        console.print(table)
        raise AccuracyGateError("the int4 model failed the accuracy gate (test)")

    monkeypatch.setattr(pipeline, "build", fake_build)
    result = CliRunner().invoke(build_cmd, [str(write_recipe(tmp_path, tiny_hf_dir)), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "failed the accuracy gate" in result.output
    assert all(f"{1234.5678 + i:.4f}" in result.output for i in range(9)) and "…" not in result.output


def test_the_cuda_estimate_counts_an_untied_embedding_in_host_memory_unless_told_device(tmp_path, monkeypatch):
    from llmc.builder.commands import _host_part, device_weight_bytes
    from tests import factories
    from tests.engine.torch.helpers import write_ir

    (tmp_path / "tok").mkdir()
    hf = factories.make_tiny_llama(tmp_path / "hf", tmp_path / "tok", tie_word_embeddings=False)
    ir = write_ir(hf, tmp_path / "ir")
    with safe_open(str(ir / "rank0.safetensors"), "pt") as f:
        sizes = {name: f.get_tensor(name).numel() * 4 for name in f.keys()}
    table = sizes["transformer.vocab_embedding.weight"]
    monkeypatch.delenv("LLMC_EMBEDDING", raising=False)
    held = device_weight_bytes(ir, tied=False)
    assert held == {"cuda": sum(sizes.values()) - table, "cuda_host": table}
    assert "input embedding in page-locked host memory" in _host_part(held)
    monkeypatch.setenv("LLMC_EMBEDDING", "device")
    assert device_weight_bytes(ir, tied=False) == {"cuda": sum(sizes.values()), "cuda_host": 0}
    assert _host_part({"cuda": 1, "cuda_host": 0}) == ""

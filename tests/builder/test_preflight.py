"""`llmc validate RECIPE` through click's CliRunner: exit codes, messages, summary, --json."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llmc.builder.preflight import validate_cmd
from llmc.recipe import load_recipe, recipe_to_dict
from tests.recipe.conftest import RECIPES_DIR, write_recipe  # noqa: F401 - a fixture of the recipe tests

SHIPPED = sorted(RECIPES_DIR.glob("*.yaml"))
BERT_CONFIG = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 768,
               "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "max_position_embeddings": 512}


def run(*args: str):
    return CliRunner().invoke(validate_cmd, [str(a) for a in args])


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_recipes_validate(path):
    result = run(path)
    assert result.exit_code == 0, result.output
    assert "the recipe is valid" in result.stdout and load_recipe(path).name in result.stdout


@pytest.mark.parametrize("name", ["llama3-8b-awq.yaml", "llama3-8b-awq-torch.yaml"])
def test_llama3_recipes_validate_without_weights(name):
    result = run(RECIPES_DIR / name)
    assert result.exit_code == 0, result.output
    assert "warning: model source not found at" in result.stderr
    assert "model-dependent checks run at build time" in result.stderr


def test_embedded_model_config_is_checked_and_kv_plan_shown():
    result = run(RECIPES_DIR / "smollm2-135m-awq.yaml")
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr
    assert f"{2 * 30 * 3 * 64 * 2:,} bytes/token" in result.stdout
    assert "awq int4, group 64, gptq rounding" in result.stdout
    nearest = run(RECIPES_DIR / "smollm2-135m-awq-nearest.yaml")
    assert "awq int4, group 64, nearest rounding" in nearest.stdout


def test_group_128_on_the_embedded_model_fails_before_any_work(tmp_path):
    text = (RECIPES_DIR / "smollm2-135m-awq.yaml").read_text().replace("group_size: 64", "group_size: 128")
    path = tmp_path / "g128.yaml"
    path.write_text(text)
    result = run(path)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and "g128.yaml" in result.stderr
    assert "quantization.group_size" in result.stderr and "group_size: 64" in result.stderr
    assert result.stdout == ""


def test_bert_folder_is_an_unsupported_architecture(write_recipe, tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps(BERT_CONFIG))
    result = run(write_recipe({"model.source": "bert"}))
    assert result.exit_code == 2 and "unsupported architecture" in result.stderr


def test_invalid_recipe_exits_2_with_one_error_line(write_recipe):
    path = write_recipe({"engine.max_seq_len": 512, "engine.max_input_len": 1024})
    result = run(path)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert str(path) in lines[0] and "engine.max_seq_len" in lines[0] and "Fix:" in lines[0]


def test_missing_recipe_file_exits_2(tmp_path):
    result = run(tmp_path / "missing.yaml")
    assert result.exit_code == 2 and "recipe file not found" in result.stderr


def test_tensorrt_llm_backend_checks_run(tmp_path):
    text = (RECIPES_DIR / "llama3-8b-awq.yaml").read_text().replace("target_sm: null", "target_sm: 100")
    text = text.replace("source: ../models/Meta-Llama-3-8B-Instruct", "source: ./absent-model")
    path = tmp_path / "blackwell.yaml"
    path.write_text(text)
    result = run(path)
    assert result.exit_code == 2 and "tensorrt_llm.target_sm" in result.stderr


def test_json_prints_the_resolved_recipe():
    path = RECIPES_DIR / "smollm2-135m-awq.yaml"
    result = run("--json", path)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == recipe_to_dict(load_recipe(path))


def test_help():
    result = run("--help")
    assert result.exit_code == 0 and "RECIPE" in result.stdout

"""Recipes the tensorrt_llm backend refuses before any build work, each with the key path and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from llmc.engine.tensorrt_llm.checks import check_recipe
from llmc.errors import RecipeError
from llmc.recipe import load_recipe
from tests.checkpoint.helpers import LLAMA3_8B_HF, SMOLLM2_HF
from tests.engine.tensorrt_llm.helpers import LLAMA3_RECIPE, write_recipe

SMOLLM2 = {**SMOLLM2_HF, "architectures": ["LlamaForCausalLM"]}


def no_gpu() -> None:
    return None


def awq_recipe(tmp_path, group_size: int = 64, target_sm: str = "null"):
    return write_recipe(tmp_path, **{
        "  dtype: bfloat16\n": f"  dtype: bfloat16\nquantization: {{method: awq, group_size: {group_size}}}\n",
        "  multiple_profiles: false\n": f"  multiple_profiles: false\n  target_sm: {target_sm}\n",
    })


def test_llama3_recipe_passes():
    check_recipe(load_recipe(LLAMA3_RECIPE), LLAMA3_8B_HF, local_sm=no_gpu)


def test_smollm2_awq_g64_passes(tmp_path):
    check_recipe(awq_recipe(tmp_path, 64), SMOLLM2, local_sm=no_gpu)


def test_unsupported_architecture(tmp_path):
    with pytest.raises(RecipeError) as exc:
        check_recipe(write_recipe(tmp_path), {**SMOLLM2, "architectures": ["GPT2LMHeadModel"]}, local_sm=no_gpu)
    assert exc.value.key_path == "model.source"
    assert "['GPT2LMHeadModel'] is not supported by llmc's tensorrt_llm backend" in str(exc.value)
    assert "Qwen2ForCausalLM" in str(exc.value) and "Qwen3ForCausalLM" not in str(exc.value)
    assert "backend: torch" in exc.value.fix


def test_qwen2_passes_and_qwen3_is_refused_with_the_reason(tmp_path):
    qwen2 = {**SMOLLM2, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    check_recipe(awq_recipe(tmp_path, 64), qwen2, local_sm=no_gpu)
    with pytest.raises(RecipeError) as exc:
        check_recipe(awq_recipe(tmp_path, 64), {**qwen2, "architectures": ["Qwen3ForCausalLM"]}, local_sm=no_gpu)
    assert exc.value.key_path == "model.source" and "q / k norms" in exc.value.problem
    assert "backend: torch" in exc.value.fix


def test_tp_size_not_dividing_heads(tmp_path):
    recipe = write_recipe(tmp_path, **{"tp_size: 1": "tp_size: 2"})
    with pytest.raises(RecipeError) as exc:
        check_recipe(recipe, SMOLLM2, local_sm=no_gpu)
    assert exc.value.key_path == "engine.tp_size"
    assert "9 attention heads / 3 kv heads" in exc.value.problem
    assert exc.value.fix == "set engine.tp_size to one of [1, 3, 9]"


def test_group_size_32_is_refused_with_the_reason(tmp_path):
    with pytest.raises(RecipeError) as exc:
        check_recipe(awq_recipe(tmp_path, 32), SMOLLM2, local_sm=no_gpu)
    assert exc.value.key_path == "quantization.group_size"
    assert "max(64, group_size)" in exc.value.problem and "64 or 128" in exc.value.problem


def test_group_size_128_refused_when_hidden_is_not_a_multiple(tmp_path):
    """SmolLM2's hidden size 576 is not a multiple of max(64, 128) = 128 (reference line 60-61)."""
    with pytest.raises(RecipeError, match="multiples of max\\(64, group_size\\) \\* tp_size = 128.*hidden_size 576"):
        check_recipe(awq_recipe(tmp_path, 128), SMOLLM2, local_sm=no_gpu)


def test_max_seq_len_below_max_input_len(tmp_path):
    recipe = write_recipe(tmp_path)
    bad = dataclasses.replace(recipe, engine=dataclasses.replace(recipe.engine, max_seq_len=256))
    with pytest.raises(RecipeError) as exc:
        check_recipe(bad, SMOLLM2, local_sm=no_gpu)
    assert exc.value.key_path == "engine.max_seq_len"
    assert "max_seq_len 256 is below max_input_len 512" in exc.value.problem


def test_float32_is_refused(tmp_path):
    recipe = write_recipe(tmp_path)
    bad = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, dtype="float32"))
    with pytest.raises(RecipeError) as exc:
        check_recipe(bad, None, local_sm=no_gpu)
    assert exc.value.key_path == "model.dtype" and "backend: torch" in exc.value.fix


def test_int4_on_sm100_target_is_refused(tmp_path):
    with pytest.raises(RecipeError) as exc:
        check_recipe(awq_recipe(tmp_path, target_sm="100"), SMOLLM2, local_sm=no_gpu)
    assert exc.value.key_path == "tensorrt_llm.target_sm"
    assert "refused by TensorRT-LLM 1.0 - 1.2 on SM100-SM119" in exc.value.problem
    assert "SM100" in exc.value.problem and "SM80/SM89/SM90" in exc.value.problem


@pytest.mark.parametrize("sm", [119, 100])
def test_int4_on_local_blackwell_gpu_is_refused(tmp_path, sm):
    with pytest.raises(RecipeError, match=f"the local GPU is SM{sm}"):
        check_recipe(awq_recipe(tmp_path), SMOLLM2, local_sm=lambda: sm)


@pytest.mark.parametrize("sm", [80, 89, 90, 120])
def test_int4_outside_sm100_119_passes(tmp_path, sm):
    check_recipe(awq_recipe(tmp_path), SMOLLM2, local_sm=lambda: sm)


def test_16bit_on_sm100_passes(tmp_path):
    check_recipe(write_recipe(tmp_path), SMOLLM2, local_sm=lambda: 100)


def test_model_checks_skipped_without_hf_config(tmp_path):
    check_recipe(write_recipe(tmp_path, **{"tp_size: 1": "tp_size: 2"}), None, local_sm=no_gpu)

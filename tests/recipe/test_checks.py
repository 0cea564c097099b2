"""Model-dependent recipe checks against HF-style configs (llmc/recipe/checks.py)."""

from __future__ import annotations

import pytest

from llmc.errors import RecipeError
from llmc.recipe import recipe_from_dict
from llmc.recipe.checks import check_recipe_against_model, kv_cache_bytes_per_token

# Shapes from the models' published configs (HF field names).
SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=8192, hidden_act="silu")
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=8192, hidden_act="silu", rope_scaling=None)
BERT = dict(architectures=["BertForMaskedLM"], model_type="bert", hidden_size=768, intermediate_size=3072,
            num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=512, hidden_act="gelu")


def recipe(**sections):
    """A recipe from nested keyword sections, e.g. ``recipe(quantization={"method": "awq"})``."""
    return recipe_from_dict({"name": "t", "model": {"source": "/nonexistent/model"}, **sections}, file="t.yaml")


def awq(group_size, **engine):
    return recipe(quantization={"method": "awq", "group_size": group_size}, engine=engine)


def check_error(r, cfg) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        check_recipe_against_model(r, cfg)
    assert "t.yaml" in str(info.value) and "Fix:" in str(info.value)
    return info.value


def test_group_128_rejected_on_smollm2_and_64_suggested():
    err = check_error(awq(128), SMOLLM2)
    assert err.key_path == "quantization.group_size"
    assert "576" in err.problem and "group_size: 64" in err.fix


@pytest.mark.parametrize("group_size", [32, 64])
def test_groups_that_divide_smollm2_are_accepted(group_size):
    check_recipe_against_model(awq(group_size), SMOLLM2)


def test_group_size_is_irrelevant_without_quantization():
    check_recipe_against_model(recipe(quantization={"group_size": 128}), SMOLLM2)


def test_group_size_checked_per_rank_for_row_parallel_layers():
    cfg = dict(SMOLLM2, hidden_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
               intermediate_size=2048)
    check_recipe_against_model(awq(128, tp_size=4), cfg)
    err = check_error(awq(128, tp_size=8), cfg)  # dense holds 512 / 8 = 64 input features per rank
    assert "dense" in err.problem and "64" in err.fix


def test_no_supported_group_size_fits():
    err = check_error(awq(32), dict(SMOLLM2, hidden_size=560, head_dim=56, num_attention_heads=10,
                                    num_key_value_heads=10))
    assert "quantization.method: none" in err.fix


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_llama3_8b_awq_g128_fits_every_usual_tp(tp_size):
    check_recipe_against_model(awq(128, tp_size=tp_size, max_seq_len=4096), LLAMA3_8B)


@pytest.mark.parametrize("tp_size, problem", [(3, "num_attention_heads 32"), (6, "num_attention_heads 32")])
def test_tp_must_divide_heads(tp_size, problem):
    err = check_error(recipe(engine={"tp_size": tp_size}), LLAMA3_8B)
    assert err.key_path == "engine.tp_size" and problem in err.problem


def test_kv_heads_may_be_split_or_duplicated():
    check_recipe_against_model(recipe(engine={"tp_size": 3}), SMOLLM2)  # 3 kv heads, one per rank
    check_recipe_against_model(recipe(engine={"tp_size": 16}), dict(LLAMA3_8B, intermediate_size=14336))
    cfg = dict(LLAMA3_8B, num_attention_heads=24, num_key_value_heads=8, hidden_size=3072, head_dim=128)
    err = check_error(recipe(engine={"tp_size": 12}), cfg)  # 24 % 12 == 0 but 8 and 12: neither divides
    assert "num_key_value_heads 8" in err.problem


def test_tp_must_divide_intermediate_size():
    err = check_error(recipe(engine={"tp_size": 9}), SMOLLM2)  # 9 heads ok, 1536 % 9 != 0
    assert "intermediate_size 1536" in err.problem


def test_bert_is_an_unsupported_architecture():
    err = check_error(recipe(), BERT)
    assert err.key_path == "model.source" and "unsupported architecture BertForMaskedLM" in str(err)


def test_config_without_architectures_uses_model_type():
    # transformers-5 GGUF conversions write architectures: null.
    check_recipe_against_model(recipe(), dict(SMOLLM2, architectures=None))
    err = check_error(recipe(), dict(BERT, architectures=None))
    assert "model_type 'bert'" in err.problem


def test_mistral_layout_accepted_without_sliding_window():
    mistral = dict(LLAMA3_8B, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    check_recipe_against_model(recipe(), mistral)
    err = check_error(recipe(engine={"max_seq_len": 8192}), dict(mistral, sliding_window=4096))
    assert "sliding-window" in err.problem


QWEN25_7B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                 hidden_act="silu", sliding_window=131072, use_sliding_window=False, max_window_layers=28)


def test_qwen2_window_is_ignored_unless_the_config_uses_it():
    """Released Qwen2 configs name a window with ``use_sliding_window: false`` (transformers and TensorRT-LLM then
    attend over everything): accepted; a config that turns the window on is refused below the lengths it needs."""
    check_recipe_against_model(recipe(engine={"max_seq_len": 16384}), dict(QWEN25_7B, sliding_window=4096))
    err = check_error(recipe(engine={"max_seq_len": 16384}),
                      dict(QWEN25_7B, sliding_window=4096, use_sliding_window=True))
    assert "sliding-window" in err.problem and "4096" in err.fix


def test_shipped_qwen_recipe_fits_qwen25_7b_instruct():
    from llmc.recipe import load_recipe
    from tests.recipe.conftest import RECIPES_DIR

    shipped = load_recipe(RECIPES_DIR / "qwen2.5-7b-awq-torch.yaml", check_inputs=False)
    check_recipe_against_model(shipped, dict(QWEN25_7B, head_dim=128, rope_theta=1000000.0))
    assert shipped.model.eos_token_ids == (151645, 151643)


def test_shipped_qwen3_recipe_fits_qwen3_8b():
    from llmc.recipe import load_recipe
    from tests.recipe.conftest import RECIPES_DIR

    qwen3_8b = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    max_position_embeddings=40960, hidden_act="silu", attention_bias=False, sliding_window=None,
                    use_sliding_window=False)
    shipped = load_recipe(RECIPES_DIR / "qwen3-8b-awq-torch.yaml", check_inputs=False)
    check_recipe_against_model(shipped, qwen3_8b)
    assert shipped.backend == "torch" and shipped.model.eos_token_ids == (151645, 151643)


def test_qwen3_with_attention_biases_is_refused():
    qwen3 = dict(QWEN25_7B, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128)
    check_recipe_against_model(recipe(), qwen3)
    err = check_error(recipe(), dict(qwen3, attention_bias=True))
    assert err.key_path == "model.source" and "attention_bias" in err.problem


def test_max_seq_len_within_position_embeddings():
    err = check_error(recipe(engine={"max_seq_len": 16384}), LLAMA3_8B)
    assert err.key_path == "engine.max_seq_len" and "8192" in err.fix


@pytest.mark.parametrize("scaling", [
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}},
])
def test_rope_scaling_lifts_the_position_limit(scaling):
    check_recipe_against_model(recipe(engine={"max_seq_len": 16384}), dict(LLAMA3_8B, **scaling))


def test_default_rope_parameters_are_not_scaling():
    cfg = dict(LLAMA3_8B, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    check_error(recipe(engine={"max_seq_len": 16384}), cfg)


def test_calibration_length_within_position_embeddings():
    r = recipe(quantization={"method": "awq", "group_size": 64, "calibration": {"seq_len": 1024}},
               engine={"max_input_len": 256, "max_seq_len": 512})
    assert check_error(r, dict(SMOLLM2, max_position_embeddings=512)).key_path == "quantization.calibration.seq_len"


def test_kv_cache_bytes_per_token():
    # 2 (K and V) x layers x kv_heads x head_dim x bytes
    assert kv_cache_bytes_per_token(recipe(), SMOLLM2) == 2 * 30 * 3 * 64 * 2
    assert kv_cache_bytes_per_token(recipe(model={"source": "m", "dtype": "float32"}), SMOLLM2) == 2 * 30 * 3 * 64 * 4
    fp8 = recipe(backend="tensorrt_llm", kv_cache={"dtype": "fp8"})
    assert kv_cache_bytes_per_token(fp8, LLAMA3_8B) == 2 * 32 * 8 * 128 * 1
    assert kv_cache_bytes_per_token(recipe(), LLAMA3_8B) == 128 * 1024  # 128 KiB per token in fp16

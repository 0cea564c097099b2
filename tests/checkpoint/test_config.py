"""IR config.json: exact field names and values from the TensorRT-LLM reference."""

from __future__ import annotations

import pytest

from llmc.checkpoint.config import ModelShape, trtllm_config_from_hf, with_tp_size
from llmc.errors import CheckpointError, SourceError
from llmc.recipe.checks import SUPPORTED_ARCHITECTURES, is_supported_architecture
from tests.checkpoint.helpers import LLAMA3_8B_HF, LLAMA3_ROPE, QWEN3_8B_HF, QWEN25_7B_HF, SMOLLM2_HF, tiny_hf

# Field names exactly as shared/reference/tensorrt-llm.md lists them.
REFERENCE_KEYS = {
    "architecture", "dtype", "logits_dtype", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_size", "intermediate_size", "hidden_act",
    "norm_epsilon", "position_embedding_type", "rotary_base", "rotary_scaling", "max_position_embeddings",
    "tie_word_embeddings", "mlp_bias", "attn_bias", "mapping", "quantization",
}  # fmt: skip


def test_smollm2_config_fields_and_values():
    cfg = trtllm_config_from_hf(SMOLLM2_HF, "float16")
    assert set(cfg) == REFERENCE_KEYS
    assert cfg["architecture"] == "LlamaForCausalLM"
    assert (cfg["dtype"], cfg["logits_dtype"]) == ("float16", "float32")
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (49152, 576, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]) == (9, 3, 64)
    assert cfg["intermediate_size"] == 1536 and cfg["hidden_act"] == "silu"
    assert cfg["norm_epsilon"] == 1e-5 and cfg["position_embedding_type"] == "rope_gpt_neox"
    assert cfg["rotary_base"] == 100000.0 and cfg["rotary_scaling"] is None
    assert cfg["max_position_embeddings"] == 8192 and cfg["tie_word_embeddings"] is True
    assert cfg["mlp_bias"] is False and cfg["attn_bias"] is False
    assert cfg["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert cfg["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None}


def test_llama3_rope_scaling_transformers4_layout():
    cfg = trtllm_config_from_hf(LLAMA3_8B_HF, "bfloat16", tp_size=8)
    assert cfg["rotary_base"] == 500000.0
    assert cfg["rotary_scaling"] == {**LLAMA3_ROPE, "type": "llama3"}
    assert cfg["head_size"] == 128 and cfg["tie_word_embeddings"] is False
    assert cfg["mapping"] == {"world_size": 8, "tp_size": 8, "pp_size": 1}


def test_llama3_rope_scaling_transformers5_layout():
    hf = {k: v for k, v in LLAMA3_8B_HF.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    cfg = trtllm_config_from_hf(hf, "float16")
    assert cfg["rotary_base"] == 500000.0
    assert cfg["rotary_scaling"] == {**LLAMA3_ROPE, "type": "llama3"}


def test_w4a16_quantization_block_is_exact():
    cfg = trtllm_config_from_hf(LLAMA3_8B_HF, "float16", 2, {"quant_algo": "W4A16_AWQ", "group_size": 128})
    assert cfg["quantization"] == {
        "quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": 128,
        "has_zero_point": False, "pre_quant_scale": True, "exclude_modules": ["lm_head"],
    }  # fmt: skip


def test_fp8_kv_cache_block():
    cfg = trtllm_config_from_hf(SMOLLM2_HF, "float16", 1, {"quant_algo": None, "kv_cache_quant_algo": "FP8"})
    assert cfg["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": "FP8"}


def test_model_shape_per_rank_sizes():
    shape = ModelShape.from_config(trtllm_config_from_hf(tiny_hf(num_attention_heads=32, num_key_value_heads=8,
                                                                 hidden_size=512, head_dim=16), "float16", 16))
    assert (shape.heads_per_rank, shape.kv_heads_per_rank) == (2, 1)  # kv duplicated x2
    assert shape.qkv_out_per_rank == (2 + 2) * 16
    assert with_tp_size(trtllm_config_from_hf(tiny_hf(), "float16"), 2)["mapping"]["tp_size"] == 2


@pytest.mark.parametrize(
    "hf, dtype, tp, quant, error, words",
    [
        ({"model_type": "bert", "architectures": ["BertModel"]}, "float16", 1, None, SourceError,
         "unsupported architecture"),
        (tiny_hf(), "int8", 1, None, CheckpointError, "dtype"),
        (tiny_hf(), "float16", 3, None, CheckpointError, "must divide num_attention_heads"),
        (tiny_hf(num_attention_heads=6, head_dim=16, num_key_value_heads=3), "float16", 2, None, CheckpointError,
         "must divide one another"),
        (tiny_hf(), "float16", 1, {"quant_algo": "W8A8"}, CheckpointError, "unsupported quant_algo"),
        (tiny_hf(), "float16", 1, {"quant_algo": "W4A16_AWQ"}, CheckpointError, "group_size"),
        (tiny_hf(), "float16", 1, {"quant_algo": "W4A16_AWQ", "group_size": 128}, CheckpointError, "does not divide"),
        ({k: v for k, v in tiny_hf().items() if k != "vocab_size"}, "float16", 1, None, SourceError, "vocab_size"),
    ],
)
def test_bad_inputs_raise_typed_errors(hf, dtype, tp, quant, error, words):
    with pytest.raises(error, match=words):
        trtllm_config_from_hf(hf, dtype, tp, quant)


def test_the_converter_takes_every_architecture_the_recipe_checks_accept():
    """One list (``llmc.recipe.checks.SUPPORTED_ARCHITECTURES``): a model that passes the recipe checks converts
    too; Llama layouts (Mistral's too) as the IR's LlamaForCausalLM, Qwen models as their own architecture."""
    written = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
    for arch, model_type in SUPPORTED_ARCHITECTURES.items():
        config = trtllm_config_from_hf(tiny_hf(model_type=model_type, architectures=[arch]), "float16")
        assert config["architecture"] == written[model_type]
    for config in (tiny_hf(model_type="llama", architectures=["GPT2LMHeadModel"]), tiny_hf(model_type="gemma")):
        assert not is_supported_architecture(config)
        with pytest.raises(SourceError, match="unsupported architecture"):
            trtllm_config_from_hf(config, "float16")


def test_model_shape_is_the_one_parser_with_tensorrt_llms_defaults():
    config = trtllm_config_from_hf(tiny_hf(rms_norm_eps=1e-5, rope_theta=50000.0), "float16")
    shape = ModelShape.from_config(config)
    assert (shape.norm_epsilon, shape.rotary_base, shape.rotary_scaling) == (1e-5, 50000.0, None)
    assert shape.max_position_embeddings == 256
    optional = ("num_key_value_heads", "head_size", "norm_epsilon", "rotary_base", "rotary_scaling", "mapping")
    bare = ModelShape.from_config({k: v for k, v in config.items() if k not in optional})
    assert (bare.num_kv_heads, bare.head_size, bare.tp_size) == (shape.num_heads, 64 // 4, 1)
    assert (bare.norm_epsilon, bare.rotary_base, bare.rotary_scaling) == (1e-5, 10000.0, None)


def test_model_shape_refuses_kv_heads_that_do_not_divide_the_heads():
    config = trtllm_config_from_hf(tiny_hf(), "float16")
    with pytest.raises(CheckpointError, match="not a multiple of num_key_value_heads 3"):
        ModelShape.from_config({**config, "num_key_value_heads": 3})
    with pytest.raises(CheckpointError, match="max_position_embeddings.*Fix: re-export"):
        ModelShape.from_config({k: v for k, v in config.items() if k != "max_position_embeddings"})


def test_qwen2_config_is_tensorrt_llms_qwen_checkpoint():
    """As TensorRT-LLM's QWenConfig.from_hugging_face writes it: the HF architecture, qwen_type, seq_length (HF's,
    else 8192), attn_bias true (q, k, v biases; the output projection has none: dense_bias=False upstream)."""
    cfg = trtllm_config_from_hf(QWEN25_7B_HF, "bfloat16", tp_size=2)
    assert set(cfg) == REFERENCE_KEYS | {"qwen_type", "seq_length"}
    assert (cfg["architecture"], cfg["qwen_type"], cfg["seq_length"]) == ("Qwen2ForCausalLM", "qwen2", 8192)
    assert cfg["attn_bias"] is True and cfg["mlp_bias"] is False
    assert (cfg["head_size"], cfg["rotary_base"], cfg["norm_epsilon"]) == (128, 1000000.0, 1e-6)
    shape = ModelShape.from_config(cfg)
    assert [shape.has_bias(m) for m in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj")] == [
        True, False, False, False]
    assert not shape.qk_norm


def test_qwen3_config_has_head_norms_and_no_biases():
    cfg = trtllm_config_from_hf(QWEN3_8B_HF, "bfloat16")
    assert (cfg["architecture"], cfg["qwen_type"], cfg["attn_bias"]) == ("Qwen3ForCausalLM", "qwen3", False)
    shape = ModelShape.from_config(cfg)
    assert shape.qk_norm and not shape.has_bias("attention.qkv") and shape.head_size == 128
    assert shape.attn_in == 4096 and shape.qkv_out == (32 + 16) * 128


def test_llama_attention_bias_is_on_qkv_and_dense():
    shape = ModelShape.from_config(trtllm_config_from_hf(tiny_hf(attention_bias=True), "float32"))
    assert shape.has_bias("attention.qkv") and shape.has_bias("attention.dense") and not shape.has_bias("mlp.fc")


@pytest.mark.parametrize("change", [{"qwen_type": None}, {"qwen_type": "qwen3"}, {"architecture": "LlamaForCausalLM"},
                                    {"qwen_type": "qwen9"}])
def test_qwen_architecture_and_qwen_type_must_agree(change):
    cfg = {**trtllm_config_from_hf(QWEN25_7B_HF, "bfloat16"), **change}
    with pytest.raises(CheckpointError, match="qwen_type|architecture"):
        ModelShape.from_config(cfg)

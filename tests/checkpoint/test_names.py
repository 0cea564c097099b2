"""The tensor-name map: HF <-> TensorRT-LLM names, parallelism and quantizable modules."""

from __future__ import annotations

from llmc.checkpoint import names


def test_linear_mapping_and_parallelism():
    table = {s.trt: (s.hf, s.parallel) for s in names.LINEARS}
    assert table == {
        "attention.qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "column"),
        "attention.dense": (("self_attn.o_proj",), "row"),
        "mlp.fc": (("mlp.gate_proj",), "column"),
        "mlp.gate": (("mlp.up_proj",), "column"),
        "mlp.proj": (("mlp.down_proj",), "row"),
    }
    assert set(names.QUANTIZABLE) == {"attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"}


def test_name_templates_and_parsing():
    assert names.trt_layer(3, "mlp.fc") == "transformer.layers.3.mlp.fc.weight"
    assert names.hf_layer(3, "mlp.up_proj", "bias") == "model.layers.3.mlp.up_proj.bias"
    assert names.parse_trt_layer_name("transformer.layers.12.attention.qkv.weights_scaling_factor") == (
        12, "attention.qkv", "weights_scaling_factor")  # fmt: skip
    assert names.parse_trt_layer_name(names.LM_HEAD) is None
    assert names.linear_of("transformer.layers.0.mlp.proj.prequant_scaling_factor") is names.PROJ
    assert names.linear_of("transformer.layers.0.input_layernorm.weight") is None
    assert names.linear_of("transformer.layers.0.attention.kv_cache_scaling_factor") is None
    assert names.linear_of(names.LM_HEAD) is None and names.linear_of(names.VOCAB_EMBEDDING) is None
    assert names.HF_IGNORED.match("model.layers.0.self_attn.rotary_emb.inv_freq")

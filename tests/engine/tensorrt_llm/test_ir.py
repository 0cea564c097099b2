"""AWQ IR conformance: what llmc.checkpoint writes is what TensorRT-LLM's builder reads
(reference tensorrt-llm.md lines 29-31 and 52-62). Shapes below are computed by hand for the tiny model:
H 64, nh 4, nkv 2, hd 16, I 128, V 50, tp 1, g 64."""

from __future__ import annotations

import json

import pytest
import torch

from llmc.checkpoint.convert import pad_for_groupwise
from llmc.checkpoint.int4 import pack_int4
from llmc.checkpoint.safetensors_header import read_safetensors_header
from llmc.engine.tensorrt_llm.ir import check_groupwise_features, check_ir
from llmc.errors import CheckpointError
from tests.engine.tensorrt_llm.helpers import TINY_TRT_YAML, write_recipe, write_tiny_ir

EXPECTED_LAYER = {  # name suffix: (shape, safetensors dtype)
    "input_layernorm.weight": ([64], "F16"),
    "post_layernorm.weight": ([64], "F16"),
    "attention.qkv.weight": ([64, 64], "I8"),  # [(4 + 2*2)*16 / 2, 64]
    "attention.qkv.weights_scaling_factor": ([128, 1], "F16"),
    "attention.qkv.prequant_scaling_factor": ([64], "F16"),
    "attention.dense.weight": ([32, 64], "I8"),
    "attention.dense.weights_scaling_factor": ([64, 1], "F16"),
    "attention.dense.prequant_scaling_factor": ([64], "F16"),
    "mlp.fc.weight": ([64, 64], "I8"),
    "mlp.fc.weights_scaling_factor": ([128, 1], "F16"),
    "mlp.fc.prequant_scaling_factor": ([64], "F16"),
    "mlp.gate.weight": ([64, 64], "I8"),
    "mlp.gate.weights_scaling_factor": ([128, 1], "F16"),
    "mlp.gate.prequant_scaling_factor": ([64], "F16"),
    "mlp.proj.weight": ([32, 128], "I8"),
    "mlp.proj.weights_scaling_factor": ([64, 2], "F16"),
    "mlp.proj.prequant_scaling_factor": ([128], "F16"),
}


@pytest.fixture(scope="module")
def awq_ir(tmp_path_factory):
    out = tmp_path_factory.mktemp("awq_ir")
    write_tiny_ir(out, group_size=64)
    return out


def test_tensor_names_shapes_and_dtypes(awq_ir):
    header = {k: v for k, v in read_safetensors_header(awq_ir / "rank0.safetensors").items() if k != "__metadata__"}
    expected = {"transformer.vocab_embedding.weight": ([50, 64], "F16"), "transformer.ln_f.weight": ([64], "F16"),
                "lm_head.weight": ([50, 64], "F16")}  # lm_head stays 16-bit: exclude_modules
    for layer in (0, 1):
        expected |= {f"transformer.layers.{layer}.{k}": v for k, v in EXPECTED_LAYER.items()}
    assert {k: (v["shape"], v["dtype"]) for k, v in header.items()} == expected


def test_quantization_block(awq_ir):
    config = json.loads((awq_ir / "config.json").read_text())
    assert config["quantization"] == {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": 64,
                                      "has_zero_point": False, "pre_quant_scale": True, "exclude_modules": ["lm_head"]}
    assert config["architecture"] == "LlamaForCausalLM" and config["mapping"] == {
        "world_size": 1, "tp_size": 1, "pp_size": 1}


def test_nibble_order_row_2j_low_row_2j1_high():
    q = torch.tensor([[1, -8], [-2, 7]], dtype=torch.int8)  # [O=2, K=2]
    # byte [0, 0]: low nibble 1, high nibble -2 = 0xE -> 0xE1 = 225 = -31 as int8
    # byte [0, 1]: low nibble -8 = 0x8, high nibble 7 -> 0x78 = 120
    assert pack_int4(q).tolist() == [[-31, 120]]


def test_backend_accepts_the_written_ir(awq_ir, tmp_path):
    config = json.loads((awq_ir / "config.json").read_text())
    names = check_ir(write_recipe(tmp_path, TINY_TRT_YAML), awq_ir, config)
    assert len(names) == 1 and "transformer.layers.1.mlp.proj.prequant_scaling_factor" in names[0]


def test_groupwise_padding_multiple_of_max_64_g_times_tp(awq_ir):
    config = json.loads((awq_ir / "config.json").read_text())
    check_groupwise_features(config)
    # g = 32 divides intermediate 96, but the kernels need multiples of max(64, 32) * 1 = 64
    g32 = {**config, "intermediate_size": 96, "quantization": {**config["quantization"], "group_size": 32}}
    with pytest.raises(CheckpointError, match="\\[out 96, in 64\\].*max\\(64, group_size 32\\) \\* tp 1 = 64"):
        check_groupwise_features(g32)
    # the exporter pads intermediate_size 96 up to 128 = max(64, 32) * 1, which the backend then accepts
    weights = {"transformer.layers.0.mlp.fc.weight": torch.zeros(48, 64, dtype=torch.int8)}
    _, padded_config, record = pad_for_groupwise(weights, g32, 1, 32)
    assert record["intermediate_size"] == {"original": 96, "padded": 128}
    check_groupwise_features(padded_config)

"""Recipe -> BuildConfig/PluginConfig dicts and the trtllm-build command line.

Expected values are written out by hand from the recipes and the reference (tensorrt-llm.md lines 73-80):
field names exactly as documented, "auto" plugin dtype = the model dtype, use_fused_mlp off for W4A16_AWQ.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from llmc.engine.tensorrt_llm.config import (
    build_config_dict,
    build_script,
    kv_cache_quantization,
    require_kv_cache_scales,
    trtllm_build_command,
    trtllm_build_file_command,
)
from llmc.errors import CheckpointError
from llmc.recipe import load_recipe
from tests.engine.tensorrt_llm.helpers import LLAMA3_RECIPE, llama3_awq_ir_config, smollm2_ir_config, write_recipe

DOCUMENTED_BUILD_KEYS = {"max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width",
                         "kv_cache_type", "plugin_config"}
DOCUMENTED_PLUGIN_KEYS = {"gpt_attention_plugin", "gemm_plugin", "context_fmha", "use_paged_context_fmha",
                          "remove_input_padding", "tokens_per_block", "use_fused_mlp", "multiple_profiles"}


def test_llama3_8b_awq_build_config():
    d = build_config_dict(load_recipe(LLAMA3_RECIPE), llama3_awq_ir_config())
    assert set(d) == DOCUMENTED_BUILD_KEYS and set(d["plugin_config"]) == DOCUMENTED_PLUGIN_KEYS
    assert d == {
        "max_batch_size": 64, "max_input_len": 2048, "max_seq_len": 4096, "max_num_tokens": 8192,
        "max_beam_width": 1, "kv_cache_type": "paged",
        "plugin_config": {
            "gpt_attention_plugin": "float16", "gemm_plugin": "float16", "context_fmha": True,
            "use_paged_context_fmha": True, "remove_input_padding": True, "tokens_per_block": 32,
            "use_fused_mlp": False,  # the recipe says true; trtllm-build forces it off for AWQ (line 78)
            "multiple_profiles": True,
        },
    }
    json.dumps(d)  # build_config.json must be plain JSON


def test_smollm2_16bit_build_config(tmp_path):
    d = build_config_dict(write_recipe(tmp_path), smollm2_ir_config("bfloat16"))
    assert d == {
        "max_batch_size": 8, "max_input_len": 512, "max_seq_len": 1024, "max_num_tokens": 1024,
        "max_beam_width": 1, "kv_cache_type": "paged",
        "plugin_config": {
            "gpt_attention_plugin": "bfloat16", "gemm_plugin": None, "context_fmha": True,
            "use_paged_context_fmha": False, "remove_input_padding": True, "tokens_per_block": 64,
            "use_fused_mlp": True, "multiple_profiles": False,
        },
    }


def test_continuous_kv_cache_when_not_paged(tmp_path):
    recipe = write_recipe(tmp_path, **{"paged: true": "paged: false",
                                       "enable_kv_cache_reuse: true": "enable_kv_cache_reuse: false"})
    assert build_config_dict(recipe, smollm2_ir_config())["kv_cache_type"] == "continuous"


def test_llama3_trtllm_build_command():
    d = build_config_dict(load_recipe(LLAMA3_RECIPE), llama3_awq_ir_config())
    assert trtllm_build_command("ckpt", "eng", d) == [
        "trtllm-build", "--checkpoint_dir", "ckpt", "--output_dir", "eng",
        "--max_batch_size", "64", "--max_input_len", "2048", "--max_seq_len", "4096",
        "--max_num_tokens", "8192", "--max_beam_width", "1", "--kv_cache_type", "paged",
        "--gpt_attention_plugin", "float16", "--gemm_plugin", "float16",
        "--context_fmha", "enable", "--use_paged_context_fmha", "enable", "--remove_input_padding", "enable",
        "--tokens_per_block", "32", "--use_fused_mlp", "disable", "--multiple_profiles", "enable",
    ]
    assert trtllm_build_file_command("ckpt", "eng", "build_config.json") == [
        "trtllm-build", "--checkpoint_dir", "ckpt", "--output_dir", "eng", "--build_config", "build_config.json"]


def test_disabled_plugin_is_written_as_disable(tmp_path):
    argv = trtllm_build_command("c", "e", build_config_dict(write_recipe(tmp_path), smollm2_ir_config()))
    assert argv[argv.index("--gemm_plugin") + 1] == "disable"
    assert argv[argv.index("--use_paged_context_fmha") + 1] == "disable"


def test_build_script_is_valid_bash_with_relative_paths(tmp_path):
    d = build_config_dict(load_recipe(LLAMA3_RECIPE), llama3_awq_ir_config())
    text = build_script(tmp_path / "build" / "checkpoint", tmp_path / "build" / "engine", d)
    script = tmp_path / "trtllm-build.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    assert "--checkpoint_dir ../checkpoint \\\n    --output_dir . \\" in text
    assert "--build_config build_config.json" in text
    assert str(tmp_path) not in text


def test_fp8_kv_cache_quantization_block():
    awq = llama3_awq_ir_config()["quantization"]
    assert kv_cache_quantization(awq, "fp8") == {**awq, "kv_cache_quant_algo": "FP8"}
    assert awq["kv_cache_quant_algo"] is None  # the input is not modified
    assert kv_cache_quantization(None, "fp8") == {"quant_algo": None, "kv_cache_quant_algo": "FP8"}
    assert kv_cache_quantization(awq, "auto") == awq


def test_fp8_kv_cache_needs_calibrated_scales():
    names = {f"transformer.layers.{n}.attention.kv_cache_scaling_factor" for n in range(2)}
    require_kv_cache_scales(2, [names])
    with pytest.raises(CheckpointError, match="rank 0 lacks 1 .*layers.1.attention.kv_cache_scaling_factor"):
        require_kv_cache_scales(2, [names - {"transformer.layers.1.attention.kv_cache_scaling_factor"}])
    with pytest.raises(CheckpointError, match="llmc calibrates them"):
        require_kv_cache_scales(2, [set()])

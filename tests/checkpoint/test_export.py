"""llmc.builder.export: 16-bit export of an HF folder and the W4A16_AWQ writer (incl. groupwise padding)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from llmc.builder.export import export_checkpoint, write_w4a16_checkpoint
from llmc.checkpoint.config import trtllm_config_from_hf
from llmc.checkpoint.convert import hf_to_trtllm, merge_shards, pad_for_groupwise
from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4
from llmc.checkpoint.io import read_checkpoint
from llmc.errors import BuildError, CheckpointError
from llmc.recipe import recipe_from_dict
from llmc.source.load import SourceModel, load_state_dict
from tests import factories
from tests.checkpoint.helpers import hf_state_dict, rtn_quantized, tiny_hf


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> SourceModel:
    hf_dir = factories.make_tiny_llama(tmp_path_factory.mktemp("export") / "hf", tmp_path_factory.mktemp("no-tok"),
                                       vocab_size=1000)  # fmt: skip
    return SourceModel(hf_dir=hf_dir, kind="hf", origin=hf_dir, sha256="0" * 64,
                       hf_config=json.loads((hf_dir / "config.json").read_text()), eos_token_ids=(2,),
                       special_token_ids=(0, 1, 2), chat_template=None, bos_token_id=1)  # fmt: skip


def recipe(source: SourceModel, method: str = "none", tp: int = 2):
    return recipe_from_dict({"name": "tiny", "model": {"source": str(source.hf_dir), "dtype": "float16"},
                             "quantization": {"method": method, "group_size": 32}, "engine": {"tp_size": tp}},
                            check_inputs=False)  # fmt: skip


def test_export_16bit_tp2_recombines_to_source(tiny_source, tmp_path):
    report = export_checkpoint(tiny_source, recipe(tiny_source), tmp_path / "ckpt")
    config, ranks = read_checkpoint(tmp_path / "ckpt")
    assert config["mapping"]["tp_size"] == 2 and report["tp_size"] == 2
    assert report["tensors"] == sum(len(r) for r in ranks)
    assert report["bytes"] == sum(t.numel() * t.element_size() for r in ranks for t in r.values())
    merged = merge_shards(ranks, config)
    sd = load_state_dict(tiny_source.hf_dir)
    assert torch.equal(merged["lm_head.weight"], sd["model.embed_tokens.weight"].half())  # tied
    assert torch.equal(merged["transformer.layers.1.mlp.fc.weight"], sd["model.layers.1.mlp.gate_proj.weight"].half())


def test_export_refuses_int4_methods(tiny_source, tmp_path):
    with pytest.raises(BuildError, match="quantize_checkpoint"):
        export_checkpoint(tiny_source, recipe(tiny_source, method="rtn"), tmp_path / "ckpt")


def _mlp(x, fc, gate, proj):
    return (F.silu(x @ fc.T) * (x @ gate.T)) @ proj.T


def test_w4a16_checkpoint_with_intermediate_padding(tmp_path):
    # intermediate 96 is not a multiple of max(64, 32) * tp 2 = 128: padded to 128 without changing the MLP.
    hf = tiny_hf(hidden_size=128, head_dim=32, intermediate_size=96)
    sd = hf_state_dict(hf)
    quantized = rtn_quantized(sd, hf, 32)
    report = write_w4a16_checkpoint(hf, "float16", sd, quantized, 32, 2, tmp_path)
    assert report["padding"] == {"multiple": 128, "intermediate_size": {"original": 96, "padded": 128}}
    config, ranks = read_checkpoint(tmp_path)
    assert config["intermediate_size"] == 128 and config["quantization"]["group_size"] == 32
    merged = merge_shards(ranks, config)
    p = "transformer.layers.1.mlp."
    padded = {m: dequantize_w4a16(merged[p + m + ".weight"], merged[p + m + ".weights_scaling_factor"],
                                  merged[p + m + ".prequant_scaling_factor"], 32)
              for m in ("fc", "gate", "proj")}  # fmt: skip
    original = {m: dequantize_w4a16(pack_int4(quantized[k][0]), quantized[k][1].half(), quantized[k][2].half(), 32)
                for m, k in (("fc", "model.layers.1.mlp.gate_proj"), ("gate", "model.layers.1.mlp.up_proj"),
                             ("proj", "model.layers.1.mlp.down_proj"))}  # fmt: skip
    assert torch.equal(padded["fc"][:96], original["fc"]) and torch.equal(padded["gate"][:96], original["gate"])
    assert torch.equal(padded["proj"][:, :96], original["proj"])
    assert not padded["fc"][96:].any() and not padded["proj"][:, 96:].any()
    x = torch.randn(5, 128)
    assert torch.allclose(_mlp(x, **padded), _mlp(x, **original), rtol=1e-5, atol=1e-2)


def test_pad_for_groupwise_is_noop_when_aligned_and_refuses_hidden():
    hf = tiny_hf(hidden_size=128, head_dim=32)
    cfg = trtllm_config_from_hf(hf, "float16")
    ir = hf_to_trtllm(hf_state_dict(hf), cfg)
    weights, new_cfg, record = pad_for_groupwise(ir, cfg, 2, 64)
    assert record == {} and new_cfg == cfg and all(weights[k] is ir[k] for k in ir)
    with pytest.raises(CheckpointError, match="hidden_size 128 is not a multiple"):
        pad_for_groupwise(ir, cfg, 2, 128)

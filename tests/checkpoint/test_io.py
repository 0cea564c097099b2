"""Checkpoint folders: round trip, the per-rank tensor contract, and every CheckpointError case."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.checkpoint.config import trtllm_config_from_hf
from llmc.checkpoint.convert import hf_to_trtllm, shard
from llmc.checkpoint.io import expected_tensor_specs, read_checkpoint, write_checkpoint
from llmc.checkpoint.safetensors_header import read_safetensors_header
from llmc.errors import CheckpointError
from tests.checkpoint.helpers import LLAMA3_8B_HF, SMOLLM2_HF, hf_state_dict, tiny_hf

QKV0 = "transformer.layers.0.attention.qkv.weight"


def write_tiny(path, tp=2, dtype="bfloat16", **overrides):
    hf = tiny_hf(**overrides)
    cfg = trtllm_config_from_hf(hf, dtype, tp)
    ir = hf_to_trtllm(hf_state_dict(hf), cfg)
    ranks = [shard(ir, cfg, r) for r in range(tp)]
    write_checkpoint(path, cfg, ranks)
    return cfg, ranks


def test_round_trip_is_bitwise(tmp_path):
    cfg, ranks = write_tiny(tmp_path, tie_word_embeddings=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "rank0.safetensors", "rank1.safetensors"]
    got_cfg, got = read_checkpoint(tmp_path)
    assert got_cfg == json.loads(json.dumps(cfg))
    for want, have in zip(ranks, got):
        assert want.keys() == have.keys()
        assert all(torch.equal(want[k], have[k]) and want[k].dtype == have[k].dtype for k in want)
    _, only = read_checkpoint(tmp_path, ranks=[1])
    assert torch.equal(only[0][QKV0], ranks[1][QKV0])


def test_w4a16_specs_llama3_8b_g128_tp2():
    cfg = trtllm_config_from_hf(LLAMA3_8B_HF, "float16", 2, {"quant_algo": "W4A16_AWQ", "group_size": 128})
    specs = expected_tensor_specs(cfg, 1)
    p = "transformer.layers.31."
    i8, f16 = torch.int8, torch.float16
    assert specs[p + "attention.qkv.weight"] == ((1536, 4096), i8)  # (32 + 16) * 128 / 2 rows, halved by packing
    assert specs[p + "attention.qkv.weights_scaling_factor"] == ((3072, 32), f16)
    assert specs[p + "attention.qkv.prequant_scaling_factor"] == ((4096,), f16)
    assert specs[p + "attention.dense.weight"] == ((2048, 2048), i8)
    assert specs[p + "attention.dense.weights_scaling_factor"] == ((4096, 16), f16)
    assert specs[p + "attention.dense.prequant_scaling_factor"] == ((2048,), f16)
    assert specs[p + "mlp.fc.weight"] == ((3584, 4096), i8)
    assert specs[p + "mlp.gate.weights_scaling_factor"] == ((7168, 32), f16)
    assert specs[p + "mlp.proj.weight"] == ((2048, 7168), i8)
    assert specs[p + "mlp.proj.weights_scaling_factor"] == ((4096, 56), f16)
    assert specs[p + "mlp.proj.prequant_scaling_factor"] == ((7168,), f16)
    assert specs["lm_head.weight"] == ((64128, 4096), f16)  # excluded from quantization
    assert len(specs) == 3 + 32 * (2 + 5 * 3)


def test_smollm2_specs_fp8_kv_scales():
    cfg = trtllm_config_from_hf(SMOLLM2_HF, "float16", 1, {"kv_cache_quant_algo": "FP8"})
    specs = expected_tensor_specs(cfg, 0)
    assert specs["transformer.layers.29.attention.kv_cache_scaling_factor"] == ((1,), torch.float32)
    assert len(specs) == 3 + 30 * 8


def test_missing_config_and_rank_file(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        read_checkpoint(tmp_path)
    write_tiny(tmp_path)
    (tmp_path / "rank1.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank1.safetensors is missing"):
        read_checkpoint(tmp_path)


def _rewrite_rank0(path, edit):
    tensors = load_file(str(path / "rank0.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "rank0.safetensors"))


def test_missing_tensors_are_listed(tmp_path):
    write_tiny(tmp_path)
    _rewrite_rank0(tmp_path, lambda t: [t.pop(QKV0), t.pop("lm_head.weight")])
    with pytest.raises(CheckpointError, match="2 tensors missing: lm_head.weight, " + QKV0):
        read_checkpoint(tmp_path)


def test_shape_and_dtype_mismatch(tmp_path):
    write_tiny(tmp_path)
    _rewrite_rank0(tmp_path, lambda t: t.update({QKV0: t[QKV0][:-16].clone()}))
    with pytest.raises(CheckpointError, match=r"qkv.weight has shape \[48, 64\], expected \[64, 64\]"):
        read_checkpoint(tmp_path)
    write_tiny(tmp_path)
    _rewrite_rank0(tmp_path, lambda t: t.update({QKV0: t[QKV0].float()}))
    with pytest.raises(CheckpointError, match="qkv.weight has dtype F32, expected BF16"):
        read_checkpoint(tmp_path)


def test_extra_tensor_only_warns(tmp_path, caplog):
    write_tiny(tmp_path)
    _rewrite_rank0(tmp_path, lambda t: t.update({"transformer.extra.weight": torch.zeros(2)}))
    with caplog.at_level(logging.WARNING):
        read_checkpoint(tmp_path)
    assert "transformer.extra.weight" in caplog.text


def test_write_validates_before_writing(tmp_path):
    hf = tiny_hf()
    cfg = trtllm_config_from_hf(hf, "float16", 2)
    ir = hf_to_trtllm(hf_state_dict(hf), cfg)
    with pytest.raises(CheckpointError, match="tp_size is 2"):
        write_checkpoint(tmp_path / "a", cfg, [shard(ir, cfg, 0)])
    bad = shard(ir, cfg, 0) | {QKV0: torch.zeros(3, 3, dtype=torch.float16)}
    with pytest.raises(CheckpointError, match="expected"):
        write_checkpoint(tmp_path / "b", cfg, [bad, shard(ir, cfg, 1)])
    assert not (tmp_path / "b" / "config.json").exists()
    assert not list((tmp_path / "b").glob("*.tmp-*"))


def test_read_safetensors_header_only(tmp_path):
    write_tiny(tmp_path, tp=1, dtype="float16")
    header = read_safetensors_header(tmp_path / "rank0.safetensors")
    assert header[QKV0]["shape"] == [128, 64] and header[QKV0]["dtype"] == "F16"
    assert header["__metadata__"] == {"format": "pt"}
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        read_safetensors_header(tmp_path / "junk.safetensors")

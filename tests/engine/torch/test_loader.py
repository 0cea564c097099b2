"""Loading the checkpoint IR: TP shards merge, W4A16 dequantizes, dtypes, and bad checkpoints fail clearly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.checkpoint import names
from llmc.engine.torch.loader import load_model
from llmc.errors import CheckpointError
from tests.engine.torch.helpers import rtn_quantize_hf, write_ir


def logits_of(model, ids: list[int]) -> torch.Tensor:
    from tests.engine.torch.helpers import PagedSession

    return PagedSession(model).step({"a": ids})["a"]


IDS = list(range(40, 60))


@pytest.mark.parametrize("tp_size", [2, 4])  # tp 4 > 2 kv heads: kv heads are duplicated across ranks
def test_tensor_parallel_shards_load_to_the_same_logits(tp_size, tiny_hf_dir, tiny_model, tmp_path):
    ir = write_ir(tiny_hf_dir, tmp_path / "ir", tp_size=tp_size)
    assert len(list(ir.glob("rank*.safetensors"))) == tp_size
    sharded = load_model(ir, "cpu")
    torch.testing.assert_close(logits_of(sharded, IDS), logits_of(tiny_model, IDS), atol=0, rtol=0)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_w4a16_checkpoint_loads_to_the_dequantized_weights(tp_size, tiny_hf_dir, tmp_path):
    quantized, effective = rtn_quantize_hf(tiny_hf_dir, group_size=32)
    ir = write_ir(tiny_hf_dir, tmp_path / "ir", tp_size=tp_size, quantized=quantized, group_size=32)
    assert load_file(ir / "rank0.safetensors")[names.trt_layer(0, "attention.qkv")].dtype == torch.int8
    model = load_model(ir, "cpu")
    for layer, block in enumerate(model.transformer.layers):
        for spec in names.LINEARS:
            module = block.get_submodule(spec.trt)
            expected = torch.cat([effective[names.hf_module(layer, m)] for m in spec.hf])  # q, k, v stacked
            torch.testing.assert_close(module.weight, expected, atol=1e-6, rtol=1e-6)


def test_compute_dtype_is_float32_on_cpu_unless_asked(tiny_hf_dir, tmp_path):
    ir = write_ir(tiny_hf_dir, tmp_path / "ir", dtype="bfloat16")
    assert load_model(ir, "cpu").transformer.layers[0].attention.qkv.weight.dtype == torch.float32
    assert load_model(ir, "cpu", dtype="bfloat16").transformer.ln_f.weight.dtype == torch.bfloat16


def test_missing_folder_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path / "nope", "cpu")


def test_shape_mismatch_is_a_checkpoint_error(tiny_ir_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((tiny_ir_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(tiny_ir_dir / "rank0.safetensors")
    tensors[names.trt_layer(1, "mlp.proj")] = tensors[names.trt_layer(1, "mlp.proj")][:, :96].contiguous()
    save_file(tensors, bad / "rank0.safetensors")
    with pytest.raises(CheckpointError, match="mlp.proj"):
        load_model(bad, "cpu")


def test_missing_tensor_is_a_checkpoint_error(tiny_ir_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_ir_dir / "config.json").read_text())
    tensors = load_file(tiny_ir_dir / "rank0.safetensors")
    del tensors[names.trt_layer(0, "attention.dense")]
    save_file(tensors, bad / "rank0.safetensors")
    with pytest.raises(CheckpointError, match="attention.dense"):
        load_model(bad, "cpu")

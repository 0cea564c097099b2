"""The CPU int4 path: W4A16 linears kept packed compute the same layer as the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from llmc.checkpoint import names
from llmc.checkpoint.int4 import pack_int4
from llmc.engine.torch.int4_cpu import MAX_INT4_ROWS, Int4Linear, int4_kernel_available
from llmc.engine.torch.loader import load_model
from tests.engine.torch.helpers import rtn_quantize_hf, write_ir



def test_the_supported_pytorch_has_the_cpu_int4_ops():
    assert int4_kernel_available()  # torch>=2.5 (pyproject) ships them; the loader falls back if not


def random_layer(out_features=96, in_features=128, group=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, in_features // group, generator=gen) * 0.02 + 0.001
    prequant = torch.rand(in_features, generator=gen) + 0.5
    dense = q.float() * scale.repeat_interleave(group, dim=1) * prequant[None, :]
    return q, scale, prequant, dense


@pytest.mark.parametrize("rows", [1, 2, MAX_INT4_ROWS])
def test_int4_rows_match_the_dequantized_layer(rows):
    q, scale, prequant, dense = random_layer()
    layer = Int4Linear.from_packed(pack_int4(q), scale, prequant, 32, dense)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    expected = x @ dense.T
    got = layer(x)
    rel = (got - expected).norm() / expected.norm()
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert rel < 1e-2  # activations are rounded to bfloat16 inside the kernel; the weights are exact
    # Not the dense path in disguise: the int4 path really rounds its activations.
    assert not torch.equal(got, torch.nn.functional.linear(x, dense))


def test_larger_steps_use_the_float_weight_exactly():
    q, scale, prequant, dense = random_layer()
    layer = Int4Linear(q, scale, prequant, 32, dense)
    x = torch.randn(MAX_INT4_ROWS + 1, 128)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dense))


def test_loader_swaps_quantized_linears_and_keeps_the_logits(tiny_hf_dir, tmp_path):
    quantized, _ = rtn_quantize_hf(tiny_hf_dir, group_size=32)
    ir = write_ir(tiny_hf_dir, tmp_path / "ir", quantized=quantized, group_size=32)
    plain = load_model(ir, "cpu")
    fast = load_model(ir, "cpu", int4_kernel=True)
    swapped = {n.split(".", 3)[-1] for n, m in fast.named_modules() if isinstance(m, Int4Linear)}
    assert swapped == {"attention.qkv", "attention.dense", "mlp.proj", "mlp.fc_gate_int4"}
    assert set(names.QUANTIZABLE) == {"attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"}
    assert not any(isinstance(m, Int4Linear) for m in plain.modules())
    # fc + gate run as one GEMM in both: a float one (plain) or one int4 kernel over the stacked rows (fast).
    assert all(layer.mlp.fc_gate is not None for layer in plain.transformer.layers)
    assert all(layer.mlp.fc_gate_int4 is None for layer in plain.transformer.layers)
    for layer in fast.transformer.layers:
        mlp = layer.mlp
        assert isinstance(mlp.fc_gate_int4, Int4Linear) and mlp.fc_gate_int4.out_features == 2 * mlp.fc.out_features
        assert type(mlp.fc) is torch.nn.Linear and mlp.fc.weight.data_ptr() == mlp.fc_gate_int4.dense.data_ptr()
    for rows in (1, MAX_INT4_ROWS):
        x = torch.randn(rows, fast.config.hidden_size)
        for layer_plain, layer_fast in zip(plain.transformer.layers, fast.transformer.layers):
            ref, got = layer_plain.mlp(x), layer_fast.mlp(x)
            assert (got - ref).norm() / ref.norm() < 1e-2
            assert not torch.equal(got, ref)  # the int4 kernel ran (it rounds activations to bfloat16)
    x = torch.randn(MAX_INT4_ROWS + 1, fast.config.hidden_size)  # larger steps: the float weights, exactly
    assert torch.equal(fast.transformer.layers[0].mlp(x), plain.transformer.layers[0].mlp(x))


def test_fc_and_gate_with_different_prequant_scales_stay_separate(tiny_hf_dir, tmp_path):
    """One int4 kernel call multiplies one input; fc and gate fuse only when they pre-scale it the same way."""
    quantized, _ = rtn_quantize_hf(tiny_hf_dir, group_size=32)
    key = names.hf_module(0, "mlp.up_proj")
    q, scales, prequant = quantized[key]
    quantized[key] = (q, scales, prequant * 1.5)
    ir = write_ir(tiny_hf_dir, tmp_path / "ir", quantized=quantized, group_size=32)
    plain, fast = load_model(ir, "cpu"), load_model(ir, "cpu", int4_kernel=True)
    first, second = fast.transformer.layers
    assert first.mlp.fc_gate_int4 is None
    assert isinstance(first.mlp.fc, Int4Linear) and isinstance(first.mlp.gate, Int4Linear)
    assert isinstance(second.mlp.fc_gate_int4, Int4Linear)
    x = torch.randn(2, fast.config.hidden_size)
    ref, got = plain.transformer.layers[0].mlp(x), first.mlp(x)
    assert (got - ref).norm() / ref.norm() < 1e-2

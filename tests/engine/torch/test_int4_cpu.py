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
    swapped = [n for n, m in fast.named_modules() if isinstance(m, Int4Linear)]
    assert len(swapped) == len(names.LINEARS) * len(fast.transformer.layers)
    assert not any(isinstance(m, Int4Linear) for m in plain.modules())
    # int4 layers keep their own kernel; only plain float fc/gate pairs are stacked into one GEMM.
    assert all(layer.mlp.fc_gate is None for layer in fast.transformer.layers)
    assert all(layer.mlp.fc_gate is not None for layer in plain.transformer.layers)
    x = torch.randn(1, fast.config.hidden_size)
    for layer_plain, layer_fast in zip(plain.transformer.layers, fast.transformer.layers):
        ref, got = layer_plain.mlp.fc(x), layer_fast.mlp.fc(x)
        assert (got - ref).norm() / ref.norm() < 1e-2

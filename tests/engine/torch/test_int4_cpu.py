"""The CPU int4 path: W4A16 linears kept packed compute the same layer as the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from llmc.checkpoint import names
from llmc.checkpoint.int4 import pack_int4
from llmc.engine.torch import cpu_ext
from llmc.engine.torch.int4_cpu import MAX_INT4_ROWS, Int4Linear, int4_kernel_available
from llmc.engine.torch.loader import load_model
from tests.engine.torch.helpers import forget_cpu_kernels, rtn_quantize_hf, write_ir



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
def test_torch_int4_rows_match_the_dequantized_layer(rows):
    q, scale, prequant, dense = random_layer()
    layer = Int4Linear.from_packed(pack_int4(q), scale, prequant, 32, dense, kernel="torch")
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    expected = x @ dense.T
    got = layer(x)
    rel = (got - expected).norm() / expected.norm()
    assert layer.kernel == "torch" and got.dtype == torch.float32 and got.shape == (rows, 96)
    assert rel < 1e-2  # activations are rounded to bfloat16 inside the kernel; the weights are exact
    # Not the dense path in disguise: the int4 path really rounds its activations.
    assert not torch.equal(got, torch.nn.functional.linear(x, dense))


AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
needs_avx512 = pytest.mark.skipif(not AVX512, reason="llmc's int4 kernel needs an AVX-512 CPU")
EXPECTED_KERNEL = "llmc" if AVX512 else "torch"


def test_this_machine_builds_llmcs_kernel():
    """With AVX-512 (CI and the development machines have it, and a compiler) the kernel must build: the
    fallback must not hide a broken build. Without it, the status says why."""
    if AVX512:
        assert cpu_ext.load() is not None, cpu_ext.status()
        assert cpu_ext.status() == "llmc AVX-512 kernels"
    else:
        assert cpu_ext.load() is None and "needs AVX512" in cpu_ext.status()


@needs_avx512
@pytest.mark.parametrize("rows", [1, 3, 8, 9, MAX_INT4_ROWS, 2 * MAX_INT4_ROWS + 3])
@pytest.mark.parametrize("shape", [(96, 128, 32), (48, 256, 64), (32, 64, 64)])
def test_llmc_kernel_computes_the_dequantized_layer_in_float32(rows, shape):
    out_features, in_features, group = shape
    q, scale, prequant, dense = random_layer(out_features, in_features, group)
    layer = Int4Linear.from_packed(pack_int4(q), scale, prequant, group, dense, kernel="llmc")
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    got = layer.packed_matmul(x)  # the int4 kernel at any row count (forward uses it up to MAX_INT4_ROWS)
    expected = x.double() @ dense.double().T
    assert layer.kernel == "llmc" and got.dtype == torch.float32 and got.shape == (rows, out_features)
    # float32 end to end: only summation order differs from the float64 product (bfloat16 would be ~1e-3).
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5


@needs_avx512
def test_llmc_kernel_is_batch_invariant():
    """A row's result is bit for bit the same whichever rows share its call (1, 5, 16 or 21 rows): a sequence's
    tokens do not change with the decode batch it lands in."""
    q, scale, prequant, dense = random_layer(96, 256, 64)
    layer = Int4Linear.from_packed(pack_int4(q), scale, prequant, 64, dense, kernel="llmc")
    x = torch.randn(21, 256, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([layer.packed_matmul(x[i:i + 1]) for i in range(21)])
    for rows in (5, 16, 21):
        assert torch.equal(layer.packed_matmul(x[:rows]), alone[:rows]), rows


def test_the_kernel_choice_follows_the_environment(monkeypatch):
    q, scale, prequant, dense = random_layer()
    monkeypatch.setenv(cpu_ext.ENV, "torch")
    forget_cpu_kernels()
    try:
        assert cpu_ext.load() is None and cpu_ext.status() == f"PyTorch's ops ({cpu_ext.ENV}=torch)"
        assert Int4Linear(q, scale, prequant, 32, dense).kernel == "torch"
    finally:
        monkeypatch.delenv(cpu_ext.ENV)
        forget_cpu_kernels()
    assert Int4Linear(q, scale, prequant, 32, dense).kernel == EXPECTED_KERNEL


def test_pack_tiles_layout():
    q = torch.arange(32 * 4).remainder(16).sub(8).view(32, 4).to(torch.int8)  # [N=32, K=4]
    scale = torch.arange(32 * 2, dtype=torch.float32).view(32, 2)  # group 2
    packed, scales = cpu_ext.pack_tiles(q, scale, 2)
    assert packed.shape == (2, 2, 16) and packed.dtype == torch.int8 and scales.shape == (2, 2, 16)
    tile, p, j = 1, 1, 5  # channel 16 + j at columns 2p (low nibble) and 2p + 1 (high nibble)
    byte = packed[tile, p, j].item() & 0xFF
    low, high = byte & 0xF, byte >> 4
    signed = [v - 16 if v > 7 else v for v in (low, high)]  # two's complement nibbles
    assert signed == [q[16 + j, 2 * p].item(), q[16 + j, 2 * p + 1].item()]
    assert scales[tile, 1, 7].item() == scale[16 + 7, 1].item()


def test_larger_steps_use_the_float_weight_exactly():
    q, scale, prequant, dense = random_layer()
    layer = Int4Linear(q, scale, prequant, 32, dense)
    x = torch.randn(MAX_INT4_ROWS + 1, 128)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dense))


def test_loader_swaps_quantized_linears_and_keeps_the_logits(tiny_hf_dir, tmp_path):
    quantized, _ = rtn_quantize_hf(tiny_hf_dir, group_size=32)
    ir = write_ir(tiny_hf_dir, tmp_path / "ir", quantized=quantized, group_size=32)
    plain = load_model(ir, "cpu")
    fast = load_model(ir, "cpu", cpu_kernels=True)
    swapped = {n.split(".", 3)[-1] for n, m in fast.named_modules() if isinstance(m, Int4Linear)}
    assert {m.kernel for m in fast.modules() if isinstance(m, Int4Linear)} == {EXPECTED_KERNEL}
    assert swapped == {"attention.qkv", "attention.dense", "mlp.proj", "mlp.fc_gate_kernel"}
    assert set(names.QUANTIZABLE) == {"attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"}
    assert not any(isinstance(m, Int4Linear) for m in plain.modules())
    # fc + gate run as one GEMM in both: a float one (plain) or one int4 kernel over the stacked rows (fast).
    assert all(layer.mlp.fc_gate is not None for layer in plain.transformer.layers)
    assert all(layer.mlp.fc_gate_kernel is None for layer in plain.transformer.layers)
    for layer in fast.transformer.layers:
        mlp = layer.mlp
        assert isinstance(mlp.fc_gate_kernel, Int4Linear) and mlp.fc_gate_kernel.out_features == 2 * mlp.fc.out_features
        assert type(mlp.fc) is torch.nn.Linear and mlp.fc.weight.data_ptr() == mlp.fc_gate_kernel.prefill.weight.data_ptr()
    for rows in (1, MAX_INT4_ROWS):
        x = torch.randn(rows, fast.config.hidden_size)
        for layer_plain, layer_fast in zip(plain.transformer.layers, fast.transformer.layers):
            ref, got = layer_plain.mlp(x), layer_fast.mlp(x)
            # llmc's kernel: float32 activations, exact weights; PyTorch's op rounds activations to bfloat16.
            assert (got - ref).norm() / ref.norm() < (1e-5 if AVX512 else 1e-2)
    x = torch.randn(MAX_INT4_ROWS + 1, fast.config.hidden_size)  # larger steps: the float weights, exactly
    assert torch.equal(fast.transformer.layers[0].mlp(x), plain.transformer.layers[0].mlp(x))


def test_fc_and_gate_with_different_prequant_scales_stay_separate(tiny_hf_dir, tmp_path):
    """One int4 kernel call multiplies one input; fc and gate fuse only when they pre-scale it the same way."""
    quantized, _ = rtn_quantize_hf(tiny_hf_dir, group_size=32)
    key = names.hf_module(0, "mlp.up_proj")
    q, scales, prequant = quantized[key]
    quantized[key] = (q, scales, prequant * 1.5)
    ir = write_ir(tiny_hf_dir, tmp_path / "ir", quantized=quantized, group_size=32)
    plain, fast = load_model(ir, "cpu"), load_model(ir, "cpu", cpu_kernels=True)
    first, second = fast.transformer.layers
    assert first.mlp.fc_gate_kernel is None
    assert isinstance(first.mlp.fc, Int4Linear) and isinstance(first.mlp.gate, Int4Linear)
    assert isinstance(second.mlp.fc_gate_kernel, Int4Linear)
    x = torch.randn(2, fast.config.hidden_size)
    ref, got = plain.transformer.layers[0].mlp(x), first.mlp(x)
    assert (got - ref).norm() / ref.norm() < 1e-2

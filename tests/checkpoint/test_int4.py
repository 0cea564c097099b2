"""int4 packing (nibble order), round-to-nearest quantization and the W4A16 dequantization formula."""

from __future__ import annotations

import pytest
import torch

from llmc.checkpoint.int4 import dequantize_rank, dequantize_w4a16, pack_int4, quantize_rtn, unpack_int4
from llmc.errors import CheckpointError


def test_nibble_order_row_2j_low_row_2j_plus_1_high():
    q = torch.tensor([[1, -1, 7], [2, -8, 0], [-3, 5, 6], [4, 3, -2]], dtype=torch.int8)  # [O=4, K=3]
    packed = pack_int4(q)
    # Hand-built bytes: (high nibble << 4) | low nibble, nibbles in two's complement (-1 = 0xF, -8 = 0x8).
    expected_unsigned = [[0x21, 0x8F, 0x07], [0x4D, 0x35, 0xE6]]
    assert packed.dtype == torch.int8 and packed.shape == (2, 3)
    assert packed.view(torch.uint8).tolist() == expected_unsigned


def test_pack_unpack_round_trip_all_sixteen_values():
    values = torch.arange(-8, 8, dtype=torch.int8)
    q = torch.cartesian_prod(values, values).T.contiguous()  # [2, 256]: every (low, high) pair
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    assert pack_int4(q).view(torch.uint8).unique().numel() == 256  # every byte value is used once


@pytest.mark.parametrize(
    "q, words",
    [
        (torch.zeros(3, 4, dtype=torch.int8), "even number"),
        (torch.full((2, 4), 8, dtype=torch.int8), r"\[-8, 7\]"),
        (torch.full((2, 4), -9, dtype=torch.int16), r"\[-8, 7\]"),
        (torch.zeros(2, 4), "integer"),
    ],
)
def test_pack_rejects_bad_input(q, words):
    with pytest.raises(CheckpointError, match=words):
        pack_int4(q)


def test_quantize_rtn_symmetric_max_over_seven():
    w = torch.tensor([[0.7, -0.35, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]])  # one group of 4, one all-zero group
    q, scales = quantize_rtn(w, group_size=4, scale_dtype=torch.float32)
    assert scales.tolist() == [[pytest.approx(0.1), 0.0]]
    assert q.tolist() == [[7, -4, 1, 0, 0, 0, 0, 0]]  # -3.5 rounds half to even, 0.1 / 0.1 = 1


def test_quantize_rtn_error_bound_and_range():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    q, scales = quantize_rtn(w, 32)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7 and scales.shape == (16, 2)
    deq = q.float() * scales.repeat_interleave(32, dim=1)
    assert float((deq - w).abs().max()) <= float(scales.max()) / 2 + 1e-6
    with pytest.raises(CheckpointError, match="does not divide"):
        quantize_rtn(w, 48)


def test_dequantize_matches_layer_semantics():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (6, 8), generator=gen, dtype=torch.int8)
    scales = torch.rand(6, 2, generator=gen) + 0.1
    prequant = torch.rand(8, generator=gen) + 0.5
    w = dequantize_w4a16(pack_int4(q), scales, prequant, group_size=4)
    # Float reference, element by element: W[o, k] = q[o, k] * scale[o, k // g] * prequant[k].
    ref = torch.empty(6, 8)
    for o in range(6):
        for k in range(8):
            ref[o, k] = float(q[o, k]) * float(scales[o, k // 4]) * float(prequant[k])
    assert torch.allclose(w, ref, rtol=1e-6, atol=0)
    x = torch.randn(3, 8, generator=gen)
    layer = (x * prequant) @ (q.float() * scales.repeat_interleave(4, dim=1)).T
    assert torch.allclose(x @ w.T, layer, rtol=1e-5, atol=1e-5)


def test_dequantize_rejects_inconsistent_shapes():
    packed = pack_int4(torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(CheckpointError, match="weights_scaling_factor"):
        dequantize_w4a16(packed, torch.ones(4, 3), torch.ones(8), group_size=4)
    with pytest.raises(CheckpointError, match="prequant_scaling_factor"):
        dequantize_w4a16(packed, torch.ones(4, 2), torch.ones(7), group_size=4)
    with pytest.raises(CheckpointError, match="does not divide"):
        dequantize_w4a16(packed, torch.ones(4, 2), torch.ones(8), group_size=3)


def test_dequantize_rank_replaces_each_packed_linear_and_keeps_the_rest():
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, (4, 8), generator=gen, dtype=torch.int8)
    scales, prequant, norm = torch.rand(4, 2, generator=gen), torch.rand(8, generator=gen), torch.rand(8)
    p = "transformer.layers.0.mlp.fc."
    weights = {p + "weight": pack_int4(q), p + "weights_scaling_factor": scales,
               p + "prequant_scaling_factor": prequant, "transformer.layers.0.input_layernorm.weight": norm}
    out = dequantize_rank(weights, group_size=4, dtype=torch.float16)
    assert set(out) == {p + "weight", "transformer.layers.0.input_layernorm.weight"}
    assert torch.equal(out[p + "weight"], dequantize_w4a16(pack_int4(q), scales, prequant, 4, dtype=torch.float16))
    assert out["transformer.layers.0.input_layernorm.weight"] is norm
    del weights[p + "prequant_scaling_factor"]
    with pytest.raises(CheckpointError, match=r"lacks 'transformer.layers.0.mlp.fc.prequant_scaling_factor'"):
        dequantize_rank(weights, group_size=4)

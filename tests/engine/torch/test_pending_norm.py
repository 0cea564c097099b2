"""Which int4 layers and steps leave a norm pending and which finish one (CPU: the CUDA library is stood in for;
the kernels themselves: tests/engine/torch/test_norm_epilogue_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmc.engine.torch import pending_norm
from llmc.engine.torch.int4_cuda import Scratch
from llmc.engine.torch.pending_norm import NORM_EPILOGUE_ENV, PendingNorm, add_residual, kernel_args, takes_input_norm


def fake_layer(config=(1, 2, 16, 2), columns=64, in_features=128, **kw):
    """An int4 mma layer as add_residual and takes_input_norm see it (its config at every row count)."""
    scratch = Scratch(torch.bfloat16, torch.device("cpu"))
    scratch.reserve(norm_sums=96 * columns // 16)
    fields = dict(backend="mma", dense_from_m=96, silu_output=False, period=0, prequant=None, columns=columns,
                  in_features=in_features, group_size=64, words=torch.zeros(1), scales=torch.zeros(1),
                  scratch=scratch, mma_config_for=lambda m: config)
    fields.update(kw)
    return SimpleNamespace(**fields)


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(pending_norm.cuda_ext, "w4a16_mma_add", lambda *a: calls.append(a))
    monkeypatch.delenv(NORM_EPILOGUE_ENV, raising=False)
    return calls


def test_add_residual_launches_the_epilogue_and_leaves_the_norm_pending(launches):
    layer = fake_layer()
    x, h, w = torch.randn(3, 128).bfloat16(), torch.randn(3, 64).bfloat16(), torch.ones(64).bfloat16()
    got = add_residual(layer, x, h, w, 1e-5)
    assert isinstance(got, PendingNorm) and got.h is h and got.weight is w and got.eps == 1e-5
    assert got.blocks == 64 // (16 * 2) and got.shape == (3, 64)  # one sum a row per block of 2 column tiles
    assert len(launches) == 1
    args = launches[0]
    assert args[0] is x and args[7] == (1, 2, 16, 2) and args[8] is h and args[9] is got.scaled
    assert args[10] is w and args[11] is got.sums and got.scaled.shape == h.shape and got.scaled.dtype == h.dtype
    assert got.sums.dtype == torch.float32 and got.sums.numel() >= 3 * got.blocks
    assert kernel_args(got) == {"in_sums": got.sums, "in_blocks": 2, "in_eps": 1e-5}


@pytest.mark.parametrize("why,layer,rows", [
    ("fc + gate", fake_layer(silu_output=True), 3),
    ("qkv with the RoPE layout", fake_layer(period=16), 3),
    ("the Triton fallback", fake_layer(backend="triton"), 3),
    ("the register kernel", fake_layer(config=(1, 1, 8, 0)), 3),
    ("the warpgroup kernel", fake_layer(config=(8, 8, 8, -4)), 3),
    ("8 stages", fake_layer(config=(1, 2, 8, 8)), 3),
    ("a prefill-sized step", fake_layer(), 96),
    ("more rows than LLMC_NORM_EPILOGUE by default (8)", fake_layer(), 9),
])
def test_add_residual_declines_where_it_does_not_apply(launches, why, layer, rows):
    x, h = torch.randn(rows, 128).bfloat16(), torch.randn(rows, 64).bfloat16()
    assert add_residual(layer, x, h, torch.ones(64).bfloat16(), 1e-5) is None, why
    assert not launches


def test_add_residual_follows_the_environment_and_the_residuals_layout(launches, monkeypatch):
    layer, w = fake_layer(), torch.ones(64).bfloat16()
    x = torch.randn(8, 128).bfloat16()
    assert add_residual(layer, x, torch.randn(8, 64).float(), w, 1e-5) is None  # another dtype
    assert add_residual(layer, x, torch.randn(8, 65).bfloat16()[:, :64], w, 1e-5) is None  # rows not aligned
    monkeypatch.setenv(NORM_EPILOGUE_ENV, "4")
    assert add_residual(layer, x, torch.randn(8, 64).bfloat16(), w, 1e-5) is None
    monkeypatch.setenv(NORM_EPILOGUE_ENV, "8")
    assert add_residual(layer, x, torch.randn(8, 64).bfloat16(), w, 1e-5) is not None
    assert len(launches) == 1


def test_only_folded_ring_layers_finish_a_pending_norm(monkeypatch):
    monkeypatch.delenv(NORM_EPILOGUE_ENV, raising=False)
    h = torch.randn(3, 128).bfloat16()
    pending = PendingNorm(h, h.clone(), torch.zeros(6), 2, torch.ones(128).bfloat16(), 1e-5)
    assert takes_input_norm(fake_layer(), pending)
    assert takes_input_norm(fake_layer(silu_output=True, period=128), pending)  # fc + gate: yes
    assert takes_input_norm(fake_layer(period=16), pending)  # qkv with the RoPE layout: yes
    assert not takes_input_norm(fake_layer(prequant=torch.ones(128)), pending)  # the input scale not folded
    assert not takes_input_norm(fake_layer(config=(8, 8, 8, -4)), pending)
    assert not takes_input_norm(fake_layer(in_features=256), pending)
    assert not takes_input_norm(fake_layer(), PendingNorm(h.float(), h.float(), pending.sums, 2, pending.weight, 1e-5))
    monkeypatch.setenv(NORM_EPILOGUE_ENV, "0")
    assert not takes_input_norm(fake_layer(), pending)


def test_a_pending_norm_materializes_as_the_norm_kernel_computes_it():
    from llmc.engine.torch import fused_triton  # on CPU under Triton's interpreter (tests/conftest.py)

    h, w = torch.randn(4, 64).bfloat16(), (torch.rand(64) + 0.5).bfloat16()
    pending = PendingNorm(h, h * w, torch.zeros(4), 1, w, 1e-5)
    assert torch.equal(pending.materialize(), fused_triton.rms_norm(h, w, 1e-5))
    assert torch.equal(pending_norm.materialized(pending), pending.materialize())
    assert pending_norm.materialized(h) is h

"""A norm left pending between int4 layers on a GPU (run through the device tool): an o or down projection adding its
product to the residual stream and storing its blocks' sums of squares in its epilogue, and a qkv or fc + gate layer
finishing the RMSNorm in its input load, against the product, llmc's add + RMSNorm kernel and the product of the
normed rows, at every ring config and at real shapes; the engine with and without it.
Which layers and steps take it (CPU): tests/engine/torch/test_pending_norm.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4
from llmc.engine.torch import cuda_ext, pending_norm
from llmc.engine.torch.int4_configs import is_wgmma, mma_configs, mma_fits
from llmc.engine.torch.int4_cuda import Int4CudaLinear, Scratch
from llmc.engine.torch.pending_norm import NORM_EPILOGUE_ENV, PendingNorm

pytestmark = pytest.mark.gpu

SM90 = cuda_ext.warpgroup_kernels()
ROWS = (1, 3, 8, 16, 17, 33, 64)


def ring_configs(n, k, rows, prequant):
    """The ring kernel's configs with the epilogue and the input norm (stages 2 and 4) that fit at ``rows``."""
    return [c for c in mma_configs() if not is_wgmma(c) and c[3] in pending_norm.RING_STAGES
            and mma_fits(c, n, k, prequant, rows, sm90=SM90)]


def random_layer(n, k, group, dtype, prequant, gen, silu=False, rope_head=0):
    """An int4 layer of random weights (fc and gate of n columns each with ``silu``) and its float32 weights."""
    def part():
        return (pack_int4(torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)),
                (torch.rand(n, k // group, generator=gen) * 0.01 + 0.002).to(dtype))

    parts = [part(), part()] if silu else [part()]
    pq = (torch.rand(k, generator=gen) + 0.5).to(dtype) if prequant else None
    scratch = Scratch(dtype, torch.device("cuda"))
    layer = Int4CudaLinear.from_ir([(q.cuda(), sc.cuda()) for q, sc in parts], None if pq is None else pq.cuda(),
                                   group, scratch, silu_output=silu, rope_head=rope_head)
    scratch.reserve(norm_sums=2048 * n // 16)
    assert layer.backend == "mma"
    ones = torch.ones(k)
    return layer, [dequantize_w4a16(q, sc, ones if pq is None else pq, group).cuda() for q, sc in parts]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (4096, 14336, 128), (576, 576, 64), (576, 1536, 64)])
def test_add_epilogue_gives_the_residual_bits_and_its_sums_of_squares(n, k, group, dtype):
    """o and down: the residual comes out with the bits of the product (same config) then llmc's Triton add +
    RMSNorm kernel, the scaled rows are the new rows times the norm's weight rounded once, the blocks' sums of
    squares add up to the new rows' (float32), and two launches give the same bits."""
    from llmc.engine.torch import fused_triton

    assert cuda_ext.load() is not None, cuda_ext.status()
    gen = torch.Generator().manual_seed(3)
    layer, _ = random_layer(n, k, group, dtype, True, gen)
    norm_w = (torch.rand(n, generator=gen) + 0.5).to(dtype).cuda()
    tried = 0
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen).to(dtype).cuda()
        h0 = (torch.randn(rows, n, generator=gen) * 4).to(dtype).cuda()
        for config in ring_configs(n, k, rows, True) if rows in (3, 17, 64) else [layer.mma_config_for(rows)]:
            if config[3] not in pending_norm.RING_STAGES:
                continue
            ref_h = h0.clone()
            fused_triton.add_rms_norm_(ref_h, layer.mma(x, *config), norm_w, 1e-5)
            blocks = n // (16 * config[1])
            sums = []
            for _ in range(2):
                h, scaled = h0.clone(), torch.empty_like(h0)
                out = torch.full((rows * blocks,), float("nan"), device="cuda")
                cuda_ext.w4a16_mma_add(x, layer.words, layer.scales, layer.prequant, n, k, group, config, h, scaled,
                                       norm_w, out)
                assert torch.equal(h, ref_h), (rows, config)
                assert torch.equal(scaled, (ref_h.float() * norm_w.float()).to(dtype)), (rows, config)
                sums.append(out)
            assert torch.equal(sums[0], sums[1]), (rows, config)
            total = sums[0].view(rows, blocks).sum(-1)
            assert torch.allclose(total, ref_h.float().pow(2).sum(-1), rtol=1e-4), (rows, config)
            tried += 1
    assert tried >= 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,silu,rope", [
    (6144, 4096, 128, False, 128), (14336, 4096, 128, True, 0),  # Llama-3.1-8B qkv (RoPE layout), fc + gate
    (960, 576, 64, False, 64), (1536, 576, 64, True, 0),  # SmolLM2's
])
def test_input_norm_is_as_accurate_as_the_separate_norm_kernel(n, k, group, silu, rope, dtype):
    """qkv and fc + gate: the product of the scaled rows with the norm's factor applied in the epilogue is as close
    to a float32 product of the float32-normed rows as the product of llmc's normed rows (the Triton norm kernel's)
    is (its inputs are rounded once, as h * weight, instead of twice), at the layer's config and every ring config;
    the qkv layer's RoPE + KV-write epilogue takes it too."""
    from llmc.engine.torch import fused_triton

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    gen = torch.Generator().manual_seed(7)
    layer, weights = random_layer(n, k, group, dtype, False, gen, silu=silu, rope_head=rope)
    norm_w = (torch.rand(k, generator=gen) + 0.5).to(dtype).cuda()
    tried = roped = 0
    for rows in ROWS:
        h = (torch.randn(rows, k, generator=gen) * 3).to(dtype).cuda()
        blocks = 64  # the producer's blocks a row: split the squares' sum in 64 column ranges
        sums = h.float().pow(2).view(rows, blocks, k // blocks).sum(-1).flatten().contiguous()
        pending = PendingNorm(h, (h.float() * norm_w.float()).to(dtype), sums, blocks, norm_w, 1e-5)
        normed = fused_triton.rms_norm(h, norm_w, 1e-5)
        exact = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()
        products = [exact @ w.T for w in weights]
        want = F.silu(products[0]) * products[1] if silu else products[0]
        configs = ring_configs(layer.columns, k, rows, False) if rows in (3, 17, 64) else [layer.mma_config_for(rows)]
        for config in configs:
            if config[3] not in pending_norm.RING_STAGES:
                continue
            separate, got = layer.mma(normed, *config), layer.mma(pending.scaled, *config, norm=pending)
            assert rel(got, want) <= 1.1 * rel(separate, want) + 1e-4, (rows, config, rel(got, want))
            assert rel(got, separate.float()) < 1e-2, (rows, config)
            tried += 1
        if rope and pending_norm.takes_input_norm(layer, pending):  # the layer's config at these rows is a ring
            from llmc.engine.torch.rope import rope_cos_sin, rope_inv_freq

            nkv = 8 if rope == 128 else 3
            nh = n // rope - 2 * nkv
            cos, sin = rope_cos_sin(rope_inv_freq(rope, 500000.0, None).cuda(),
                                    torch.arange(rows, device="cuda") * 7, dtype)
            caches = [torch.zeros(8, 16, nkv, rope, dtype=dtype, device="cuda") for _ in range(4)]
            slots = torch.randperm(128, generator=gen)[:rows].cuda()
            q_ref = layer.rope_write_kv(normed, cos, sin, caches[0], caches[1], slots, nh, nkv)
            q_got = layer.rope_write_kv(pending, cos, sin, caches[2], caches[3], slots, nh, nkv)
            assert rel(q_got, q_ref.float()) < 1e-2 and rel(caches[2], caches[0].float()) < 1e-2, rows
            roped += 1
    assert tried >= 8 and (roped >= 3 or not rope)


def test_engine_with_and_without_pending_norms(tmp_path, monkeypatch):
    """SmolLM2's shape as an int4 IR, prompts in 8 chunks of up to 64 rows and decode steps (so the norms are left
    pending): the logits are as close to llmc's float32 CPU engine on the same IR as with the separate add +
    RMSNorm kernel (mean KL within 1.25x; the bf16 roundings of this random model), and the epilogue ran (and did
    not with the switch off). (Graph-replayed decode steps against eager ones, with pending norms by default:
    test_int4_cuda_gpu.py.)"""
    from llmc.engine.torch.loader import load_model
    from tests.engine.torch.helpers import rtn_quantize_hf, write_ir
    from tests.engine.torch.test_gpu import SMOLLM2_SHAPE, paged_logits, random_llama

    def kl(a, b):
        a, b = a.float().cpu(), b.float().cpu()
        return F.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()

    hf_dir = random_llama(tmp_path, **SMOLLM2_SHAPE)
    quantized, _ = rtn_quantize_hf(hf_dir, group_size=64)
    ir = write_ir(hf_dir, tmp_path / "ir", dtype="bfloat16", quantized=quantized, group_size=64)
    launches = []
    add = cuda_ext.w4a16_mma_add
    monkeypatch.setattr(cuda_ext, "w4a16_mma_add", lambda *a: (launches.append(a[0].shape[0]), add(*a)))
    ids = list(range(1000, 1400))
    cpu = paged_logits(load_model(ir, "cpu"), ids, chunks=8)
    got, counts = {}, {}
    for setting in ("64", "0"):
        monkeypatch.setenv(NORM_EPILOGUE_ENV, setting)
        launches.clear()
        got[setting] = kl(paged_logits(load_model(ir, "cuda"), ids, chunks=8), cpu)
        counts[setting] = len(launches)
    print(f"mean KL vs the CPU engine: pending norms {got['64']:.2e}, separate kernel {got['0']:.2e}; epilogue "
          f"launches {counts}")
    assert counts["64"] > 0 and counts["0"] == 0
    assert got["64"] <= 1.25 * got["0"] + 1e-3


"""The CUDA int4 path on a GPU (run through the device tool): each W4A16 kernel against a float32 product over the
dequantized weight at real shapes and row counts, the fused kernels against the reference ops, folded vs unfolded
pre-quant scales, the qkv layer's RoPE + KV-write epilogue, the int4 engine against llmc's CPU engine on the same
IR, and CUDA-graph decode of int4 layers;
the CUDA C++ tensor-core kernels (``mma``: ring, register and, on sm_90, warpgroup kernels) and the Triton fallback
both.
The CPU tests of the same kernels (Triton's interpreter): tests/engine/torch/test_int4_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4
from llmc.engine.torch import cuda_ext
from llmc.engine.torch.int4_configs import heuristic_config, is_wgmma, mma_configs, mma_fits, wgmma_splits
from llmc.engine.torch.int4_cuda import Scratch, Int4CudaLinear
from llmc.engine.torch.int4_layout import pack_for_cuda
from llmc.engine.torch.kv_store import FP8

pytestmark = pytest.mark.gpu

SM90 = cuda_ext.warpgroup_kernels()  # the warpgroup kernel's GPUs

ROWS = (1, 3, 8, 16, 17, 64, 255, 2048)
SHAPES = [  # n (columns), k, group, silu_output (fc + gate interleaved), prequant in the kernel
    (960, 576, 64, False, False),  # SmolLM2 qkv: K not a multiple of the 128-input tile
    (3072, 576, 64, True, False),  # SmolLM2 fc + gate, returning silu(fc) * gate
    (576, 1536, 64, False, True),  # SmolLM2 down projection
    (1000, 4096, 128, False, True),  # N not a multiple of any column block
    (6144, 4096, 128, False, False),  # Llama-3.1-8B qkv
    (4096, 14336, 128, False, True),  # Llama-3.1-8B down projection
]


def reserve_every_split(scratch: Scratch, n: int, rows: int = 255) -> None:
    """Room in ``scratch`` for every split-K config at up to ``rows`` rows (a layer reserves only its tuned ones)."""
    scratch.reserve_splits(((c, rows) for c in mma_configs()), n)


def layer_and_weight(n, k, group, silu, prequant, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.002).bfloat16()
    pq = (torch.rand(k, generator=gen) + 0.5).bfloat16() if prequant else None
    packed = pack_int4(q)
    words, scales_t = pack_for_cuda(packed.cuda(), scales.cuda(), group)
    layer = Int4CudaLinear(words, scales_t, None if pq is None else pq.cuda(), k, group,
                           Scratch(torch.bfloat16, torch.device("cuda")), silu_output=silu)
    weight = dequantize_w4a16(packed, scales, pq if pq is not None else torch.ones(k), group).cuda()  # [N, K] fp32
    return layer, weight


@pytest.mark.parametrize("n,k,group,silu,prequant", SHAPES)
def test_int4_layer_matches_float32_product_at_every_row_count(n, k, group, silu, prequant):
    layer, weight = layer_and_weight(n, k, group, silu, prequant)
    for rows in ROWS:
        x = torch.randn(rows, k, device="cuda").bfloat16()
        ref = x.float() @ weight.T
        if silu:
            ref = F.silu(ref[:, 0::2]) * ref[:, 1::2]
        got = layer(x)  # the dispatch: tuned kernel below dense_from_m, dequantize + cuBLAS above
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(got).all() and rel < 8e-3, (rows, rel, layer.dense_from_m)
        if rows < layer.dense_from_m:  # and the heuristic config, used by shapes nobody tuned
            heur = layer.matmul(x, heuristic_config(rows, n, k))
            assert ((heur.float() - ref).norm() / ref.norm()).item() < 8e-3


MMA_SHAPES = [  # the shapes of SHAPES with whole mma tiles (16 columns x 64 inputs)
    (960, 576, 64, False, False),
    (3072, 576, 64, True, False),
    (576, 1536, 64, False, True),
    (6144, 4096, 128, False, False),
    (28672, 4096, 128, True, False),  # Llama-3.1-8B fc + gate
    (4096, 14336, 128, False, True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,silu,prequant", MMA_SHAPES)
def test_mma_layer_matches_float32_product_for_every_config_and_row_count(n, k, group, silu, prequant, dtype):
    """llmc's CUDA tensor-core kernel (every row-tile and warp config) and its dequantize + cuBLAS path."""
    from llmc.engine.torch import cuda_ext

    assert cuda_ext.load() is not None, cuda_ext.status()
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.002).to(dtype)
    pq = (torch.rand(k, generator=gen) + 0.5).to(dtype) if prequant else None
    packed = pack_int4(q)
    parts = [(packed[: n // 4], scales[: n // 2]), (packed[n // 4:], scales[n // 2:])] if silu else [(packed, scales)]
    scratch = Scratch(dtype, torch.device("cuda"))
    layer = Int4CudaLinear.from_ir([(a.cuda(), b.cuda()) for a, b in parts], None if pq is None else pq.cuda(),
                                   group, scratch, silu_output=silu)
    reserve_every_split(scratch, n)
    assert layer.backend == "mma"
    weight = dequantize_w4a16(packed, scales, pq if pq is not None else torch.ones(k), group).cuda()  # fp32 [N, K]
    # The prefill path's weight: q * scale * prequant in float32, rounded once: the same bits as the reference's
    # (fc + gate as [fc | gate] columns), including partial blocks (960 and 576 columns, 9 input tiles).
    assert torch.equal(layer.dequantize(torch.empty(k, n, dtype=dtype, device="cuda")), weight.T.to(dtype))
    for rows in ROWS:
        x = torch.randn(rows, k, device="cuda").to(dtype)
        ref = x.float() @ weight.T
        if silu:
            ref = F.silu(ref[:, : n // 2]) * ref[:, n // 2:]

        def rel(got):
            assert got.shape == ref.shape and torch.isfinite(got).all()
            return ((got.float() - ref).norm() / ref.norm()).item()

        assert rel(layer(x)) < 8e-3, (rows, layer.dense_from_m)
        if rows <= 255:
            for config in mma_configs():  # the ring, register (stages 0) and warpgroup (stages < 0; split-K too)
                if mma_fits(config, n, k, prequant, rows, sm90=SM90):
                    assert rel(layer.mma(x, *config)) < 8e-3, (rows, config)
        if rows in (3, 64):  # the prefill path at any row count
            assert rel(layer._dense(x)) < 8e-3, rows
    strided = torch.randn(5, k + 64, device="cuda").to(dtype)[:, :k]  # a view: rows 16-byte aligned, not contiguous
    assert torch.equal(layer(strided), layer(strided.contiguous()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nh,nkv,hd,k,group", [(32, 8, 128, 4096, 128), (9, 3, 64, 576, 64)])  # 8B, SmolLM2
def test_qkv_rope_epilogue_equals_the_product_then_the_rope_kernel(nh, nkv, hd, k, group, dtype):
    """A qkv layer packed per head (rope_head) gives the plain layer's bits from forward and its dequantized weight,
    and its RoPE + KV-write epilogue gives the bits of the same product (same config) followed by the Triton rope
    kernel: q, and k and v in the rows' cache slots (the others stay zero), at the layer's own config for every row
    count the epilogue serves and at every config that fits. An fp8 cache it declines (its epilogue writes 16 bits),
    the cache untouched."""
    from llmc.engine.torch import cuda_ext, fused_triton
    from llmc.engine.torch.rope import rope_cos_sin, rope_inv_freq

    assert cuda_ext.load() is not None, cuda_ext.status()
    n = (nh + 2 * nkv) * hd
    gen = torch.Generator().manual_seed(11)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.002).to(dtype)
    pq = (torch.rand(k, generator=gen) + 0.5).to(dtype).cuda()
    parts = [(pack_int4(q).cuda(), scales.cuda())]
    scratch = Scratch(dtype, torch.device("cuda"))
    plain = Int4CudaLinear.from_ir(parts, pq, group, scratch)
    rope = Int4CudaLinear.from_ir(parts, pq, group, scratch, rope_head=hd)
    # Every row count the epilogue serves, those below dense_from_m (the tuned tables' 160-512 on the H100 and H200,
    # 96 untuned): decode steps, CUDA graphs' prompt steps of up to 128 tokens, eager prompt chunks; each bucket's
    # config with its partial row tiles.
    sweep = range(1, min(rope.dense_from_m, 512))
    reserve_every_split(scratch, n, rows=sweep[-1])
    assert rope.rope_head == hd and rope.period == hd and plain.rope_head == 0
    assert torch.equal(rope.dequantize(torch.empty(k, n, dtype=dtype, device="cuda")),
                       plain.dequantize(torch.empty(k, n, dtype=dtype, device="cuda")))
    blocks, block_size = 32, 16  # a slot for each of up to 511 rows
    for rows in sweep:
        x = torch.randn(rows, k, generator=gen).to(dtype).cuda()
        assert torch.equal(rope(x), plain(x))  # the interleaved columns come back in their own order
        positions = torch.randint(0, 4000, (rows,), generator=gen).cuda()
        cos, sin = rope_cos_sin(rope_inv_freq(hd, 500000.0, None).cuda(), positions, dtype)
        static = torch.zeros(rows, 3, dtype=torch.int64)
        static[:, 2] = torch.randperm(blocks * block_size, generator=gen)[:rows]  # a strided column, as in graphs
        slots = static.cuda()[:, 2]
        configs = [c for c in mma_configs() if mma_fits(c, n, k, True, rows, sm90=SM90)] if rows in (3, 17, 64) else []
        for config in [None, *configs]:
            ref_k = torch.zeros(blocks, block_size, nkv, hd, dtype=dtype, device="cuda")
            ref_v, k_cache, v_cache = torch.zeros_like(ref_k), torch.zeros_like(ref_k), torch.zeros_like(ref_k)
            qkv = plain(x) if config is None else plain.mma(x, *config)
            ref_q = fused_triton.rope_write_kv(qkv, cos, sin, ref_k, ref_v, slots, nh, nkv, hd)
            if config is None:
                got_q = rope.rope_write_kv(x, cos, sin, k_cache, v_cache, slots, nh, nkv)
            else:
                got_q = torch.empty(rows, nh, hd, dtype=dtype, device="cuda")
                cuda_ext.w4a16_mma_rope(x, rope.words, rope.scales, rope.prequant, n, k, group, config,
                                        cos.reshape(rows, hd), sin.reshape(rows, hd), slots,
                                        got_q.view(rows, -1), k_cache, v_cache, nh, nkv,
                                        **rope._split_buffers(config, rows))
            assert torch.equal(got_q, ref_q), (rows, config)
            assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), (rows, config)
            assert k_cache.view(-1, nkv, hd)[slots].abs().sum() > 0
    # An fp8 cache: declined (the rope kernel stores it), the cache untouched; whatever the rows, so checked once.
    k8, v8 = (torch.zeros(blocks, block_size, nkv, hd, dtype=FP8, device="cuda") for _ in range(2))
    assert rope.rope_write_kv(x, cos, sin, k8, v8, slots, nh, nkv) is None
    assert not k8.view(torch.uint8).any() and not v8.view(torch.uint8).any()


@pytest.mark.skipif(not SM90, reason="the warpgroup kernel (split-K included) runs on sm_90 only")
@pytest.mark.parametrize("n,k,prequant", [(4096, 14336, True), (576, 576, True), (6144, 4096, False)])
def test_split_k_is_bitwise_repeatable_and_leaves_its_counters_at_zero(n, k, prequant):
    """Split-K's last block adds the splits' sums in split order whatever order they arrive in, so two launches give
    the same bits; it resets each tile's counter, so the next launch (here: the next config, other tiles) starts
    from zero; and more splits than chunks (SmolLM2's o: 9 chunks, 8 splits of 2) leave empty splits that still
    count."""
    group = 128 if k % 128 == 0 else 64
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.002).bfloat16()
    pq = (torch.rand(k, generator=gen) + 0.5).bfloat16() if prequant else None
    scratch = Scratch(torch.bfloat16, torch.device("cuda"))
    layer = Int4CudaLinear.from_ir([(pack_int4(q).cuda(), scales.cuda())], None if pq is None else pq.cuda(), group,
                                   scratch)
    reserve_every_split(scratch, n)
    weight = dequantize_w4a16(pack_int4(q), scales, pq if pq is not None else torch.ones(k), group).cuda()
    splits = [c for c in mma_configs() if is_wgmma(c) and wgmma_splits(c)[0] > 1]
    assert {wgmma_splits(c)[0] for c in splits} == {2, 4, 8}
    tried = set()
    for rows in (1, 17, 64, 128):
        x = torch.randn(rows, k, generator=gen).bfloat16().cuda()
        ref = x.float() @ weight.T
        for config in splits:
            if not mma_fits(config, n, k, prequant, rows):
                continue
            first, second = layer.mma(x, *config), layer.mma(x, *config)
            assert torch.equal(first, second), (rows, config)
            assert ((first.float() - ref).norm() / ref.norm()).item() < 8e-3, (rows, config)
            assert scratch.buffer("counters", 0).count_nonzero().item() == 0, (rows, config)
            tried.add(config)
    assert {wgmma_splits(c)[0] for c in tried} == {2, 4, 8}  # every split count ran on this shape


def test_fused_kernels_on_cuda_round_like_the_reference():
    from llmc.engine.torch import fused_triton
    from llmc.engine.torch.layers import RMSNorm

    h = torch.randn(7, 4096, device="cuda").bfloat16()
    a = torch.randn(7, 4096, device="cuda").bfloat16()
    norm = RMSNorm(4096, 1e-5, torch.bfloat16).cuda()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    expected_h = h + a
    fused_h = h.clone()
    got = fused_triton.add_rms_norm_(fused_h, a, norm.weight, 1e-5)
    assert torch.equal(fused_h, expected_h)
    one_step = 2 ** -7 * norm(expected_h).float().abs() + 1e-6
    assert ((got.float() - norm(expected_h).float()).abs() <= one_step).all()  # rsqrt may differ in the last bit


@pytest.fixture(scope="module")
def smollm2_w4a16_ir(tmp_path_factory):
    from tests.engine.torch.helpers import rtn_quantize_hf, write_ir
    from tests.engine.torch.test_gpu import SMOLLM2_SHAPE, random_llama

    tmp = tmp_path_factory.mktemp("smollm2_w4a16")
    hf_dir = random_llama(tmp, **SMOLLM2_SHAPE)
    quantized, _ = rtn_quantize_hf(hf_dir, group_size=64)
    return write_ir(hf_dir, tmp / "ir", dtype="bfloat16", quantized=quantized, group_size=64)


def test_folded_prequant_gives_the_unfolded_logits(smollm2_w4a16_ir, monkeypatch):
    """Folding AWQ's input scale into the norm weight moves where products are rounded to bf16 (the norm weight
    times the scale, vs the normed input times it in the kernel's input load, vs the weight times it in the
    dequantized prefill weight). On both paths (int4 kernel, dequantize + cuBLAS) the folded and the unfolded
    model are each as close to llmc's float32 CPU engine as the same IR dequantized to bf16 is: the size of bf16
    rounding on this random model (measured on the H200: 8.6e-3 / 8.0e-3 mean KL for the paths, the folded and
    unfolded dense paths 9e-3 apart, a random model's near-tied logits swap)."""
    from llmc.engine.torch.loader import CUDA_KERNELS_ENV, load_model
    from tests.engine.torch.test_gpu import paged_logits

    def kl(a, b):
        a, b = a.float().cpu(), b.float().cpu()
        return F.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()

    ids = list(range(1000, 1300))
    cpu = paged_logits(load_model(smollm2_w4a16_ir, "cpu"), ids)
    with monkeypatch.context() as env:
        env.setenv(CUDA_KERNELS_ENV, "0")
        yardstick = kl(paged_logits(load_model(smollm2_w4a16_ir, "cuda"), ids), cpu)
    for path, dense_from_m in (("int4 kernel", 10**9), ("dequantize + cuBLAS", 1)):
        got = {}
        for fold in (True, False):
            model = load_model(smollm2_w4a16_ir, "cuda", fold_prequant=fold)
            layers = [m for m in model.modules() if isinstance(m, Int4CudaLinear)]
            # folded: only o and down apply the scale in the kernel; unfolded: qkv and fc + gate too
            assert sum(m.prequant is not None for m in layers) == len(layers) // 4 * (2 if fold else 4)
            for layer in layers:
                layer.dense_from_m = dense_from_m
            got[fold] = paged_logits(model, ids)
        print(f"{path}: mean KL vs the CPU engine folded {kl(got[True], cpu):.2e}, unfolded "
              f"{kl(got[False], cpu):.2e} (bf16 dequantized: {yardstick:.2e}); folded vs unfolded "
              f"{kl(got[True], got[False]):.2e}")
        for fold in (True, False):
            assert kl(got[fold], cpu) <= 1.25 * yardstick + 1e-3, (path, fold)


def test_int4_engine_on_cuda_matches_the_cpu_engine_on_the_same_ir(smollm2_w4a16_ir, monkeypatch):
    """llmc's CUDA int4 engine (bf16 compute) vs its CPU engine (float32) on the same IR over 2048 tokens: the int4
    kernels add no error beyond computing in bf16 (the same IR dequantized to bf16 on CUDA is the yardstick)."""
    from llmc.engine.torch.int4_cuda import Int4CudaLinear as Layer
    from llmc.engine.torch.loader import CUDA_KERNELS_ENV, load_model, weight_bytes
    from tests.engine.torch.helpers import PagedSession

    def logits(model, ids, chunks=4):
        session = PagedSession(model, block_size=16, num_blocks=160)
        bounds = [len(ids) * i // chunks for i in range(chunks + 1)]
        return torch.cat([session.step({"a": ids[a:b]})["a"].float().cpu() for a, b in zip(bounds, bounds[1:])])

    def kl(a, b):
        return F.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()

    ids = torch.randint(100, 49000, (2048,), generator=torch.Generator().manual_seed(0)).tolist()
    cuda_model = load_model(smollm2_w4a16_ir, "cuda")
    assert sum(isinstance(m, Layer) for m in cuda_model.modules()) == 8 * 4
    assert {m.backend for m in cuda_model.modules() if isinstance(m, Layer)} == {"mma"}  # llmc's CUDA kernels
    assert "int8" not in weight_bytes(cuda_model) and weight_bytes(cuda_model)["int32"] > 0
    got = logits(cuda_model, ids)
    ref = logits(load_model(smollm2_w4a16_ir, "cpu"), ids)  # llmc's CPU engine: float32 over dequantized weights
    monkeypatch.setenv(CUDA_KERNELS_ENV, "0")
    bf16 = logits(load_model(smollm2_w4a16_ir, "cuda"), ids)  # dequantized to bf16, PyTorch's ops
    kl_int4, kl_bf16 = kl(got, ref), kl(bf16, ref)
    print(f"mean KL vs the CPU engine: CUDA int4 kernels {kl_int4:.2e}, CUDA dequantized bf16 {kl_bf16:.2e}; "
          f"top-1 agreement {(got.argmax(-1) == ref.argmax(-1)).float().mean().item():.3f}")
    assert kl_int4 <= 1.25 * kl_bf16 + 1e-3 and kl_int4 <= 0.02


def test_int4_decode_steps_replayed_from_cuda_graphs_equal_eager(smollm2_w4a16_ir, tmp_path, monkeypatch):
    """Decode steps (int4 layers, the qkv layers' RoPE epilogue included) give the same tokens from graphs as
    eagerly. Prompt chunks stay eager here: in a graph each prompt token attends through the decode kernel, eagerly
    through SDPA, and in bfloat16 the two round differently (test_cuda_graphs.py checks graph-run chunks against
    eager ones in float32)."""
    from llmc.engine.torch.cuda_graphs import CHUNKS_ENV
    from tests.engine.torch.helpers import build_dir_around, graph_and_eager_tokens

    monkeypatch.setenv(CHUNKS_ENV, "0")
    outs = graph_and_eager_tokens(build_dir_around(smollm2_w4a16_ir, tmp_path / "build"))
    assert outs[True] == outs[False]


@pytest.mark.parametrize("rows", [1, 16, 64, 300])
def test_int4_kernels_chained_in_a_cuda_graph_give_the_same_bits_with_and_without_early_launch(rows, monkeypatch):
    """Each int4 kernel's blocks start while the previous kernel finishes (programmatic dependent launch) and wait
    for it before reading its output: a chain of layers, each reading the last one's output, replayed from a CUDA
    graph with fresh inputs, gives the bits of plain launches. At 300 rows each layer dequantizes into the scratch
    that the previous layer's GEMM read (its blocks write only once that GEMM has finished), and a Triton norm
    launched the same way sits between some of them."""
    from llmc.engine.torch import cuda_ext, triton_support
    from llmc.engine.torch.fused_triton import rms_norm

    assert cuda_ext.load() is not None, cuda_ext.status()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    n = k = 4096
    gen = torch.Generator().manual_seed(7)
    scratch = Scratch(torch.bfloat16, torch.device("cuda"))
    layers = []
    for _ in range(6):
        q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
        scales = (torch.rand(n, k // 128, generator=gen) * 0.004 + 0.001).bfloat16()
        pq = (torch.rand(k, generator=gen) + 0.5).bfloat16()
        layers.append(Int4CudaLinear.from_ir([(pack_int4(q).cuda(), scales.cuda())], pq.cuda(), 128, scratch))

    assert (rows >= layers[0].dense_from_m) == (rows == 300)  # 300 rows: dequantize + cuBLAS
    norm_weight = torch.ones(k, dtype=torch.bfloat16, device="cuda")

    def chain(x):  # int4 kernels after a torch kernel, after a Triton kernel and right after each other
        for i, layer in enumerate(layers):
            x = layer(x)
            x = x * 0.5 if i % 3 == 0 else rms_norm(x, norm_weight, 1e-5) if i % 3 == 1 else x
        return x

    inputs = [torch.randn(rows, k, generator=gen).bfloat16().cuda() for _ in range(4)]
    results = {}
    for pdl in ("0", "early", "late", "auto"):
        monkeypatch.setenv(cuda_ext.PDL_ENV, pdl)
        for cached in (cuda_ext.pdl, triton_support.early_launch, triton_support.pdl_launch):
            cached.cache_clear()
        assert triton_support.pdl_launch(torch.device("cuda")) == (pdl != "0")
        static = inputs[0].clone()
        chain(static)  # warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static)
        got = []
        for x in inputs:
            static.copy_(x)
            graph.replay()
            got.append(out.clone())
        results[pdl] = got
    for cached in (cuda_ext.pdl, triton_support.early_launch, triton_support.pdl_launch):
        cached.cache_clear()
    eager = [chain(x) for x in inputs]
    for plain, early, late, auto, ref in zip(results["0"], results["early"], results["late"], results["auto"], eager):
        assert torch.isfinite(plain).all()
        assert torch.equal(plain, early) and torch.equal(plain, late) and torch.equal(plain, auto)
        assert torch.equal(plain, ref)

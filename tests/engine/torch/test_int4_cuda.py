"""The CUDA int4 path's Triton kernels, run on CPU by Triton's interpreter: packing, masking, group scales, input
transforms, the dense (prefill) path, the fused norm/RoPE kernels and a whole W4A16 model against the dequantized
reference. The same kernels on a GPU, at real shapes and speeds: tests/engine/torch/test_int4_cuda_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4, unpack_int4
from llmc.engine.torch import kv_store, triton_support
from llmc.engine.torch.int4_configs import KernelConfig, heuristic_config
from llmc.engine.torch.int4_cuda import Scratch, Int4CudaLinear, silu_mul
from llmc.engine.torch.int4_layout import CHUNK, TILE, pack_for_cuda
from llmc.engine.torch.loader import load_model


# tests/conftest.py turns the interpreter on for the whole session where there is no GPU (it must be on before
# Triton is first imported); on a GPU machine the same checks run on CUDA (test_int4_cuda_gpu.py) instead.
pytestmark = pytest.mark.skipif(not triton_support.interpreting(),
                                reason="a GPU machine: the kernels are tested on CUDA by test_int4_cuda_gpu.py")


def random_linear(n: int, k: int, group: int, dtype: torch.dtype, prequant: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(dtype)
    pq = (torch.rand(k, generator=gen) + 0.5).to(dtype) if prequant else None
    return pack_int4(q), scales, pq


def layer_of(packed, scales, pq, group, silu_output=False):
    """An Int4CudaLinear of the IR tensors; ``silu_output``: rows [0, N/2) are fc, [N/2, N) gate, interleaved as
    the loader does for an MLP."""
    words, scales_t = pack_for_cuda(packed, scales, group)
    if silu_output:
        half = words.shape[1] // 2
        words = torch.stack([words[:, :half], words[:, half:]], dim=2).flatten(1)
        scales_t = torch.stack([scales_t[:, :half], scales_t[:, half:]], dim=2).flatten(1)
    k = packed.shape[1]
    scratch = Scratch(scales.dtype, torch.device("cpu"))
    scratch.reserve(partials=16 * 64 * packed.shape[0] * 2, counters=1024)  # room for the explicit configs below
    return Int4CudaLinear(words, scales_t, pq, k, group, scratch, silu_output=silu_output)


def reference(x, packed, scales, pq, group, silu_output):
    """float64 product over the dequantized weight (q * scale * prequant); silu(fc) * gate of its two halves."""
    k = packed.shape[1]
    weight = dequantize_w4a16(packed, scales, pq if pq is not None else torch.ones(k), group).double()
    y = x.double() @ weight.T
    if silu_output:
        half = y.shape[1] // 2
        y = F.silu(y[:, :half]) * y[:, half:]
    return y


def test_pack_for_cuda_puts_input_128t_16j_i_in_nibble_j_of_word_16t_i():
    packed, scales, _ = random_linear(40, 576, 64, torch.float16, False)
    words, scales_t = pack_for_cuda(packed, scales, 64)
    q = unpack_int4(packed)  # [N, K]
    assert words.shape == (5 * TILE // 8, 40) and words.dtype == torch.int32  # K = 576 -> 5 tiles of 128
    assert torch.equal(scales_t, scales.t())
    for k in (0, 15, 16, 127, 128, 300, 575):
        t, j, i = k // TILE, (k % TILE) // CHUNK, k % CHUNK
        nibble = (words[16 * t + i] >> (4 * j)) & 0xF
        assert torch.equal(nibble - 8, q[:, k].to(torch.int32)), k
    pad = (words[16 * 4 + 3] >> (4 * 7)) & 0xF  # input 4*128 + 7*16 + 3 = 627 > K: q = 0
    assert torch.equal(pad, torch.full_like(pad, 8))


CASES = [  # n, k, group, rows, dtype, prequant, silu_output, config
    (96, 256, 128, 1, torch.bfloat16, False, False, KernelConfig(16, 32, 1, 4, 2)),
    (80, 576, 64, 3, torch.float16, True, False, KernelConfig(16, 32, 2, 4, 3)),  # K and N not tile multiples
    (64, 384, 64, 17, torch.bfloat16, False, True, KernelConfig(32, 16, 2, 4, 2)),
    (48, 256, 128, 20, torch.float32, True, False, KernelConfig(16, 16, 1, 4, 2)),
    (128, 256, 64, 64, torch.float16, False, False, KernelConfig(64, 64, 2, 4, 3)),
    (128, 64, 64, 3, torch.float16, False, False, KernelConfig(16, 32, 1, 4, 3)),  # K < 128: half a tile is pad
    # split-K: 5 tiles in splits of 2 (the last split has one tile: masked), partials summed by the last arrival
    (80, 576, 64, 5, torch.float16, True, False, KernelConfig(16, 32, 1, 4, 3, 3)),
    (64, 512, 128, 2, torch.bfloat16, False, True, KernelConfig(16, 32, 2, 4, 3, 2)),  # even split, unrolled
]


@pytest.mark.parametrize("n,k,group,rows,dtype,prequant,silu_output,config", CASES)
def test_kernel_matches_the_dequantized_product(n, k, group, rows, dtype, prequant, silu_output, config):
    packed, scales, pq = random_linear(n, k, group, dtype, prequant)
    layer = layer_of(packed, scales, pq, group, silu_output)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = reference(x, packed, scales, pq, group, silu_output)
    got = layer.matmul(x, config)
    assert got.dtype == dtype and got.shape == (rows, n // 2 if silu_output else n)
    rel = ((got.double() - expected).norm() / expected.norm()).item()
    # The kernel's arithmetic is exact up to the input transform's rounding to the activations' dtype and the
    # output rounding: a bf16 result's relative error is ~2^-9.
    bound = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    assert rel < bound, rel


def test_every_output_element_is_written():
    packed, scales, _ = random_linear(80, 576, 64, torch.float16, False)
    layer = layer_of(packed, scales, None, 64)
    x = torch.randn(5, 576).half()
    got = layer.matmul(x, KernelConfig(16, 32, 2, 4, 2))  # 80 = 2.5 blocks of 32: the last one is masked
    assert torch.isfinite(got).all() and (got != 0).float().mean() > 0.99
    split = layer.matmul(x, KernelConfig(16, 32, 1, 4, 2, 4))
    assert torch.isfinite(split).all() and (split != 0).float().mean() > 0.99
    assert not layer.scratch.buffer("counters", 0).any()  # every last arrival reset its counter


@pytest.mark.parametrize("silu_output", [False, True])
def test_dense_path_and_layer_dispatch(silu_output):
    packed, scales, pq = random_linear(96, 256, 64, torch.float16, True)
    layer = layer_of(packed, scales, pq, 64, silu_output)
    if not silu_output:
        weight = layer.dequantize(torch.empty(256, 96, dtype=torch.float16))
        assert torch.allclose(weight.float(), dequantize_w4a16(packed, scales, pq, 64).T.float(), rtol=1e-3,
                              atol=1e-6)
    layer.dense_from_m = 4
    x = torch.randn(6, 256).half()
    expected = reference(x, packed, scales, pq, 64, silu_output)
    for rows in (3, 6):  # below: the int4 kernel; at or above: dequantize + matmul
        got = layer(x[:rows])
        assert ((got.double() - expected[:rows]).norm() / expected[:rows].norm()) < 2e-3


@pytest.mark.parametrize("n,k,group", [(3072, 576, 64), (6144, 4096, 128), (4096, 14336, 128)])
def test_untuned_layers_reserve_split_k_room_for_every_row_count(n, k, group):
    """Without tuned buckets (a GPU the table does not name: an H100, 2026-12-05) every row count takes the
    heuristic config, whose split-K varies with the rows: the shared buffers must hold the largest (they were sized
    at dense_from_m - 1 rows only, where nothing splits, and 1-row steps failed)."""
    scratch = Scratch(torch.bfloat16, torch.device("cpu"))
    words = torch.zeros(k // 8, n, dtype=torch.int32)
    layer = Int4CudaLinear(words, torch.ones(k // group, n, dtype=torch.bfloat16), None, k, group, scratch)
    assert not layer._buckets  # nothing tuned for "cpu": the heuristic for every row count
    splits = {layer.config_for(m).split_k for m in range(1, layer.dense_from_m)}
    assert max(splits) > 1
    for m in range(1, layer.dense_from_m):
        config = layer.config_for(m)
        assert config.workspace(m, n) <= scratch.sizes["partials"]
        if config.split_k > 1:
            assert config.grid(m, n)[0] * config.grid(m, n)[1] <= scratch.sizes["counters"]


def test_silu_mul_kernel_plain_and_interleaved():
    x = torch.randn(5, 2 * 300)
    assert torch.allclose(silu_mul(x), F.silu(x[:, :300]) * x[:, 300:], atol=1e-6)
    assert torch.allclose(silu_mul(x, interleaved=True), F.silu(x[:, 0::2]) * x[:, 1::2], atol=1e-6)


def test_heuristic_config_pads_rows_and_splits_narrow_layers():
    assert heuristic_config(1, 4096).block_m == 16 and heuristic_config(40, 4096).block_m == 64
    assert heuristic_config(200, 4096).block_m == 64 and heuristic_config(1, 576).block_n <= 32
    narrow, wide = heuristic_config(1, 4096, 14336), heuristic_config(1, 28672, 4096)
    assert narrow.split_k > 1 and narrow.grid(1, 4096)[0] * narrow.split_k <= 2 * 4 * 132
    assert wide.split_k == 1  # 896 column blocks already fill the GPU
    assert heuristic_config(1, 4096, 256).split_k == 1  # two tiles: nothing to split


def test_fused_norm_and_rope_kernels_match_the_reference_ops():
    from llmc.engine.torch import fused_triton
    from llmc.engine.torch.layers import RMSNorm
    from llmc.engine.torch.rope import apply_rope, rope_cos_sin, rope_inv_freq

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 64, generator=gen).bfloat16()
    a = torch.randn(3, 64, generator=gen).bfloat16()
    norm = RMSNorm(64, 1e-5, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    expected_h = h + a
    expected = norm(expected_h)
    h_fused = h.clone()
    got = fused_triton.add_rms_norm_(h_fused, a, norm.weight, 1e-5)
    # The residual stream is updated in place, rounded like h + a (within one bf16 step: the interpreter's
    # float32 -> bfloat16 cast truncates, the GPU's rounds to nearest; the gpu test checks equality).
    one_step = 2 ** -7 * expected_h.float().abs()
    assert ((h_fused.float() - expected_h.float()).abs() <= one_step).all() and not torch.equal(h_fused, h)
    assert (got.float() - expected.float()).abs().max() <= 2 ** -6 * expected.float().abs().max()
    plain = fused_triton.rms_norm(h, norm.weight, 1e-5)
    assert (plain.float() - norm(h).float()).abs().max() <= 2 ** -6 * norm(h).float().abs().max()

    nh, nkv, hd, t = 4, 2, 16, 5
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen).bfloat16()
    cos, sin = rope_cos_sin(rope_inv_freq(hd, 10000.0, None), torch.tensor([0, 3, 9, 10, 40]), torch.bfloat16)
    k_cache = torch.zeros(4, 8, nkv, hd, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 9, 17, 18, 31])
    rows = torch.zeros(t, 4, dtype=torch.int64)
    rows[:, 2] = slots  # as in the CUDA graphs' static rows: the slots are a strided column
    q = fused_triton.rope_write_kv(qkv, cos, sin, k_cache, v_cache, rows[:, 2], nh, nkv, hd)
    qk = apply_rope(qkv[:, : (nh + nkv) * hd].view(t, nh + nkv, hd), cos, sin)
    close = dict(atol=2e-2, rtol=1e-2)  # one rounding of bf16 results vs the reference's three
    assert torch.allclose(q.float(), qk[:, :nh].float(), **close)
    flat_k, flat_v = k_cache.view(-1, nkv, hd), v_cache.view(-1, nkv, hd)
    assert torch.allclose(flat_k[slots].float(), qk[:, nh:].float(), **close)
    assert torch.equal(flat_v[slots], qkv[:, (nh + nkv) * hd:].view(t, nkv, hd))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    # Prefill steps also take the rotated keys back (the attention of a fresh prompt reads them, not the cache).
    k_cache2, v_cache2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    q2, k2 = fused_triton.rope_write_kv(qkv, cos, sin, k_cache2, v_cache2, slots, nh, nkv, hd, return_k=True)
    assert torch.equal(q2, q) and k2.shape == (t, nkv, hd) and k2.dtype == qkv.dtype
    assert torch.equal(k2, k_cache2.view(-1, nkv, hd)[slots]) and torch.equal(k_cache2, k_cache)
    assert torch.allclose(k2.float(), qk[:, nh:].float(), **close) and torch.equal(v_cache2, v_cache)


@pytest.fixture(scope="module")
def tiny_w4a16_ir(tiny_hf_dir, tmp_path_factory):
    from tests.engine.torch.helpers import rtn_quantize_hf, write_ir

    quantized, _ = rtn_quantize_hf(tiny_hf_dir, group_size=64)
    return write_ir(tiny_hf_dir, tmp_path_factory.mktemp("w4a16") / "ir", dtype="bfloat16", quantized=quantized,
                    group_size=64)


def test_whole_int4_model_matches_the_dequantized_model(tiny_w4a16_ir):
    """The Triton path (packed layers, folded prequant, fused kernels) vs the dequantized bf16 model on the same IR,
    through prefill chunks and decode steps of the paged cache."""
    from llmc.engine.torch.int4_cuda import Int4CudaLinear as Layer
    from tests.engine.torch.helpers import PagedSession

    fast = load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True)  # Triton's interpreter
    layers = [m for m in fast.modules() if isinstance(m, Layer)]
    assert len(layers) == 2 * 4 and fast.cuda_fused  # qkv, dense, fc + gate interleaved, proj
    assert sum(m.silu_output for m in layers) == 2  # fc + gate return silu(fc) * gate [T, 128]
    assert not any(isinstance(m, torch.nn.Linear) for m in fast.transformer.layers.modules())
    unfolded = load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, fold_prequant=False, triton_on_cpu=True)
    reference_model = load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, cuda_kernels=False)
    ids = list(range(300, 321))

    def run(model):
        session = PagedSession(model, block_size=16, num_blocks=16)
        out = [session.step({"a": ids[:12]})["a"], session.step({"a": ids[12:18]})["a"]]
        out += [session.step({"a": [t]})["a"] for t in ids[18:20]]  # decode steps: fused RoPE + KV write
        # A mixed step: "a" decodes while "b" prefills from scratch, then "b" continues over its cache.
        mixed = session.step({"a": [ids[20]], "b": ids[3:10]})
        out += [mixed["a"], mixed["b"], session.step({"b": ids[10:14], "a": [ids[0]]})["b"]]
        return torch.cat(out).float()

    ref, got, got_unfolded = run(reference_model), run(fast), run(unfolded)
    scale = ref.abs().max()
    assert (got - ref).abs().max() < 0.05 * scale
    assert (got_unfolded - ref).abs().max() < 0.05 * scale
    assert (got - got_unfolded).abs().max() < 0.05 * scale  # folding the prequant into the norms changes rounding only


def _chunk_decodes_mixed(model, decodes: int, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits of a 9-token prompt chunk, ``decodes`` decode steps and a mixed step (a decode and a new prompt) of
    ``model`` over a paged cache (of ``kv_dtype``, default the model's)."""
    from llmc.engine.torch.kv_alloc import allocate_kv_cache
    from tests.engine.torch.helpers import PagedSession

    ids = list(range(300, 316))
    session = PagedSession(model, block_size=16, num_blocks=8)
    if kv_dtype is not None:
        session.kv = allocate_kv_cache(model.config, 8, 16, kv_dtype, torch.device("cpu"))
    out = [session.step({"a": ids[:9]})["a"]]
    out += [session.step({"a": [t]})["a"] for t in ids[9:9 + decodes]]  # decode steps
    out += [session.step({"a": [ids[12]], "b": ids[:5]})["a"]]  # a mixed step
    return torch.cat(out)


def test_decode_steps_take_q_from_the_qkv_layers_rope_epilogue_where_it_applies(tiny_w4a16_ir):
    """The model's decode path asks the qkv layer for its RoPE + KV-write epilogue (CUDA's mma layers have one) and
    runs the product and the rope kernel only when the layer says it does not apply; prompt chunks never ask. Here
    each layer's epilogue is stood in for by those two steps, so the results must not change."""
    from llmc.engine.torch import fused_triton

    def run(model):
        return _chunk_decodes_mixed(model, decodes=3)

    plain = load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True)
    ref = run(plain)
    model = load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True)
    calls = []
    for layer in model.transformer.layers:
        qkv = layer.attention.qkv

        def epilogue(x, cos, sin, k_cache, v_cache, slots, nh, nkv, qkv=qkv):
            calls.append(x.shape[0])
            return fused_triton.rope_write_kv(qkv(x), cos, sin, k_cache, v_cache, slots, nh, nkv,
                                              k_cache.shape[-1])

        qkv.rope_write_kv = epilogue
    assert torch.equal(run(model), ref)
    assert calls == [1] * (3 * len(model.transformer.layers))  # the three decode steps, every layer once


def test_an_fp8_cache_is_stored_by_the_rope_kernel_not_the_epilogue(tiny_w4a16_ir):
    """The qkv layer's epilogue writes 16 bits, so with an fp8 cache the decode steps do not ask it and the rope
    kernel stores the keys and values; with a 16-bit cache the same steps ask it (the stand-in is live)."""
    model = load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True)
    calls = []
    for layer in model.transformer.layers:  # the epilogue asked, and saying it does not apply (the rope kernel runs)
        layer.attention.qkv.rope_write_kv = lambda *args: calls.append(args[3].dtype)
    fp8 = _chunk_decodes_mixed(model, decodes=2, kv_dtype=kv_store.FP8)
    assert calls == [] and torch.isfinite(fp8).all()
    _chunk_decodes_mixed(model, decodes=2, kv_dtype=torch.bfloat16)
    assert calls == [torch.bfloat16] * (2 * len(model.transformer.layers))


def test_the_fused_decoder_leaves_norms_pending_where_o_and_down_offer_it(tiny_w4a16_ir):
    """After each o and down projection the fused decoder asks the layer to add its product to the residual stream
    and leave the norm pending (CUDA's mma layers: ``add_residual``), and runs the product then the fused add +
    norm kernel only where the layer returns None; a pending norm is finished by the next int4 layer or computed
    first (here: the Triton layers compute it; the last layer's before the logits). Stood in for by the add kernel
    with the norm left pending (and by None for every other layer): the results must not change, and every step
    (prompt chunk, decodes, mixed) asks every o and down layer once."""
    from llmc.engine.torch import fused_triton
    from llmc.engine.torch.pending_norm import PendingNorm

    def run(model):
        return _chunk_decodes_mixed(model, decodes=2)

    ref = run(load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True))
    model = load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True)
    calls, pending = [], []
    for i, layer in enumerate(model.transformer.layers):
        for name, linear in (("o", layer.attention.dense), ("down", layer.mlp.proj)):
            def add(x, h, weight, eps, linear=linear, name=name, offer=(i + len(name)) % 2 == 0):
                calls.append((name, x.shape[0]))
                if not offer:
                    return None
                fused_triton.add_rms_norm_(h, linear(x), weight, eps)  # the add, rounded as the kernel rounds it
                pending.append(PendingNorm(h, h * weight, torch.empty(0), 1, weight, eps))
                return pending[-1]

            linear.add_residual = add
    assert torch.equal(run(model), ref)
    steps = [9, 1, 1, 6]
    assert calls == [(name, rows) for rows in steps for _ in model.transformer.layers for name in ("o", "down")]
    assert len(pending) == len(calls) // 2


def test_norm_epilogue_rows_come_from_the_environment(monkeypatch):
    from llmc.engine.torch.pending_norm import NORM_EPILOGUE_ENV, NORM_EPILOGUE_ROWS_DEFAULT, norm_epilogue_rows

    monkeypatch.delenv(NORM_EPILOGUE_ENV, raising=False)
    assert norm_epilogue_rows() == NORM_EPILOGUE_ROWS_DEFAULT == 8
    for value, rows in (("16", 16), (" 8 ", 8), ("0", 0), ("off", 0), ("false", 0)):
        monkeypatch.setenv(NORM_EPILOGUE_ENV, value)
        assert norm_epilogue_rows() == rows, value
    monkeypatch.setenv(NORM_EPILOGUE_ENV, "sixteen")
    with pytest.raises(ValueError, match="LLMC_NORM_EPILOGUE='sixteen': give a row count"):
        norm_epilogue_rows()


def test_triton_layers_leave_no_norm_pending_and_take_pending_norms_computed(tiny_w4a16_ir):
    """The Triton fallback (and so Triton's interpreter on CPU) has neither the add epilogue nor the input norm: it
    says None to ``add_residual`` and computes a pending norm before its product."""
    from llmc.engine.torch import fused_triton
    from llmc.engine.torch.pending_norm import PendingNorm

    model = load_model(tiny_w4a16_ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True)
    layer = model.transformer.layers[0]
    dense, qkv = layer.attention.dense, layer.attention.qkv
    x, h = torch.randn(2, dense.in_features).bfloat16(), torch.randn(2, dense.out_features).bfloat16()
    weight = layer.post_layernorm.weight
    assert dense.backend == "triton" and dense.add_residual(x, h, weight, 1e-5) is None
    pending = PendingNorm(h, h * weight, torch.empty(0), 1, weight, 1e-5)
    assert torch.equal(qkv(pending), qkv(fused_triton.rms_norm(h, weight, 1e-5)))

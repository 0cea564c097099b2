"""The mma int4 layout (llmc/engine/torch/csrc_cuda/w4a16_mma.cu) checked on CPU: ``int4_layout.pack_mma`` against
the documented nibble order, its inverse, the fc + gate and per-head (RoPE) tile interleaves, and an emulation of
the kernel's lanes and mma fragments (PTX's m16n8k16 operand layouts) that must reproduce the product over the
dequantized weight. The kernel itself runs on a GPU in tests/engine/torch/test_int4_cuda_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from llmc.checkpoint.int4 import pack_int4
from llmc.engine.torch.int4_configs import (CONFIG_FILE, MMA_MAX_BLOCK, MMA_MAX_RING, TABLE_VERSION,
                                            heuristic_mma_config, mma_configs, mma_fits, mma_smem_bytes,
                                            register_depth)
from llmc.engine.torch.int4_cuda import Int4CudaLinear, Scratch, choose_backend
from llmc.engine.torch.int4_layout import interleave_tiles, mma_supported, pack_mma, unpack_mma
from llmc.errors import CheckpointError


def random_q(n, k, group, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(dtype)
    return q, scales


def test_pack_mma_puts_each_value_where_the_layout_says():
    q, scales = random_q(32, 128, 64)
    words, pairs = pack_mma(q, scales, 64)
    assert words.shape == (2, 2, 32, 4) and words.dtype == torch.int32
    assert pairs.shape == (2, 2, 8) and pairs.dtype == torch.int32
    for nt, kt, lane, s, j in [(0, 0, 0, 0, 0), (1, 1, 31, 3, 7), (0, 1, 13, 2, 5), (1, 0, 6, 1, 2), (1, 1, 22, 0, 6)]:
        g, t = lane // 4, lane % 4
        col = 16 * nt + g + 8 * (j & 1)
        inp = 64 * kt + 16 * t + 4 * s + 2 * ((j >> 1) & 1) + (j >> 2)
        nibble = (int(words[nt, kt, lane, s]) >> (4 * j)) & 0xF
        assert nibble == int(q[col, inp]) + 8, (nt, kt, lane, s, j)
    q, scales = random_q(48, 128, 64)  # three column tiles, two groups: the two axes of the pairs differ
    pairs = pack_mma(q, scales, 64)[1]
    assert pairs.shape == (3, 2, 8)
    raw = pairs.view(torch.bfloat16).view(3, 2, 8, 2)  # [nt, group, g, (col g, col g + 8)]: a tile's scales together
    for nt, grp, g in [(2, 1, 3), (1, 0, 5), (0, 1, 7), (2, 0, 0)]:
        assert torch.equal(raw[nt, grp, g], torch.stack([scales[16 * nt + g, grp], scales[16 * nt + g + 8, grp]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unpack_mma_inverts_pack_mma(dtype):
    q, scales = random_q(48, 576, 64, dtype)
    q2, scales2 = unpack_mma(*pack_mma(q, scales, 64), 64, dtype)
    assert torch.equal(q2, q) and torch.equal(scales2, scales)


def test_interleave_tiles_puts_fc_and_gate_of_a_feature_in_columns_c_and_c_plus_8():
    fc, gate = torch.arange(16).view(16, 1), 100 + torch.arange(16).view(16, 1)
    both = interleave_tiles(fc, gate).flatten().tolist()
    assert both[:16] == list(range(8)) + list(range(100, 108))
    assert both[16:] == list(range(8, 16)) + list(range(108, 116))


def test_pack_mma_refuses_shapes_without_whole_tiles():
    assert mma_supported(960, 576, 64) and not mma_supported(1000, 4096, 128) and not mma_supported(64, 96, 32)
    q, scales = random_q(40, 128, 64)
    with pytest.raises(CheckpointError, match="16s"):
        pack_mma(q, scales, 64)


def test_backend_choice_without_a_gpu_is_triton():
    assert choose_backend(4096, 4096, 128, torch.bfloat16, torch.device("cpu")) == "triton"
    assert heuristic_mma_config(1, 4096, 4096) == (1, 2, 8, 4) and heuristic_mma_config(16, 28672, 4096) == (2, 4, 8, 4)
    assert heuristic_mma_config(40, 960, 576) == (4, 2, 8, 4) and heuristic_mma_config(40, 976, 576)[1] == 1
    assert all(config in mma_configs() for config in (heuristic_mma_config(m, n, 4096) for m in (1, 9, 17, 64)
                                                      for n in (976, 4096, 28672)))


def test_mma_shared_memory_follows_the_ring_and_the_input_scale():
    # a slot: 4 column tiles x (32 weight + 8 scale) uint4 + 2 row tiles x 64 uint4 of activations; 8 warps x 4 slots
    assert mma_smem_bytes((2, 4, 8, 4)) == 8 * 4 * (4 * 40 + 2 * 64) * 16
    assert mma_smem_bytes((2, 4, 8, 4), k=14336, prequant=True) == mma_smem_bytes((2, 4, 8, 4)) + 2 * 14336
    assert mma_smem_bytes((4, 4, 4, 2)) == 4 * 2 * (4 * 40 + 4 * 64) * 16  # the partial sums (32 KB) fit in the ring
    assert all(mma_smem_bytes(c) <= MMA_MAX_RING for c in mma_configs()) and (4, 4, 8, 4) not in mma_configs()
    # K = 32768: the input scale (64 KB) no longer fits behind a 172 KB ring
    assert mma_fits((4, 2, 8, 4), 8192, 14336, True) and not mma_fits((4, 2, 8, 4), 8192, 32768, True)
    assert mma_fits((4, 2, 8, 4), 8192, 32768, False) and not mma_fits((1, 4, 8, 4), 4096 + 16, 4096, False)
    fallback = heuristic_mma_config(40, 8192, 32768, prequant=True)
    assert fallback == (4, 2, 8, 2) and mma_smem_bytes(fallback, 32768, True) <= MMA_MAX_BLOCK


def test_register_kernel_depth_and_shared_memory_follow_the_rows_and_the_chunk():
    """The register kernel (stages 0) holds each warp's share of the input tiles, rounded up to a power of two and
    capped by registers, and stages the block's rows of one chunk of activations (16 bytes of padding a row)."""
    assert register_depth(4096, 8, 1) == 8 and register_depth(576, 8, 1) == 2  # 64 and 9 input tiles
    assert register_depth(14336, 8, 1) == 16 and register_depth(14336, 16, 1) == 8  # 224 tiles: capped, chunks
    assert register_depth(4096, 8, 4) == 4 and register_depth(4096, 16, 2) == 4
    assert {c for c in mma_configs() if c[3] == 0} == {(mt, nt, w, 0) for mt in (1, 2) for nt in (1, 2, 4)
                                                       for w in (4, 8, 16)}
    assert mma_smem_bytes((1, 1, 8, 0), 4096, rows=1) == (4096 + 8) * 2  # one row of 4,096 inputs
    assert mma_smem_bytes((1, 1, 8, 0), 4096) == 8 * (4096 + 8) * 2  # any row count: a full row tile
    assert mma_smem_bytes((1, 1, 8, 0), 4096, prequant=True, rows=1) == (4096 + 8) * 2  # applied while staging
    assert mma_smem_bytes((1, 4, 16, 0), 64, rows=1) == 16 * 4 * 4 * 32 * 4  # the partial sums are larger
    # down (K = 14336) with 16 rows: a chunk of 128 tiles is 16 x 8,200 x 2 bytes, more than a block may have
    assert mma_smem_bytes((2, 1, 8, 0), 14336, rows=16) == 16 * (128 * 64 + 8) * 2 > MMA_MAX_BLOCK
    assert mma_fits((2, 1, 8, 0), 4096, 14336, True, rows=3) and not mma_fits((2, 1, 8, 0), 4096, 14336, True, 16)
    assert not mma_fits((2, 1, 8, 0), 4096, 14336, True)  # None: whatever the row count


def zero_mma_layer(n: int, k: int) -> Int4CudaLinear:
    """An mma layer of ``n`` columns x ``k`` inputs (group 128, with an input scale) on the CPU, for config choices."""
    words = torch.zeros(n // 16, k // 64, 32, 4, dtype=torch.int32)
    scales = torch.zeros(n // 16, k // 128, 8, dtype=torch.int32)
    return Int4CudaLinear(words, scales, torch.ones(k, dtype=torch.bfloat16), k, 128,
                          Scratch(torch.bfloat16, torch.device("cpu")), backend="mma")


def test_a_register_config_is_taken_at_the_row_counts_it_fits():
    n, k = 4096, 14336
    layer = zero_mma_layer(n, k)
    layer._mma_buckets = [(16, (2, 1, 8, 0))]
    assert layer.mma_config_for(3) == (2, 1, 8, 0)
    assert layer.mma_config_for(16) == heuristic_mma_config(16, n, k, prequant=True)


def test_rows_past_the_last_bucket_take_its_config_as_the_tuner_timed_them():
    """The tuner picks ``dense_from_m`` by timing each row count against the config of the bucket that holds it, the
    last bucket's past the table (``tune_family``); the layer runs the same config there, not the heuristic."""
    layer = zero_mma_layer(4096, 14336)
    layer._mma_buckets = [(8, (1, 2, 16, 4)), (64, (4, 4, 8, 2)), (128, (4, 2, 8, 4))]
    layer.dense_from_m = 192
    assert [layer.mma_config_for(m) for m in (8, 9, 65, 128, 129, 191)] == [
        (1, 2, 16, 4), (4, 4, 8, 2), (4, 2, 8, 4), (4, 2, 8, 4), (4, 2, 8, 4), (4, 2, 8, 4)]
    layer._mma_buckets, layer._mma_chosen = [], {}  # no tuned entry: the heuristic everywhere
    assert layer.mma_config_for(150) == heuristic_mma_config(150, 4096, 14336, prequant=True)


def test_a_split_k_config_in_the_last_bucket_reserves_its_buffers_up_to_dense_from_m(monkeypatch):
    table = {"mma": {"buckets": [[64, 4, 4, 8, 2], [128, 8, 8, 8, -44]], "dense_from_m": 192}}
    monkeypatch.setattr("llmc.engine.torch.int4_cuda.tuned_entry", lambda *args: table)
    layer = zero_mma_layer(4096, 14336)
    layer._sm90 = True  # as on an H200 (on this CPU the warpgroup configs give way to the heuristic)
    assert layer.mma_config_for(191) == (8, 8, 8, -44)
    # 191 rows: 3 row blocks of 64, 4 splits, 4096 columns; 3 x 32 tiles of 128 columns
    assert layer.scratch.sizes["partials"] == 4 * 192 * 4096 and layer.scratch.sizes["counters"] == 96


def test_a_borrowed_split_k_config_that_does_not_fit_the_shape_reserves_no_buffer(monkeypatch):
    table = {"mma": {"buckets": [[128, 8, 8, 8, -44]], "dense_from_m": 192}, "mma_from": "4096x14336g128"}
    monkeypatch.setattr("llmc.engine.torch.int4_cuda.tuned_entry", lambda *args: table)
    layer = zero_mma_layer(4112, 14336)  # 257 column tiles of 16: not a multiple of the config's 8
    layer._sm90 = True
    assert layer.mma_config_for(100) != (8, 8, 8, -44)
    assert layer.scratch.sizes["partials"] == 0 and layer.scratch.sizes["counters"] == 0


def test_each_int4_layer_says_whose_configs_it_runs(monkeypatch):
    from llmc.engine.torch.int4_install import config_sources

    tuned = {"mma": {"buckets": [[1, 1, 2, 16, 2]], "dense_from_m": 160}, "mma_gpu": "NVIDIA H200"}
    borrowed = {**tuned, "mma_from": "4096x14336g128"}
    here = {**tuned, "mma_table": "llmc tune's table"}
    sources = {}
    for entry, n in ((tuned, 4096), (borrowed, 3584), (None, 2048), (here, 1024)):
        monkeypatch.setattr("llmc.engine.torch.int4_cuda.tuned_entry", lambda *args, entry=entry: entry)
        sources[n] = zero_mma_layer(n, 14336)
    assert config_sources(torch.nn.ModuleList(sources.values())) == {
        "4096x14336g128": "NVIDIA H200", "3584x14336g128": "NVIDIA H200, shape 4096x14336g128",
        "2048x14336g128": "heuristics", "1024x14336g128": "NVIDIA H200 (llmc tune's table)"}
    assert config_sources(torch.nn.Linear(4, 4)) == {}


def test_a_tuned_mma_config_that_does_not_fit_the_layer_gives_way_to_the_heuristic():
    layer = zero_mma_layer(8192, 32768)
    layer._mma_buckets = [(64, (4, 2, 8, 4))]  # fits without the input scale, not with this one
    assert layer.mma_config_for(40) == (4, 2, 8, 2)
    layer._mma_buckets, layer._mma_chosen = [(64, (2, 2, 8, 4))], {}
    assert layer.mma_config_for(40) == (2, 2, 8, 4)


def emulate_kernel(x, words, pairs, prequant, n, k, group, silu, exact=False):
    """The CUDA kernel's arithmetic, lane by lane: A fragments from each word as the kernel decodes them (``base + u``),
    B fragments from the activations as it loads them, PTX's m16n8k16 fragment layouts, each tile's accumulator
    started at ``-(base + 8) * sum(x)`` by an mma with a constant A, the group scale applied once per tile, and the
    epilogue's indexing. ``exact`` (configs of several row tiles): each A register made ``(base + u) - (base + 8)``
    in 16 bits and no constant-A mma."""
    dtype, rows = x.dtype, x.shape[0]
    base = 128.0 if dtype == torch.bfloat16 else 1024.0  # magic | nibble read as a 16-bit float
    xs = x if prequant is None else (x.float() * prequant.float()).to(dtype)  # rounded once, as hmul2
    ntiles, ktiles = n // 16, k // 64
    mtiles = -(-rows // 8)
    xpad = torch.zeros(mtiles * 8, k, dtype=dtype)
    xpad[:rows] = xs
    s_all = pairs.view(dtype).view(ntiles, k // group, 8, 2)
    acc = torch.zeros(ntiles, mtiles, 32, 4, dtype=torch.float64)  # per lane: c0..c3
    for nt in range(ntiles):
        for kt in range(ktiles):
            s_pair = s_all[nt, (kt * 64) // group]  # [g, 2]
            tile_sum = torch.zeros(mtiles, 16, 8, dtype=torch.float64)  # [mt, column, row] of the mma's D
            for s in range(4):
                a = torch.zeros(16, 16, dtype=torch.float64)  # A [16 columns, 16 mma-k]
                b = torch.zeros(mtiles, 16, 8, dtype=torch.float64)  # B [16 mma-k, 8 rows]
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    word = int(words[nt, kt, lane, s]) & 0xFFFFFFFF
                    regs = []
                    for i in range(4):  # (word >> 4i) & 0x000F000F | magic: nibbles i (low half) and i + 4 (high half)
                        lo, hi = (word >> (4 * i)) & 0xF, (word >> (4 * i + 16)) & 0xF
                        pair = torch.tensor([base + lo, base + hi], dtype=dtype)  # magic | nibble
                        if exact:  # hsub2: a 16-bit subtraction, rounded (exact for these values)
                            pair = pair - torch.tensor([base + 8.0, base + 8.0], dtype=dtype)
                        regs.append(pair.double())
                    a[g, 2 * t: 2 * t + 2] = regs[0]
                    a[g + 8, 2 * t: 2 * t + 2] = regs[1]
                    a[g, 2 * t + 8: 2 * t + 10] = regs[2]
                    a[g + 8, 2 * t + 8: 2 * t + 10] = regs[3]
                    for mt in range(mtiles):
                        chunk = xpad[8 * mt + g, 64 * kt + 16 * t: 64 * kt + 16 * t + 16].double()  # two uint4
                        word_index = 4 * (s >> 1) + 2 * (s & 1)  # b0 = .x / .z of xv[s >> 1], b1 = .y / .w
                        b[mt, 2 * t: 2 * t + 2, g] = chunk[2 * word_index: 2 * word_index + 2]
                        b[mt, 2 * t + 8: 2 * t + 10, g] = chunk[2 * word_index + 2: 2 * word_index + 4]
                offset = torch.full((16, 16), -(base + 8.0), dtype=torch.float64)  # the start's constant A
                for mt in range(mtiles):
                    tile_sum[mt] += a @ b[mt] if exact else offset @ b[mt] + a @ b[mt]  # [16 columns, 8 rows]
            for mt in range(mtiles):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    c = tile_sum[mt]
                    sums = torch.stack([c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]])
                    scale = torch.stack([s_pair[g, 0], s_pair[g, 0], s_pair[g, 1], s_pair[g, 1]]).double()
                    acc[nt, mt, lane] += scale * sums  # columns g, g, g + 8, g + 8
    out = torch.zeros(rows, n // 2 if silu else n, dtype=torch.float64)
    for nt in range(ntiles):
        for mt in range(mtiles):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for i in range(4):
                    r = 8 * mt + 2 * t + (i & 1)
                    if r >= rows:
                        continue
                    if silu and i < 2:
                        fc, gate = acc[nt, mt, lane, i], acc[nt, mt, lane, i + 2]
                        out[r, 8 * nt + g] = F.silu(fc) * gate
                    elif not silu:
                        out[r, 16 * nt + g + 8 * (i >> 1)] = acc[nt, mt, lane, i]
    return out


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("silu,prequant,group", [(False, False, 64), (False, True, 128), (True, False, 64)])
def test_kernel_emulation_over_the_packed_layout_equals_the_unrounded_dequantized_product(silu, prequant, group,
                                                                                        exact):
    dtype, n, k, rows = torch.bfloat16, 32, 128, 11
    gen = torch.Generator().manual_seed(1)
    q, scales = random_q(n, k, group, dtype, seed=2)
    pq = (torch.rand(k, generator=gen) + 0.5).to(dtype) if prequant else None
    x = torch.randn(rows, k, generator=gen).to(dtype)
    if silu:
        words, pairs = pack_mma(interleave_tiles(q[: n // 2], q[n // 2:]),
                                interleave_tiles(scales[: n // 2], scales[n // 2:]), group)
    else:
        words, pairs = pack_mma(q, scales, group)
    got = emulate_kernel(x, words, pairs, pq, n, k, group, silu, exact)
    weight = q.double() * scales.double().repeat_interleave(group, dim=1)  # q * s, never rounded
    xs = x if pq is None else (x.float() * pq.float()).to(dtype)
    ref = xs.double() @ weight.T
    if silu:
        ref = F.silu(ref[:, : n // 2]) * ref[:, n // 2:]
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9)


def test_from_ir_packs_fc_and_gate_for_the_triton_kernels_on_cpu():
    q, scales = random_q(32, 128, 64)
    parts = [(pack_int4(q[:16]), scales[:16]), (pack_int4(q[16:]), scales[16:])]
    layer = Int4CudaLinear.from_ir(parts, None, 64, Scratch(torch.bfloat16, torch.device("cpu")), silu_output=True)
    assert layer.backend == "triton" and layer.columns == 32 and layer.out_features == 16
    with pytest.raises(AssertionError):  # fc + gate need both parts
        Int4CudaLinear.from_ir(parts[:1], None, 64, Scratch(torch.bfloat16, torch.device("cpu")), silu_output=True)


def test_a_qkv_layer_packed_for_the_rope_epilogue_holds_both_halves_of_a_rotation_pair_in_one_tile(monkeypatch):
    """rope_head: tile nt of head h (hd / 16 tiles a head) holds dims 8 (nt % (hd / 16)) + c in its columns c < 8 and
    those + hd / 2 in columns c + 8 (the kernel's column_of); the epilogue is used only where it applies."""
    from llmc.engine.torch import int4_cuda
    from llmc.engine.torch.int4_layout import interleave_halves

    nh, nkv, hd, k, group = 2, 1, 32, 64, 64
    n = (nh + 2 * nkv) * hd
    q, scales = random_q(n, k, group)
    cpu = Scratch(torch.bfloat16, torch.device("cpu"))
    layer = Int4CudaLinear.from_ir([(pack_int4(q), scales)], None, group, cpu, backend="mma", rope_head=hd)
    assert layer.rope_head == layer.period == hd
    got_q, got_s = unpack_mma(layer.words, layer.scales, group, torch.bfloat16)
    source = []
    for col in range(n):
        nt, c = divmod(col, 16)
        head, lt = divmod(nt, hd // 16)
        source.append(head * hd + 8 * lt + c % 8 + (hd // 2 if c >= 8 else 0))
    assert sorted(source) == list(range(n))
    assert torch.equal(got_q, q[source]) and torch.equal(got_s, scales[source])
    assert torch.equal(interleave_halves(q, hd), q[source])
    # No epilogue for the Triton layout or a head size the tiles cannot pair; and where it does not apply,
    # rope_write_kv returns None before any kernel runs (the model then runs the product and the rope kernel).
    parts = [(pack_int4(q), scales)]
    assert Int4CudaLinear.from_ir(parts, None, group, cpu, backend="triton", rope_head=hd).period == 0
    assert Int4CudaLinear.from_ir(parts, None, group, cpu, backend="mma", rope_head=8).period == 0
    cache = torch.zeros(4, 16, nkv, hd, dtype=torch.bfloat16)
    cos = sin = torch.ones(2, 1, hd, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1])

    def call(rows=2, cache=cache, heads=(nh, nkv)):
        x = torch.zeros(rows, k, dtype=torch.bfloat16)
        return layer.rope_write_kv(x, cos[:rows], sin[:rows], cache, cache, slots[:rows], *heads)

    assert call(cache=cache.float()) is None and call(heads=(nh + 1, nkv)) is None
    assert call(cache=cache.to(torch.float8_e4m3fn)) is None  # the epilogue writes 16 bits: the rope kernel stores
    layer.dense_from_m = 2
    assert call() is None  # a prefill-sized step
    layer.dense_from_m = 96
    monkeypatch.setenv(int4_cuda.ROPE_EPILOGUE_ENV, "0")
    assert call() is None


def test_cuda_weight_bytes_pads_only_shapes_the_mma_layout_cannot_hold():
    from llmc.engine.torch.int4_install import cuda_weight_bytes

    name = "transformer.layers.0.attention.qkv.weight"
    whole = {name: ("I8", (480, 576), 480 * 576)}  # N = 960, K = 576: whole mma tiles, the packed bytes as they are
    ragged = {name: ("I8", (500, 576), 500 * 576)}  # N = 1000: Triton's layout, K padded to 640
    assert cuda_weight_bytes(whole, tied=False) == 480 * 576
    assert cuda_weight_bytes(ragged, tied=False) == 640 // 8 * 1000 * 4


def test_the_shipped_table_holds_only_configs_the_cuda_library_launches():
    """Every tuned mma bucket is a config of the current kernel (table version 2), for every shipped shape."""
    table = json.loads(CONFIG_FILE.read_text())
    assert table["version"] == TABLE_VERSION
    entries = [(shape, entry["mma"]) for shapes in table["devices"].values() for shape, entry in shapes.items()
               if "mma" in entry]
    assert len(entries) >= 8  # the 8B and SmolLM2 shapes on the H200
    for shape, mma in entries:
        columns, k = (int(v) for v in shape.split("g")[0].split("x"))
        for bucket in mma["buckets"]:  # with the input scale's shared memory too (o and down have one)
            assert mma_fits(tuple(bucket[1:]), columns, k, prequant=True, rows=bucket[0]), (shape, bucket)


def test_a_table_of_the_older_kernel_falls_back_to_the_heuristics(tmp_path, monkeypatch):
    from llmc.engine.torch import int4_configs

    old = {"version": 1, "devices": {"GPU": {"4096x4096g128": {"mma": {"buckets": [[1, 1, 2, 16, 0]]},
                                                              "buckets": [[1, 16, 64, 1, 2, 3, 8]]}}}}
    (tmp_path / "t.json").write_text(json.dumps(old))
    monkeypatch.setattr(int4_configs, "CONFIG_FILE", tmp_path / "t.json")
    int4_configs._tuned_table.cache_clear()
    try:
        entry = int4_configs.tuned_entry("GPU", 4096, 4096, 128)
        assert "mma" not in entry and entry["buckets"] == [[1, 16, 64, 1, 2, 3, 8]]  # the Triton entry stays
    finally:
        int4_configs._tuned_table.cache_clear()


@pytest.mark.parametrize("dtype,magic,offset", [(torch.bfloat16, 0x4300, 0x4308), (torch.float16, 0x6400, 0x6408)])
def test_the_exact_fragment_decoding_gives_each_nibble_minus_8(dtype, magic, offset):
    """Configs of several row tiles make each A register ``(magic | u) - (base + 8)`` in 16 bits (hsub2): ``q = u - 8``
    exactly, for both activation dtypes (the kernel's kMagic and kOffset constants)."""
    u = torch.arange(16, dtype=torch.int16)
    got = (u | magic).view(dtype) - torch.full((16,), offset, dtype=torch.int16).view(dtype)
    assert torch.equal(got.float(), (u - 8).float())

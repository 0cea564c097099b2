"""CPU prefill in bfloat16 products with float32 sums: llmc's GEMM and prefill-attention kernels against float64
references, the layers' routing by step size, the loader's precision policy and, on the embedded model, the
prefill logits against the float32 path (mean KL <= 0.005) and greedy text against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmc.checkpoint.int4 import pack_int4
from llmc.engine.torch import attention, cpu_ext
from llmc.engine.torch.attention import build_attention_metadata
from llmc.engine.torch.dense16_cpu import MAX_ROWS, MAX_ROWS_BF16, Dense16Linear
from llmc.engine.torch.int4_cpu import MAX_INT4_ROWS, MAX_INT4_ROWS_BF16, Int4Linear
from llmc.engine.torch.loader import load_model
from llmc.engine.torch.prefill_cpu import MixedLinear, PrefillLinear, prefill_precision
from llmc.request.params import SamplingParams
from llmc.engine.types import ScheduledSequence
from tests.engine.torch.helpers import PagedSession, rtn_quantize_hf, write_ir

BF16 = torch.backends.cpu.get_cpu_capability() == "AVX512" and cpu_ext.has_avx512_bf16()
needs_bf16 = pytest.mark.skipif(not BF16, reason="llmc's bfloat16 prefill kernels need a CPU with AVX512-BF16")
GREEDY = SamplingParams(temperature=0.0)


def rounded(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16 (nearest even), in float64 for the references."""
    return t.bfloat16().double()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@needs_bf16
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 2), (7, 48, 40), (9, 80, 576), (300, 96, 64), (37, 576, 1536)])
def test_bf16_gemm_sums_bfloat16_products_in_float32(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    got = cpu_ext.bf16_gemm(x, cpu_ext.pack_bf16_pairs(w))
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # bfloat16 x bfloat16 products are exact in float32: only the float32 sums round.
    assert rel_err(got, rounded(x) @ rounded(w).T) < 1e-5
    if k > 2:  # the inputs really are rounded: the float32 product is further away
        assert rel_err(got, x.double() @ w.double().T) > 1e-4


def test_pack_bf16_pairs_layout():
    w = torch.arange(32 * 4, dtype=torch.float32).view(32, 4)  # [N=32, K=4], every value exact in bfloat16
    pairs = cpu_ext.pack_bf16_pairs(w)
    assert pairs.shape == (2, 2, 16, 2) and pairs.dtype == torch.bfloat16
    tile, p, j = 1, 1, 5  # channel 16 + j, columns 2p and 2p + 1
    assert pairs[tile, p, j].tolist() == [w[16 + j, 2 * p].item(), w[16 + j, 2 * p + 1].item()]
    assert cpu_ext.bf16_gemm_shape(32, 4) and not cpu_ext.bf16_gemm_shape(24, 4)
    assert not cpu_ext.bf16_gemm_shape(32, 5)


@needs_bf16
@pytest.mark.parametrize("m", [1, 8, 17, 300])
@pytest.mark.parametrize("inter", [48, 80])  # 3 tiles (one group), 5 tiles (a group of 3, then 2)
def test_bf16_gemm_silu_mul_applies_the_mlp_activation_to_the_same_sums(m, inter):
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 64, generator=gen), torch.randn(2 * inter, 64, generator=gen)  # [fc; gate]
    pairs = cpu_ext.pack_bf16_pairs(w)
    both = cpu_ext.bf16_gemm(x, pairs)
    got = cpu_ext.bf16_gemm_silu_mul(x, pairs)
    assert got.shape == (m, inter)
    torch.testing.assert_close(got, F.silu(both[:, :inter]) * both[:, inter:], rtol=2e-6, atol=1e-6)


def paged_chunks(work, nkv, hd, block_size, dtype, seed=0):
    """A step of prefill chunks ``work = [(cached, n), ...]`` over a random cache with scattered blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in work) + 3
    k_cache = torch.randn(num_blocks, block_size, nkv, hd, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, nkv, hd, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, used = [], 0
    for i, (cached, n) in enumerate(work):
        blocks = -(-(cached + n) // block_size)
        seqs.append(ScheduledSequence(f"r{i}", tuple(range(n)), cached, tuple(order[used:used + blocks]), True, GREEDY))
        used += blocks
    return k_cache, v_cache, build_attention_metadata(seqs, block_size, "cpu")


def reference_attention(q, k_cache, v_cache, meta, seq):
    """Sequence ``seq``'s causal attention in float64 over bfloat16-rounded q, k and v: ``[n, nh, hd]``."""
    start, n, cached = meta.query_starts[seq], meta.query_lens[seq], meta.num_computed[seq]
    ctx = cached + n
    rows = meta.block_tables[seq, : -(-ctx // meta.block_size)].long()
    k, v = (rounded(c[rows].flatten(0, 1)[:ctx].float()) for c in (k_cache, v_cache))  # [ctx, nkv, hd]
    qs = rounded(q[start:start + n])  # [n, nh, hd]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", qs, k) * q.shape[2] ** -0.5
    mask = torch.arange(ctx)[None, :] <= (cached + torch.arange(n))[:, None]
    return torch.einsum("hij,jhd->ihd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


@needs_bf16
@pytest.mark.parametrize(("nkv", "group", "hd", "block_size", "dtype"),
                         [(3, 3, 64, 32, torch.float16), (2, 4, 128, 16, torch.bfloat16), (4, 1, 32, 8, torch.float32),
                          (1, 8, 64, 16, torch.float16)])
def test_prefill_attention_is_causal_attention_over_bfloat16_inputs(nkv, group, hd, block_size, dtype):
    work = [(0, 40), (37, 20), (3, 1), (0, 130), (100, 17)]  # fresh, continued, one token, long, long cache
    k_cache, v_cache, meta = paged_chunks(work, nkv, hd, block_size, dtype)
    gen = torch.Generator().manual_seed(1)
    qk = torch.randn(meta.num_tokens, nkv * (group + 1), hd, generator=gen)
    q = qk[:, : nkv * group]  # a strided view, as in the model
    assert cpu_ext.prefill_attention_available(q, k_cache)
    out = torch.full(q.shape, float("nan"))
    chunks = torch.tensor([(i, meta.query_starts[i], n, cached) for i, (cached, n) in enumerate(work)],
                          dtype=torch.int32)  # every sequence a chunk, the one-token one too
    cpu_ext.prefill_attention(q, k_cache, v_cache, meta.block_tables, chunks, hd**-0.5, out)
    for seq in range(len(work)):
        start, n = meta.query_starts[seq], meta.query_lens[seq]
        ref = reference_attention(q, k_cache, v_cache, meta, seq)
        # Only the probabilities' rounding to bfloat16 (relative 2^-9) is left against this reference.
        assert ((out[start:start + n].double() - ref).abs().max()).item() < 4e-3 * ref.abs().max().item()


@needs_bf16
def test_prefill_attention_writes_its_chunks_rows_only_and_checks_them():
    k_cache, v_cache, meta = paged_chunks([(0, 5), (10, 1), (3, 4)], 2, 64, 16, torch.float16)
    q = torch.randn(meta.num_tokens, 4, 64)
    out = torch.full(q.shape, 7.0)
    one_chunk = meta.prefill_chunks[:1]  # the first sequence's 5 tokens only
    cpu_ext.prefill_attention(q, k_cache, v_cache, meta.block_tables, one_chunk, 0.125, out)
    assert not torch.equal(out[:5], torch.full((5, 4, 64), 7.0)) and torch.equal(out[5:], torch.full((5, 4, 64), 7.0))
    too_long = one_chunk.clone()
    too_long[0, 3] = 1000  # cached tokens beyond its block table
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ext.prefill_attention(q, k_cache, v_cache, meta.block_tables, too_long, 0.125, out)
    with pytest.raises(RuntimeError, match="head size"):
        cpu_ext.prefill_attention(q[..., :48].contiguous(), k_cache[..., :48].contiguous(),
                                  v_cache[..., :48].contiguous(), meta.block_tables, one_chunk, 0.125, out[..., :48])


@needs_bf16
def test_bf16_prefill_steps_attend_chunks_in_bfloat16_and_decodes_in_float32(monkeypatch):
    nkv, group, hd, bs = 3, 3, 64, 16
    work = [(0, 30), (37, 1), (50, 12), (5, 1)]  # two prefill chunks, two decodes
    k_cache, v_cache, meta = paged_chunks(work, nkv, hd, bs, torch.float16)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(meta.num_tokens, nkv * group, hd, generator=gen)
    k, v = torch.randn(meta.num_tokens, nkv, hd, generator=gen), torch.randn(meta.num_tokens, nkv, hd, generator=gen)
    calls = []
    real = cpu_ext.prefill_attention
    monkeypatch.setattr(cpu_ext, "prefill_attention", lambda *a: calls.append(a[4].tolist()) or real(*a))
    caches = k_cache.clone(), v_cache.clone()
    got = attention.paged_attention(q, k, v, *caches, meta, hd**-0.5, bf16_prefill=True)
    ref = attention.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, hd**-0.5)  # float32 path
    assert calls == [[[0, 0, 30, 0], [2, 31, 12, 50]]]  # one call, the two chunks
    decodes = meta.decode_tokens
    # decodes: the float32 decode kernel, exactly; chunks: bfloat16 products, close to float32
    assert torch.equal(got[decodes], attention.decode_attention(q[decodes], *caches, meta, hd**-0.5))
    assert rel_err(got, ref.double()) < 1e-2
    assert len(calls) == 1 and not torch.equal(got, ref)


def dense_layer(out_features=96, in_features=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen).half().float()  # exact in float16


@needs_bf16
def test_16_bit_layers_take_steps_from_4_rows_in_bfloat16_and_keep_no_float32_weight():
    w = dense_layer()
    layer = Dense16Linear.over(w, torch.float16, prefill="bfloat16")
    assert layer.decode_rows == MAX_ROWS_BF16 == 3 and layer.prefill.weight is None
    gen = torch.Generator().manual_seed(1)
    small, large = torch.randn(MAX_ROWS_BF16, 64, generator=gen), torch.randn(MAX_ROWS_BF16 + 1, 64, generator=gen)
    assert torch.equal(layer(small), cpu_ext.dense16_matmul(small, layer.tiles))  # float32 math, exact weights
    pairs = cpu_ext.pack_bf16_pairs(w)
    assert torch.equal(layer.prefill.pairs, pairs) and torch.equal(layer(large), cpu_ext.bf16_gemm(large, pairs))
    # fc + gate stacked: silu(fc) * gate, the same routing
    mlp = Dense16Linear.over(dense_layer(2 * 48), torch.float16, prefill="bfloat16")
    both = mlp.prefill(large)
    torch.testing.assert_close(mlp.silu_mul(large), F.silu(both[:, :48]) * both[:, 48:], rtol=2e-6, atol=1e-6)
    assert torch.equal(mlp.silu_mul(small), cpu_ext.silu_mul(mlp.decode(small)))
    # float32 prefill: today's split (16 rows) and the float32 weight, exactly
    plain = Dense16Linear.over(w, torch.float16)
    big = torch.randn(MAX_ROWS + 1, 64)
    assert plain.decode_rows == MAX_ROWS and torch.equal(plain(big), F.linear(big, w))


@needs_bf16
def test_int4_layers_take_steps_from_6_rows_in_bfloat16():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (96, 128), generator=gen, dtype=torch.int8)
    scale = torch.rand(96, 4, generator=gen) * 0.02 + 0.001
    prequant = torch.ones(128)
    dense = q.float() * scale.repeat_interleave(32, dim=1)
    layer = Int4Linear.from_packed(pack_int4(q), scale, prequant, 32, dense, prefill="bfloat16")
    assert layer.kernel == "llmc" and layer.decode_rows == MAX_INT4_ROWS_BF16 == 5 and layer.prefill.weight is None
    small, large = torch.randn(5, 128, generator=gen), torch.randn(6, 128, generator=gen)
    assert torch.equal(layer(small), layer.packed_matmul(small))
    assert torch.equal(layer(large), cpu_ext.bf16_gemm(large, cpu_ext.pack_bf16_pairs(dense)))
    assert Int4Linear.from_packed(pack_int4(q), scale, prequant, 32, dense).decode_rows == MAX_INT4_ROWS


def test_prefill_linear_keeps_float32_for_shapes_the_kernel_does_not_take():
    w = torch.randn(24, 64)  # 24 rows: not whole tiles of 16
    layer = PrefillLinear.over(w, "bfloat16")
    x = torch.randn(20, 64)
    assert layer.precision == "float32" and torch.equal(layer(x), F.linear(x, w))
    both = F.linear(x, w)
    torch.testing.assert_close(layer.silu_mul(x), F.silu(both[:, :12]) * both[:, 12:], rtol=2e-6, atol=1e-6)


@needs_bf16
def test_the_loader_gives_16_bit_checkpoints_bfloat16_prefill(tiny_hf_dir, tmp_path, monkeypatch):
    ir16 = write_ir(tiny_hf_dir, tmp_path / "fp16", dtype="float16")
    fast = load_model(ir16, "cpu", cpu_kernels=True)
    assert prefill_precision("float16") == prefill_precision("bfloat16") == "bfloat16"
    for layer in fast.transformer.layers:
        assert layer.attention.bf16_prefill
        for module in (layer.attention.qkv, layer.attention.dense, layer.mlp.proj, layer.mlp.fc_gate_kernel):
            assert isinstance(module, Dense16Linear) and module.prefill.precision == "bfloat16"
        assert layer.mlp.fc_gate is None and layer.mlp.fc is None  # the float32 [fc; gate] is freed
    # A float32 checkpoint, LLMC_CPU_PREFILL=float32, or no CPU kernels: float32 prefill as before.
    fp32 = load_model(write_ir(tiny_hf_dir, tmp_path / "fp32"), "cpu", cpu_kernels=True)
    assert prefill_precision("float32") == "float32" and type(fp32.transformer.layers[0].attention.qkv) is torch.nn.Linear
    assert not any(layer.attention.bf16_prefill for layer in fp32.transformer.layers)
    assert not load_model(ir16, "cpu").transformer.layers[0].attention.bf16_prefill
    monkeypatch.setenv(cpu_ext.PREFILL_ENV, "float32")
    assert cpu_ext.bf16_prefill_why_not() == "LLMC_CPU_PREFILL=float32"
    assert cpu_ext.prefill_status() == "float32 GEMMs (LLMC_CPU_PREFILL=float32)"
    off = load_model(ir16, "cpu", cpu_kernels=True)
    assert off.transformer.layers[0].mlp.fc_gate_kernel.prefill.precision == "float32"
    assert not off.transformer.layers[0].attention.bf16_prefill


@needs_bf16
def test_awq_checkpoints_dequantize_once_to_bfloat16_for_prefill(tiny_hf_dir, tmp_path):
    quantized, _ = rtn_quantize_hf(tiny_hf_dir, group_size=32)
    one = load_model(write_ir(tiny_hf_dir, tmp_path / "tp1", dtype="float16", quantized=quantized, group_size=32),
                     "cpu", cpu_kernels=True)
    for layer in one.transformer.layers:
        for module in (layer.attention.qkv, layer.attention.dense, layer.mlp.proj, layer.mlp.fc_gate_kernel):
            assert isinstance(module, Int4Linear) and module.prefill.precision == "bfloat16"
    # Two ranks: no int4 kernel (dequantized float32 layers), bfloat16 prefill all the same.
    two = load_model(write_ir(tiny_hf_dir, tmp_path / "tp2", dtype="float16", tp_size=2, quantized=quantized,
                              group_size=32), "cpu", cpu_kernels=True)
    for layer in two.transformer.layers:
        for module in (layer.attention.qkv, layer.attention.dense, layer.mlp.proj, layer.mlp.fc_gate_kernel):
            assert isinstance(module, MixedLinear) and module.prefill.precision == "bfloat16"
    # The two compute the same model: their prefill logits agree to bfloat16 accuracy.
    ids = list(range(40, 80))
    one_logits = PagedSession(one, block_size=8).step({"a": ids})["a"]
    two_logits = PagedSession(two, block_size=8).step({"a": ids})["a"]
    kl = F.kl_div(two_logits.log_softmax(-1), one_logits.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert kl.mean().item() < 1e-3


def test_without_avx512_bf16_prefill_stays_float32(monkeypatch):
    monkeypatch.setattr(cpu_ext, "has_avx512_bf16", lambda: False)
    assert cpu_ext.bf16_prefill_why_not() == "this CPU has no AVX512-BF16"
    assert prefill_precision("float16") == "float32"
    assert cpu_ext.prefill_status() == "float32 GEMMs (this CPU has no AVX512-BF16)"
    assert not cpu_ext.prefill_attention_available(torch.zeros(1, 4, 64), torch.zeros(1, 16, 2, 64))


NEAR_TIE = 0.25  # logits: a greedy split closer than this is a near-tie (about one bfloat16 step of a logit ~60)


@pytest.fixture(scope="module")
def smollm2_fp16_ir(smollm2_hf_dir, tmp_path_factory):
    """The embedded model's IR in float16, the 16-bit recipe's dtype."""
    return write_ir(smollm2_hf_dir, tmp_path_factory.mktemp("smollm2_fp16") / "checkpoint", dtype="float16")


def prefill_logits(ir, windows, precision: str, monkeypatch) -> list[torch.Tensor]:
    """Each window's logits at every position, one prefill step each, the KV cache in the checkpoint's float16."""
    from llmc.engine.torch.kv_alloc import allocate_kv_cache

    monkeypatch.setenv(cpu_ext.PREFILL_ENV, precision)
    model = load_model(ir, "cpu", cpu_kernels=True)
    assert model.transformer.layers[0].attention.bf16_prefill == (precision != "float32")
    out = []
    for ids in windows:
        session = PagedSession(model, block_size=16, num_blocks=ids.numel() // 16 + 1)
        session.kv = allocate_kv_cache(model.config, ids.numel() // 16 + 1, 16, torch.float16, "cpu")
        out.append(session.step({"w": ids.tolist()})["w"])
    return out


@needs_bf16
@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True])
def test_embedded_model_prefill_in_bfloat16_stays_within_mean_kl_0_005(quantized, smollm2_hf_dir, smollm2_fp16_ir,
                                                                       tmp_path, monkeypatch):
    """The gate's held-out tokens (2,048 in windows of 512; one window for the int4 IR) through one prefill step
    each: the bfloat16 path's next-token distributions against the float32 path's."""
    from llmc.builder import gate_report
    from llmc.tokenizer import load_tokenizer
    from llmc.builder.heldout import domain_windows
    from llmc.builder.verify import GATE_WINDOW

    # The gate's calibration-domain held-out text (pydoc), the domain the 0.005 bound was set on.
    windows = domain_windows(["pydoc"], load_tokenizer(smollm2_hf_dir), None, 2048, GATE_WINDOW).windows["pydoc"]
    ir = smollm2_fp16_ir
    if quantized:  # an AWQ-style int4 IR (round to nearest, random pre-quant scales): prefill dequantizes it
        q, _ = rtn_quantize_hf(smollm2_hf_dir, group_size=64)
        ir = write_ir(smollm2_hf_dir, tmp_path / "int4", dtype="float16", quantized=q, group_size=64)
        windows = windows[:1]
    ref, got = prefill_logits(ir, windows, "float32", monkeypatch), prefill_logits(ir, windows, "auto", monkeypatch)
    kl = torch.cat([gate_report.window_scores(ids, a, b)[0].flatten() for ids, a, b in zip(windows, ref, got)])
    top1 = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ref, got)) / kl.numel()
    print(f"SmolLM2 {'int4' if quantized else 'float16'} IR, {kl.numel()} held-out tokens: mean KL(float32 prefill "
          f"|| bfloat16 prefill) {kl.mean().item():.2e}, p99 {kl.quantile(0.99).item():.2e}, max {kl.max().item():.2e},"
          f" top-1 agreement {top1:.4f}")
    assert kl.mean().item() <= 0.005
    assert top1 > 0.97


@needs_bf16
@pytest.mark.slow
def test_the_16_bit_build_greedy_text_equals_transformers(smollm2_hf_dir, tmp_path):
    """The test prompts of the engine-vs-transformers checks, 32 greedy tokens through the runner of a float16
    build (bfloat16 prefill) against transformers in float32: equal, or split only at a near-tie."""
    from transformers import LlamaForCausalLM

    from llmc.tokenizer import load_tokenizer
    from llmc.engine.torch.runner import TorchModelRunner
    from tests.engine.torch.helpers import MiniScheduler, make_build_dir
    from tests.engine.torch.test_smollm2 import chat_ids

    build = make_build_dir(smollm2_hf_dir, tmp_path / "build", dtype="float16", tokens_per_block=16)
    runner = TorchModelRunner(build, device="cpu", num_blocks=64)
    assert runner.model.transformer.layers[0].attention.bf16_prefill
    hf_model = LlamaForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(smollm2_hf_dir)
    for text in ("Write a short poem about the sea.", "Explain in two sentences why the sky is blue.",
                 "What is the capital of France?", "Name three rivers."):
        prompt = chat_ids(tokenizer, text)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
        want = ref.sequences[0, len(prompt):].tolist()
        sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=len(prompt))
        sched.add(text, prompt, max_new=len(want))
        for step in range(len(want)):
            sched.update(runner.execute(sched.schedule(step)).sampled_token_ids)
        got = sched.reqs[text]["out"]
        if got == want:
            print(f"{text!r}: {len(want)} greedy tokens identical")
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        top2 = ref.logits[i][0].topk(2).values
        margin = (top2[0] - top2[1]).item()
        print(f"{text!r}: split at token {i}, transformers' top-2 margin there {margin:.3f}")
        assert margin < NEAR_TIE, (text, i, tokenizer.decode(got), tokenizer.decode(want))

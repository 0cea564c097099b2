"""llmc's CPU kernels (csrc/): paged decode attention against the portable gather + SDPA path, and the 16-bit
logits matmul against float64 products and the float32 layer."""

from __future__ import annotations

import pytest
import torch

from llmc.engine.torch import cpu_ext
from llmc.engine.torch import attention
from llmc.engine.torch.attention import decode_attention, build_attention_metadata, reference_decode_attention
from llmc.engine.torch.loader import load_model
from llmc.engine.types import ScheduledSequence
from llmc.request.params import SamplingParams
from tests.engine.torch.helpers import forget_cpu_kernels, write_ir

AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
needs_kernels = pytest.mark.skipif(not AVX512, reason="llmc's CPU kernels need an AVX-512 CPU")
GREEDY = SamplingParams(temperature=0.0)


def decode_batch(lengths, num_kv_heads, group, head_size, block_size, seed=0):
    """Random caches, one query token per sequence with scattered block tables, q a strided view (as in the
    model, where q is the first heads of the rotated q/k tensor)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, used = [], 0
    for i, length in enumerate(lengths):
        n = -(-length // block_size)
        seqs.append(ScheduledSequence(f"r{i}", (7,), length - 1, tuple(order[used:used + n]), True, GREEDY,
                                      prompt_token_ids=tuple(range(length - 1))))
        used += n
    meta = build_attention_metadata(seqs, block_size, "cpu")
    num_heads = num_kv_heads * group
    qk = 3 * torch.randn(len(lengths), num_heads + num_kv_heads, head_size, generator=gen)
    return qk[:, :num_heads], k_cache, v_cache, meta


@needs_kernels
@pytest.mark.parametrize(("num_kv_heads", "group", "head_size", "block_size"),
                         [(3, 3, 64, 32), (2, 3, 32, 16), (8, 4, 128, 16), (1, 8, 64, 8), (2, 2, 16, 16),
                          (1, 11, 16, 4), (4, 1, 64, 32)])
def test_kernel_matches_the_reference(num_kv_heads, group, head_size, block_size):
    lengths = (1, 2, 15, 16, 17, 40, 161, 333)  # a single token, whole blocks, partial blocks, long contexts
    q, k_cache, v_cache, meta = decode_batch(lengths, num_kv_heads, group, head_size, block_size)
    assert not q.is_contiguous() and cpu_ext.decode_attention_available(q, k_cache)
    scale = head_size**-0.5
    got = cpu_ext.paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_context_lens, scale)
    ref = reference_decode_attention(q, k_cache, v_cache, meta, scale)
    assert got.shape == q.shape and got.dtype == torch.float32
    # float32, exact softmax: summation order and a 1e-7 exp are all that differ from SDPA.
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-6
    # Each sequence attends to its own context only: changing another sequence's blocks leaves it unchanged.
    other = meta.decode_tables[0, 0].item()
    v_cache[other] += 1.0
    again = cpu_ext.paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_context_lens, scale)
    assert torch.equal(again[1:], got[1:]) and not torch.equal(again[0], got[0])


@needs_kernels
def test_the_decode_path_uses_the_kernel_for_float32_and_the_reference_otherwise(monkeypatch):
    q, k_cache, v_cache, meta = decode_batch((5, 70), 2, 3, 64, 16)
    scale = 0.125
    kernel = cpu_ext.paged_decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_context_lens, scale)
    assert torch.equal(decode_attention(q, k_cache, v_cache, meta, scale), kernel)
    # Not the kernel: bfloat16 queries, a head size it has no code for, or LLMC_CPU_KERNELS=torch.
    assert not cpu_ext.decode_attention_available(q.bfloat16(), k_cache)
    assert not cpu_ext.decode_attention_available(q[..., :48], k_cache[..., :48])
    monkeypatch.setenv(cpu_ext.ENV, "torch")
    forget_cpu_kernels()
    try:
        assert not cpu_ext.decode_attention_available(q, k_cache)
        ref = decode_attention(q, k_cache, v_cache, meta, scale)
        assert torch.equal(ref, reference_decode_attention(q, k_cache, v_cache, meta, scale))
        assert not torch.equal(ref, kernel)  # the two paths really differ in summation order
    finally:
        monkeypatch.delenv(cpu_ext.ENV)
        forget_cpu_kernels()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_caches_are_widened_exactly(dtype):
    q, k_cache, v_cache, meta = decode_batch((1, 33, 161), 3, 3, 64, 32)
    k16, v16 = k_cache.to(dtype), v_cache.to(dtype)
    assert cpu_ext.decode_attention_available(q, k16)
    got = cpu_ext.paged_decode_attention(q, k16, v16, meta.decode_tables, meta.decode_context_lens, 0.125)
    # the same float32 math as over the widened cache: only the cache's own rounding is new
    ref = reference_decode_attention(q, k16.float(), v16.float(), meta, 0.125)
    assert got.dtype == torch.float32 and ((got - ref).abs().max() / ref.abs().max()).item() < 2e-6


@needs_kernels
def test_kernel_rejects_operands_it_was_not_built_for():
    q, k_cache, v_cache, meta = decode_batch((5,), 2, 2, 64, 16)
    tables, lens = meta.decode_tables, meta.decode_context_lens
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        cpu_ext.paged_decode_attention(q, k_cache, v_cache, tables, lens + 16, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ext.paged_decode_attention(q.double(), k_cache, v_cache, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ext.paged_decode_attention(q, k_cache, v_cache, tables.long(), lens, 0.125)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 35])
def test_dense16_matmul_is_the_float32_product_of_the_16_bit_weight(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).to(dtype)  # [N, K]
    x = torch.randn(rows, 80, generator=gen)
    got = cpu_ext.dense16_matmul(x, cpu_ext.pack_tiles16(weight))
    expected = x.double() @ weight.double().T
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5


@needs_kernels
def test_a_16_bit_checkpoint_computes_its_logits_with_the_kernel(tiny_hf_dir, tmp_path, monkeypatch):
    ir = write_ir(tiny_hf_dir, tmp_path / "checkpoint", dtype="float16")
    plain, fast = load_model(ir, "cpu"), load_model(ir, "cpu", cpu_kernels=True)
    assert plain.logits_tiles is None and fast.logits_tiles is not None
    assert fast.logits_tiles.dtype == torch.float16 and fast.logits_weight().dtype == torch.float32
    hidden = torch.randn(3, fast.config.hidden_size, generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr(cpu_ext, "dense16_matmul", lambda x, t: calls.append(t) or cpu_ext.load().dense16_matmul(x, t))
    got, ref = fast.compute_logits(hidden), plain.compute_logits(hidden)
    assert len(calls) == 1 and calls[0] is fast.logits_tiles and got.shape == ref.shape
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # A float32 checkpoint's weight has no exact 16-bit copy: the float32 matmul stays.
    assert load_model(write_ir(tiny_hf_dir, tmp_path / "fp32"), "cpu", cpu_kernels=True).logits_tiles is None
    assert not plain.use_16bit_logits(torch.bfloat16)  # float16 values are not all bfloat16 values


@needs_kernels
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("hidden", [64, 576, 100])  # 100: a partial last vector
def test_fused_norms_match_transformers_rmsnorm(rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    h, d, w = (torch.randn(rows, hidden, generator=gen) * 3, torch.randn(rows, hidden, generator=gen),
               torch.randn(hidden, generator=gen))

    def reference(x):  # transformers' LlamaRMSNorm in float32
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    torch.testing.assert_close(cpu_ext.rms_norm(h, w, 1e-5), reference(h), rtol=2e-6, atol=2e-6)
    expected_h = h + d
    normed = cpu_ext.add_rms_norm_(h, d, w, 1e-5)
    assert torch.equal(h, expected_h)  # the residual add happened in place, exactly
    torch.testing.assert_close(normed, reference(expected_h), rtol=2e-6, atol=2e-6)


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1536), (7, 40), (300, 3072)])
def test_silu_mul_matches_torch(shape):
    a = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 6
    a[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -1e-30])  # saturating and tiny inputs stay finite and exact
    fc, gate = a.chunk(2, dim=-1)
    got = cpu_ext.silu_mul(a)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.nn.functional.silu(fc) * gate, rtol=2e-6, atol=1e-7)


@needs_kernels
def test_the_model_runs_its_elementwise_work_through_the_fused_ops(tiny_ir_dir, monkeypatch):
    model = load_model(tiny_ir_dir, "cpu")
    cfg = model.config
    calls = {}
    for name in ("rms_norm", "add_rms_norm_", "silu_mul"):
        def counted(*args, _name=name, _real=getattr(cpu_ext, name)):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args)

        monkeypatch.setattr(cpu_ext, name, counted)
    seqs = [ScheduledSequence("a", tuple(range(5, 12)), 0, (1,), True, GREEDY, prompt_token_ids=tuple(range(5, 12)))]
    meta = build_attention_metadata(seqs, 8, "cpu")
    kv = [(torch.zeros(4, 8, cfg.num_kv_heads, cfg.head_size), torch.zeros(4, 8, cfg.num_kv_heads, cfg.head_size))
          for _ in range(cfg.num_layers)]
    with torch.inference_mode():
        fused = model(torch.arange(5, 12), meta.positions, meta, kv)
        monkeypatch.setattr(cpu_ext, "fused_available", lambda x: False)
        plain = model(torch.arange(5, 12), meta.positions, meta, kv)
    # per layer: the input norm, the residual add + post norm, silu * gate; plus the final norm
    assert calls == {"rms_norm": cfg.num_layers + 1, "add_rms_norm_": cfg.num_layers, "silu_mul": cfg.num_layers}
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("chunk", [attention.CPU_KERNEL_MAX_QUERY_LEN, attention.CPU_KERNEL_MAX_QUERY_LEN + 1])
def test_mixed_steps_attend_token_by_token_through_the_kernel(chunk, monkeypatch):
    """Fresh prefills, a continued chunk and decodes in one step: the kernel (every token a one-token query
    over its sequence's cache) equals the per-sequence SDPA path; chunks over the limit take SDPA."""
    gen = torch.Generator().manual_seed(chunk)
    nkv, group, hd, bs = 3, 3, 64, 16
    k_cache, v_cache = torch.randn(40, bs, nkv, hd, generator=gen), torch.randn(40, bs, nkv, hd, generator=gen)
    work = [("fresh", chunk, 0, range(1, 10)), ("continued", 20, 100, range(10, 18)), ("decode", 1, 37, range(18, 21)),
            ("short", 3, 0, range(21, 22))]
    seqs = [ScheduledSequence(rid, tuple(range(n)), done, tuple(blocks), True, GREEDY) for rid, n, done, blocks in work]
    meta = build_attention_metadata(seqs, bs, "cpu")
    t = meta.num_tokens
    q = torch.randn(t, nkv * group, hd, generator=gen)
    k, v = torch.randn(t, nkv, hd, generator=gen), torch.randn(t, nkv, hd, generator=gen)
    calls = []
    real = cpu_ext.paged_decode_attention
    monkeypatch.setattr(cpu_ext, "paged_decode_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    got = attention.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, hd**-0.5)
    monkeypatch.setattr(cpu_ext, "decode_attention_available", lambda q, k: False)
    ref = attention.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, hd**-0.5)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-6
    # Within the limit one call covers every token; over it, only the decode batch uses the kernel.
    assert calls == ([t] if chunk <= attention.CPU_KERNEL_MAX_QUERY_LEN else [1])


@needs_kernels
def test_a_16_bit_checkpoint_decodes_through_its_exact_16_bit_weights(tiny_hf_dir, tmp_path, monkeypatch):
    from llmc.engine.torch.dense16_cpu import MAX_ROWS, Dense16Linear

    # Prefill in float32 here (its bfloat16 form: tests/engine/torch/test_prefill_cpu.py): the whole model then
    # equals the plain float32 one.
    monkeypatch.setenv(cpu_ext.PREFILL_ENV, "float32")
    ir = write_ir(tiny_hf_dir, tmp_path / "checkpoint", dtype="bfloat16")
    plain, fast = load_model(ir, "cpu"), load_model(ir, "cpu", cpu_kernels=True)
    for layer in fast.transformer.layers:
        for module in (layer.attention.qkv, layer.attention.dense, layer.mlp.proj, layer.mlp.fc_gate_kernel):
            assert isinstance(module, Dense16Linear) and module.tiles.dtype == torch.bfloat16
    assert fast.logits_tiles is not None and fast.logits_tiles.dtype == torch.bfloat16
    layer = fast.transformer.layers[0].attention.qkv
    gen = torch.Generator().manual_seed(0)
    for rows in (1, MAX_ROWS):  # the kernel: float32 products of the same weights
        x = torch.randn(rows, layer.in_features, generator=gen)
        ref = x.double() @ layer.prefill.weight.double().T
        assert ((layer(x).double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    x = torch.randn(MAX_ROWS + 1, layer.in_features, generator=gen)  # prefill-sized: the float32 GEMM, exactly
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.prefill.weight))
    # The whole model agrees with the plain float32 one (a 5-token prefill, then a decode step).
    cfg = fast.config
    outs = []
    for model in (plain, fast):
        kv = [(torch.zeros(4, 8, cfg.num_kv_heads, cfg.head_size), torch.zeros(4, 8, cfg.num_kv_heads, cfg.head_size))
              for _ in range(cfg.num_layers)]
        hidden = []
        for new, done in ((tuple(range(5, 10)), 0), ((11,), 5)):
            seq = ScheduledSequence("a", new, done, (1,), True, GREEDY, prompt_token_ids=tuple(range(5, 10)))
            meta = build_attention_metadata([seq], 8, "cpu")
            with torch.inference_mode():
                hidden.append(model(torch.tensor(new), meta.positions, meta, kv))
        outs.append(model.compute_logits(torch.cat(hidden)))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    # A float32 checkpoint keeps its plain linears.
    fp32 = load_model(write_ir(tiny_hf_dir, tmp_path / "fp32"), "cpu", cpu_kernels=True)
    assert type(fp32.transformer.layers[0].attention.qkv) is torch.nn.Linear


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 49152), (16, 49152), (5, 37), (3, 1)])
def test_argmax_rows_is_torch_argmax(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen)
    if shape[1] > 20:
        x[0, 3] = x[0, 17] = x[0].max() + 1  # a tie: the first column wins, as in torch
        if shape[0] > 2:
            x[-1] = float("-inf")  # a collapsed row: column 0, as torch
            x[1, shape[1] - 1] = float("inf")  # +inf in the last (tail) lane
            x[2, 5:9] = float("-inf")
    got = cpu_ext.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    assert shape[1] <= 20 or got[0].item() == 3


@needs_kernels
def test_the_cpu_runner_samples_greedy_tokens_with_the_argmax_kernel(tiny_hf_dir, tmp_path):
    from llmc.engine.torch.runner import TorchModelRunner
    from tests.engine.torch.helpers import make_build_dir

    runner = TorchModelRunner(make_build_dir(tiny_hf_dir, tmp_path / "b"), "cpu", num_blocks=8)
    assert runner.sampler._argmax is cpu_ext.argmax_rows
    logits = torch.randn(3, runner.vocab_size, generator=torch.Generator().manual_seed(0))
    logits[1, 5] = float("nan")  # sanitized to -inf first: never chosen
    seqs = [ScheduledSequence(f"r{i}", (1,), 0, (0,), True, GREEDY, prompt_token_ids=(1,)) for i in range(3)]
    expected = torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1)
    assert torch.equal(runner.sampler(logits, seqs), expected)


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path):
    """torch's build baton is a plain file: a process killed -9 while loading the kernels leaves it, and every
    later load would wait forever. Under llmc's flock, a lock file found is stale and removed."""
    (tmp_path / "lock").write_text("")
    with cpu_ext._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert (tmp_path / "llmc.flock").exists()

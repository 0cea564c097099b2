"""The portable engine on CUDA (run through the device tool): packed paged logits against transformers."""

from __future__ import annotations

import pytest
import torch

from llmc.engine.torch.loader import load_model
from tests import factories
from tests.engine.torch.helpers import PagedSession, write_ir

pytestmark = pytest.mark.gpu

# SmolLM2-135M's shape with fewer layers; random weights, so the test needs no model download on the device.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, rope_theta=100000.0)


def random_llama(path, **overrides):
    """A random Llama HF folder; no tokenizer is needed (an empty tokenizer folder is passed)."""
    (path / "no_tokenizer").mkdir(parents=True, exist_ok=True)
    return factories.make_tiny_llama(path / "hf", path / "no_tokenizer", **overrides)


def paged_logits(model, ids: list[int], chunks: int = 3) -> torch.Tensor:
    """Logits at every position, prompt run as ``chunks`` prefill chunks then re-read through the cache."""
    session = PagedSession(model, block_size=16, num_blocks=64)
    bounds = [len(ids) * i // chunks for i in range(chunks + 1)]
    return torch.cat([session.step({"a": ids[a:b]})["a"] for a, b in zip(bounds, bounds[1:])])


def test_tiny_fp32_logits_on_cuda_match_transformers(tmp_path):
    from transformers import LlamaForCausalLM

    tiny_hf_dir = random_llama(tmp_path)

    model = load_model(write_ir(tiny_hf_dir, tmp_path / "ir"), "cuda", dtype=torch.float32)
    ids = list(range(300, 345))
    hf_model = LlamaForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval().cuda()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids], device="cuda")).logits[0].float()
    assert (paged_logits(model, ids) - ref).abs().max().item() < 1e-3


def test_smollm2_shaped_bf16_logits_on_cuda_within_bf16_error(tmp_path):
    """bf16 engine vs transformers fp32: its error is no worse than transformers' own bf16 error (+ margin)."""
    from transformers import LlamaForCausalLM

    smollm2_hf_dir = random_llama(tmp_path, **SMOLLM2_SHAPE)

    model = load_model(write_ir(smollm2_hf_dir, tmp_path / "ir", dtype="bfloat16"), "cuda")
    assert model.transformer.ln_f.weight.dtype == torch.bfloat16  # the IR dtype on CUDA
    ids = list(range(1000, 1200))
    with torch.no_grad():
        hf32 = LlamaForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval().cuda()
        ref = hf32(torch.tensor([ids], device="cuda")).logits[0].float()
        hf16 = hf32.to(torch.bfloat16)
        ref16 = hf16(torch.tensor([ids], device="cuda")).logits[0].float()
    got = paged_logits(model, ids)
    engine_err = (got - ref).abs().max().item()
    hf_err = (ref16 - ref).abs().max().item()
    # Random weights give near-tied top logits, so top-1 agreement is judged against transformers' own bf16.
    engine_top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    hf_top1 = (ref16.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"bf16 vs fp32: max abs logits error llmc {engine_err:.3f} / transformers {hf_err:.3f}; "
          f"top-1 agreement llmc {engine_top1:.3f} / transformers {hf_top1:.3f}")
    assert engine_err <= 2 * hf_err + 0.05
    assert engine_top1 >= hf_top1 - 0.05


def test_runner_on_cuda_sizes_the_cache_from_free_memory_and_decodes_greedily(tmp_path):
    from transformers import LlamaForCausalLM

    from llmc.engine.torch.runner import TorchModelRunner
    from tests.engine.torch.helpers import MiniScheduler, make_build_dir

    hf_dir = random_llama(tmp_path)
    runner = TorchModelRunner(make_build_dir(hf_dir, tmp_path / "build", dtype="float32"), device="cuda")
    free_after, _ = torch.cuda.mem_get_info()
    assert runner.kv_caches[0][0].dtype == torch.float32 and runner.device.type == "cuda"
    assert free_after < runner.num_blocks * runner.block_size * runner.kv_bytes_per_token  # used ~0.9 of free
    runner.warmup()
    prompt = list(range(200, 237))
    sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=16)
    sched.add("a", prompt, max_new=8)
    for step in range(12):
        sched.update(runner.execute(sched.schedule(step)).sampled_token_ids)
    hf_model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval().cuda()
    ref = hf_model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False,
                            min_new_tokens=8, pad_token_id=2)[0, len(prompt):].tolist()
    assert sched.reqs["a"]["out"] == ref


def test_warmup_compiles_the_paged_prefill_kernel_so_a_cut_prompt_compiles_nothing(tmp_path, monkeypatch):
    """A prompt cut in chunks attends its later chunks through the paged prefill kernel; the warm-up has compiled it
    already (before, it compiled while serving: most likely a bf16 run's 1.1 s stall at concurrency 8, 2026-12-03)."""
    import triton

    from llmc.engine.torch import triton_prefill
    from llmc.engine.torch.runner import TorchModelRunner
    from tests.engine.torch.helpers import MiniScheduler, make_build_dir

    hf_dir = random_llama(tmp_path, **SMOLLM2_SHAPE)
    runner = TorchModelRunner(make_build_dir(hf_dir, tmp_path / "build", dtype="bfloat16", tokens_per_block=32),
                              device="cuda")
    compiled, calls = [], []
    kernel = triton_prefill.paged_prefill_attention
    monkeypatch.setattr(triton_prefill, "paged_prefill_attention",  # args[4]: the chunks (none: no launch)
                        lambda *args, **kw: (calls.append(1) if args[4] else None) or kernel(*args, **kw))
    runner.warmup()
    assert calls  # the warm-up launched the kernel (Triton compiles on a first launch)
    calls.clear()
    # Called before every compile or load of a kernel variant not yet in memory; None lets it proceed.
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kw: compiled.append(str(kw)))
    sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=900)  # longer than the graphs' chunks
    sched.add("a", list(range(200, 2000)), max_new=4)  # two chunks of 900 tokens
    for step in range(8):
        sched.update(runner.execute(sched.schedule(step)).sampled_token_ids)
    assert len(sched.reqs["a"]["out"]) == 4 and calls  # the later chunks went through the kernel
    assert not [c for c in compiled if "paged_prefill" in c]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [512, 2048])
def test_chunk_over_cached_context_on_cuda_equals_the_masked_path(dtype, n):
    # CUDA takes the lower-right causal bias (fused SDPA kernel) for a chunk over cached context, and causal SDPA
    # with shared kv heads (enable_gqa) for a whole fresh prompt (n == ctx); float32 on CPU is the reference.
    from llmc.engine.torch.attention import _prefill_attention

    gen = torch.Generator().manual_seed(0)
    ctx, nh, nkv = 2048, 32, 8
    q, k, v = (torch.randn(length, heads, 128, generator=gen) for length, heads in ((n, nh), (ctx, nkv), (ctx, nkv)))
    reference = _prefill_attention(q, k, v, ctx - n, 128 ** -0.5)
    out = _prefill_attention(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), ctx - n, 128 ** -0.5)
    torch.testing.assert_close(out.float().cpu(), reference, rtol=2e-2, atol=2e-2)


def test_prompts_of_new_lengths_attend_without_cudnn_plans_when_switched_off(tmp_path, monkeypatch):
    # LLMC_CUDNN_PROMPTS=0: cuDNN's SDPA builds a host-side plan for every new prompt length (37-54 ms each inside
    # the engine on the H200), so prompt steps take the flash kernel, and leave SDPA's global flags as they found them.
    from llmc.engine.torch import attention

    monkeypatch.setenv(attention.CUDNN_PROMPTS_ENV, "0")
    hf_dir = random_llama(tmp_path, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    model = load_model(write_ir(hf_dir, tmp_path / "ir", dtype="bfloat16"), "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for n in (97, 130, 201):
            PagedSession(model, block_size=16, num_blocks=64).step({"a": list(range(300, 300 + n))})
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert [name for name in names if "flash_fwd" in name], sorted(names)
    assert not [name for name in names if "cudnn" in name.lower()]
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_prompts_of_new_lengths_attend_through_cudnn_at_one_bucketed_length(tmp_path, monkeypatch):
    # The default: cuDNN's SDPA builds a host-side plan for every new length (37-54 ms each inside the engine on
    # the H200), so fresh prompts of three new lengths reach it padded to one bucket (one plan), and the steps
    # leave SDPA's global flags as they found them.
    from llmc.engine.torch import attention

    monkeypatch.delenv(attention.CUDNN_PROMPTS_ENV, raising=False)
    hf_dir = random_llama(tmp_path, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    model = load_model(write_ir(hf_dir, tmp_path / "ir", dtype="bfloat16"), "cuda")
    lengths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        if torch.backends.cuda.cudnn_sdp_enabled():
            lengths.append((query.shape[-2], key.shape[-2]))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for n in (97, 130, 201):
            PagedSession(model, block_size=16, num_blocks=64).step({"a": list(range(300, 300 + n))})
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert [name for name in names if "cudnn" in name.lower()], sorted(names)
    assert not [name for name in names if "flash_fwd" in name], sorted(names)
    assert set(lengths) == {(256, 256)} and len(lengths) == 3 * 2  # three prompts x two layers, one length
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()

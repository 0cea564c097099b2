"""The fp8 KV cache (``kv_cache.dtype: fp8``): what the cache stores, the attention paths that read it (the
reference paths on the CPU; the Triton kernels under Triton's interpreter here and on CUDA in
``test_kv_fp8_gpu.py``), where the runner falls back to a 16-bit cache, and the IR's scales in the loader."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmc.builder.hf_kv import fp8_round_trip
from llmc.checkpoint import kv_scales
from llmc.checkpoint.io import read_checkpoint, write_checkpoint
from llmc.engine.torch import kv_alloc, triton_support
from llmc.engine.torch.attention import paged_attention, reference_decode_attention
from llmc.engine.torch.kv_store import FP8, FP8_MAX, from_cache, to_cache, write_kv
from llmc.errors import CheckpointError
from tests.engine.torch.helpers import random_decode_batch


def as_fp8(cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache`` stored as an fp8 cache of ``scale`` holds it, and the float32 values that cache reads back."""
    stored = to_cache(cache, FP8, scale)
    return stored, from_cache(stored, torch.float32, scale)


def test_the_cache_stores_x_over_the_scale_in_e4m3_clamped_and_reads_it_back():
    x = torch.tensor([0.0, 1e-3, -0.5, 3.0, 447.0 * 0.25, 1e6, -1e6, 7.3])
    stored = to_cache(x, FP8, 0.25)
    assert stored.dtype == FP8 and stored.element_size() == 1
    back = from_cache(stored, torch.float32, 0.25)
    assert back[5] == FP8_MAX * 0.25 and back[6] == -FP8_MAX * 0.25  # beyond the range: clamped, not NaN
    inside = x.abs() <= FP8_MAX * 0.25
    assert ((back - x).abs()[inside] <= x.abs()[inside] * 2**-4 + 2**-9 * 0.25).all()  # e4m3: 3 mantissa bits
    assert back[2] == -0.5 and back[3] == 3.0  # exact where e4m3 holds x / scale
    assert torch.equal(to_cache(x, torch.bfloat16, 0.25), x.to(torch.bfloat16))  # 16-bit caches ignore the scale


def test_the_engine_stores_what_the_builds_gate_scores():
    """The accuracy gate emulates the cache with ``hf_kv.fp8_round_trip``: the same values as the engine's store
    and read (float32 here, where both are exact)."""
    x = torch.randn(4096) * 30
    for scale in (0.05, 0.137, 2.0):
        assert torch.equal(from_cache(to_cache(x, FP8, scale), torch.float32, scale), fp8_round_trip(x, scale))


def test_decode_over_an_fp8_cache_is_decode_over_the_values_it_holds():
    q, k16, v16, meta = random_decode_batch("cpu", torch.float32)
    scale, kv_scale = q.shape[-1] ** -0.5, 0.02
    k8, k_read = as_fp8(k16 * 3, kv_scale)
    v8, v_read = as_fp8(v16, kv_scale)
    got = reference_decode_attention(q, k8, v8, meta, scale, kv_scale)
    want = reference_decode_attention(q, k_read, v_read, meta, scale)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_write_kv_stores_into_an_fp8_cache_at_the_slots():
    cache_k = torch.zeros(4, 8, 2, 16, dtype=FP8)
    cache_v = torch.zeros(4, 8, 2, 16, dtype=FP8)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, 17, 30])
    write_kv(cache_k, cache_v, k, v, slots, kv_scale=0.01)
    flat_k, flat_v = cache_k.view(-1, 2, 16), cache_v.view(-1, 2, 16)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(flat_k[slot].view(torch.uint8), to_cache(k[i], FP8, 0.01).view(torch.uint8))
        assert torch.equal(flat_v[slot].view(torch.uint8), to_cache(v[i], FP8, 0.01).view(torch.uint8))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert (flat_k[untouched].view(torch.uint8) == 0).all()


def test_prompt_chunks_over_an_fp8_cache_read_its_values(monkeypatch):
    """A step with a chunk over a cached context (the gather + SDPA path) and a decode: the same as the same step
    over a float32 cache holding the values the fp8 one reads back, this step's keys and values written first."""
    from tests.engine.torch.test_triton_prefill import _step

    monkeypatch.setenv("LLMC_PREFILL_KERNEL", "0")
    q, k16, v16, meta = _step(4, 2, 64, 16, [(5, 9), (1, 30), (3, 20)], torch.float32, "cpu")
    t = q.shape[0]
    k_new, v_new = torch.randn(t, 2, 64), torch.randn(t, 2, 64)
    kv_scale = 0.03
    k8, k_read = as_fp8(k16, kv_scale)
    v8, v_read = as_fp8(v16, kv_scale)
    got = paged_attention(q, k_new, v_new, k8, v8, meta, 0.125, kv_scale=kv_scale)
    _, k_new_read = as_fp8(k_new, kv_scale)
    _, v_new_read = as_fp8(v_new, kv_scale)
    want = paged_attention(q, k_new_read, v_new_read, k_read, v_read, meta, 0.125)
    fresh = [i for i in meta.prefill_seqs if meta.num_computed[i] == 0]
    assert not fresh  # a fresh prompt attends its own 16-bit keys, not the cache's: not this test's case
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [None, 2, 12])
def test_the_triton_decode_kernel_under_the_interpreter_reads_an_fp8_cache(splits):
    from llmc.engine.torch.triton_attention import paged_decode_attention

    if triton_support.modules() is None or not triton_support.interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, set by the test suite's conftest)")
    q, k16, v16, meta = random_decode_batch("cpu", torch.float32)
    kv_scale, scale = 0.05, q.shape[-1] ** -0.5
    k8, k_read = as_fp8(k16, kv_scale)
    v8, v_read = as_fp8(v16 * 4, kv_scale)
    got = paged_decode_attention(q, k8, v8, meta.decode_tables, meta.decode_context_lens, scale, splits,
                                 kv_scale=kv_scale)
    want = reference_decode_attention(q, k_read, v_read, meta, scale)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("splits", [None, 2, 12])
def test_16bit_queries_over_an_fp8_cache_take_float16_dots_clamped_to_its_range(gpu, splits):
    """A bfloat16 query over an fp8 cache: the kernel takes its dots in float16 (kv_store.f16_dots); the result is
    the float32 reference's within bfloat16 rounding, and a query element beyond float16's range is clamped to it
    (the reference over the clamped query), not turned into inf and a NaN output."""
    from llmc.engine.torch import kv_store
    from llmc.engine.torch.triton_attention import paged_decode_attention

    device = kernel_device(gpu)
    assert kv_store.f16_dots(FP8, torch.bfloat16) and not kv_store.f16_dots(FP8, torch.float32)
    assert not kv_store.f16_dots(torch.bfloat16, torch.bfloat16)
    q, k16, v16, meta = random_decode_batch(device, torch.float32)
    kv_scale, scale = 0.05, q.shape[-1] ** -0.5
    k8, k_read = as_fp8(k16, kv_scale)
    v8, v_read = as_fp8(v16 * 4, kv_scale)
    q = q.to(torch.bfloat16)
    q[0, 0, 3], q[-1, -1, 0] = 1e6, -3e5
    got = paged_decode_attention(q, k8, v8, meta.decode_tables, meta.decode_context_lens, scale, splits,
                                 kv_scale=kv_scale)
    assert torch.isfinite(got).all()
    want = reference_decode_attention(q.float().clamp(-kv_store.F16_MAX, kv_store.F16_MAX), k_read, v_read, meta,
                                      scale)
    assert torch.allclose(got.float(), want, rtol=1.6e-2, atol=1e-2)  # bfloat16's rounding of the output


def test_the_runner_keeps_a_16bit_cache_where_fp8_cannot_run_and_says_why(monkeypatch):
    cpu = torch.device("cpu")
    dtype, why = kv_alloc.runtime_kv_dtype("fp8", torch.bfloat16, cpu, 16, 64)
    assert dtype == torch.bfloat16 and "CPU attention kernels" in why
    assert kv_alloc.runtime_kv_dtype("auto", torch.float16, cpu, 16, 64) == (torch.float16, None)
    assert kv_alloc.kv_cache_dtype("fp8", torch.bfloat16) == FP8
    monkeypatch.setenv(kv_alloc.FP8_ENV, "0")
    assert kv_alloc.runtime_kv_dtype("fp8", torch.float16, cpu, 16, 64) == (
        torch.float16, "kv_cache.dtype fp8 runs as float16 here: LLMC_KV_FP8=0")


@pytest.fixture(scope="module")
def fp8_build(tmp_path_factory, tiny_hf_dir):
    """The tiny model built 16-bit with an fp8 KV cache, and the same without (the real pipeline)."""
    from llmc.builder.pipeline import build
    from llmc.recipe import recipe_from_dict

    def recipe(kv: str):
        return recipe_from_dict({
            "name": f"tiny-{kv}", "model": {"source": str(tiny_hf_dir), "dtype": "bfloat16"},
            "engine": {"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 128},
            "kv_cache": {"tokens_per_block": 16, "cpu_budget_mb": 16, "dtype": kv}})  # 16: the CUDA kernels

    root = tmp_path_factory.mktemp("fp8")
    return build(recipe("fp8"), root / "fp8").build_dir, build(recipe("auto"), root / "auto").build_dir


def test_an_fp8_build_holds_calibrated_scales_that_the_engine_takes(fp8_build):
    import json

    from llmc.engine.torch.loader import load_model
    from llmc.engine.torch.runner import TorchModelRunner

    fp8, auto = fp8_build
    config, ranks = read_checkpoint(fp8 / "checkpoint")
    scales = kv_scales.read(config, ranks[0], config["num_hidden_layers"])
    report = json.loads((fp8 / "build_report.json").read_text())["kv_scales"]
    assert scales == pytest.approx(report["scales"], rel=1e-7) and all(s != 1.0 for s in scales)
    assert set(report["heldout"]) == {"pydoc", "prose", "code", "chat", "chinese"} and report["mean_kl"] > 0
    engine = json.loads((fp8 / "engine" / "engine.json").read_text())
    assert json.loads((fp8 / "build_report.json").read_text())["engine"]["kv_dtype"] == "float8_e4m3fn"
    assert 2 * engine["kv_bytes_per_token"] == json.loads((auto / "engine" / "engine.json").read_text())[
        "kv_bytes_per_token"]
    model = load_model(fp8 / "checkpoint", "cpu")
    assert [layer.attention.kv_scale for layer in model.transformer.layers] == pytest.approx(scales, rel=1e-7)
    runner = TorchModelRunner(fp8, device="cpu", num_blocks=4)
    assert runner.kv_dtype == torch.bfloat16 and "CPU attention kernels" in runner.kv_fallback
    assert runner.kv_caches[0][0].dtype == torch.bfloat16


def test_inspect_shows_the_fp8_scales_and_their_held_out_kl(fp8_build):
    import json

    from rich.console import Console

    from llmc.builder.commands import _print_inspection, inspect_build

    info = inspect_build(fp8_build[0])
    report = json.loads((fp8_build[0] / "build_report.json").read_text())["kv_scales"]
    fp8 = info["kv_cache"]["fp8_scales"]
    assert info["kv_cache"]["dtype"] == "fp8" and info["kv_cache"]["dtype_bytes"] == 1
    assert fp8["layers"] == 2 and fp8["min"] == pytest.approx(min(report["scales"]), rel=1e-6)
    assert fp8["max"] == pytest.approx(max(report["scales"]), rel=1e-6) and fp8["heldout_mean_kl"] == report["mean_kl"]
    assert inspect_build(fp8_build[1])["kv_cache"]["fp8_scales"] is None
    console = Console(record=True, width=200, file=open("/dev/null", "w"))
    _print_inspection(info, console)
    assert f"held-out mean KL {report['mean_kl']:.4f} against a 16-bit cache" in console.export_text()


def test_an_fp8_checkpoint_without_its_scales_is_refused(fp8_build, tmp_path):
    import shutil

    from llmc.engine.torch.loader import load_model

    ckpt = tmp_path / "checkpoint"
    shutil.copytree(fp8_build[0] / "checkpoint", ckpt)
    config, ranks = read_checkpoint(ckpt)
    ranks[0][kv_scales.scale_name(1)] = torch.tensor([-1.0])
    write_checkpoint(ckpt, config, ranks)
    with pytest.raises(CheckpointError, match="layer 1's kv_cache_scaling_factor is -1.0"):
        load_model(ckpt, "cpu")
    with pytest.raises(CheckpointError, match="lacks 1 of its per-layer"):
        kv_scales.read(config, {k: v for k, v in ranks[0].items() if k != kv_scales.scale_name(0)}, 2)


def test_compile_refuses_a_recipe_and_checkpoint_that_disagree_on_the_cache(fp8_build, tmp_path):
    from llmc.engine.base import compile_engine
    from llmc.errors import EngineError
    from llmc.manifest import read_manifest

    recipe = read_manifest(fp8_build[1]).recipe_obj()  # kv_cache.dtype auto
    with pytest.raises(EngineError, match="kv_cache.dtype is auto but the checkpoint's kv_cache_quant_algo is FP8"):
        compile_engine(recipe, fp8_build[0] / "checkpoint", tmp_path / "engine")
    fp8 = dataclasses.replace(recipe, kv_cache=dataclasses.replace(recipe.kv_cache, dtype="fp8"))
    with pytest.raises(EngineError, match="kv_cache.dtype is fp8 but the checkpoint's kv_cache_quant_algo is None"):
        compile_engine(fp8, fp8_build[1] / "checkpoint", tmp_path / "engine2")


def kernel_device(gpu: bool) -> str:
    """Where a kernel test runs: CUDA for the ``gpu`` copy, else Triton's interpreter on the CPU (or skip)."""
    if gpu:
        return "cuda"
    if triton_support.modules() is None or not triton_support.interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, set by the test suite's conftest)")
    return "cpu"


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_the_prefill_kernel_reads_an_fp8_cache(gpu):
    """Chunks over a cached context through the Triton prefill kernel, from an fp8 cache: the gather + SDPA path
    over a cache of the values it holds (float32 under the interpreter; bf16 on CUDA)."""
    from llmc.engine.torch.triton_prefill import paged_prefill_attention
    from tests.engine.torch.test_triton_prefill import _reference, _step

    device = kernel_device(gpu)
    dtype = torch.bfloat16 if gpu else torch.float32
    q, k16, v16, meta = _step(8, 2, 64, 16, [(21, 37), (1, 50), (40, 70)], torch.float32, device)
    kv_scale = 0.04
    k8, k_read = as_fp8(k16, kv_scale)
    v8, v_read = as_fp8(v16 * 3, kv_scale)
    chunks = [(i, meta.query_starts[i], meta.query_lens[i], meta.num_computed[i]) for i in meta.prefill_seqs]
    out = torch.zeros_like(q, dtype=dtype)
    paged_prefill_attention(q.to(dtype), k8, v8, meta.block_tables, chunks, 0.125, out, kv_scale=kv_scale)
    for i, start, n, _ in chunks:
        want = _reference(q, k_read, v_read, meta, 0.125, i)
        assert (out[start:start + n].float() - want).abs().max().item() < (2e-2 if gpu else 2e-5)


@pytest.mark.gpu
def test_the_rope_kernel_stores_the_bytes_write_kv_stores():
    """The fused RoPE + KV write into an fp8 cache stores its rotated keys (the ones it returns) and the values
    exactly as :func:`to_cache` rounds them; a 16-bit cache's bytes are unchanged by the scale. CUDA only: Triton's
    interpreter rounds float32 -> e4m3 otherwise (ties away from zero, and 31.7 to 16), the GPU's conversion is
    round-to-nearest-even as PyTorch's."""
    from llmc.engine.torch import fused_triton
    from llmc.engine.torch.rope import rope_cos_sin

    device = "cuda"
    dtype = torch.bfloat16
    t, nh, nkv, hd = 5, 8, 2, 64
    gen = torch.Generator().manual_seed(3)
    qkv = (torch.randn(t, (nh + 2 * nkv) * hd, generator=gen) * 20).to(dtype).to(device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=device).float() / hd))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(t, device=device) + 40, dtype)
    slots = torch.tensor([3, 9, 17, 30, 31], device=device)
    k8, v8 = (torch.zeros(4, 8, nkv, hd, dtype=FP8, device=device) for _ in range(2))
    q, k = fused_triton.rope_write_kv(qkv, cos, sin, k8, v8, slots, nh, nkv, hd, return_k=True, kv_scale=0.07)
    v = qkv[:, (nh + nkv) * hd:].view(t, nkv, hd)
    flat_k, flat_v = k8.view(-1, nkv, hd)[slots], v8.view(-1, nkv, hd)[slots]
    assert torch.equal(flat_k.view(torch.uint8), to_cache(k, FP8, 0.07).view(torch.uint8))
    assert torch.equal(flat_v.view(torch.uint8), to_cache(v, FP8, 0.07).view(torch.uint8))
    k16, v16 = (torch.zeros(4, 8, nkv, hd, dtype=dtype, device=device) for _ in range(2))
    q2, k2 = fused_triton.rope_write_kv(qkv, cos, sin, k16, v16, slots, nh, nkv, hd, return_k=True, kv_scale=0.07)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(k16.view(-1, nkv, hd)[slots], k)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_the_decode_kernel_on_cuda_reads_an_fp8_cache(batch):
    """Both forms of the decode kernel (split + merge kernel at 1 sequence, merged in the kernel at 64) over an fp8
    cache: the reference over a bf16 cache of the values it holds."""
    from llmc.engine.torch.triton_attention import paged_decode_attention

    lengths = tuple((37 * i) % 700 + 1 for i in range(batch))
    q, k16, v16, meta = random_decode_batch("cuda", torch.float32, num_blocks=batch * 45 + 2, nkv=8, group=4,
                                            hd=128, lengths=lengths)
    kv_scale, scale = 0.03, 128**-0.5
    k8, k_read = as_fp8(k16 * 2, kv_scale)
    v8, v_read = as_fp8(v16, kv_scale)
    q = q.to(torch.bfloat16)
    got = paged_decode_attention(q, k8, v8, meta.decode_tables, meta.decode_context_lens, scale, kv_scale=kv_scale)
    want = reference_decode_attention(q.float(), k_read, v_read, meta, scale)
    assert (got.float() - want).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_an_fp8_build_on_cuda_keeps_an_fp8_cache_and_agrees_with_a_16bit_one(fp8_build, monkeypatch):
    """The tiny fp8 build on CUDA: an fp8 cache, CUDA-graph decode steps giving the eager steps' greedy tokens, and
    (a random model: flat distributions, near-ties) at least 6 of 8 greedy tokens those of the same build with its
    16-bit cache (``LLMC_KV_FP8=0``)."""
    from llmc.engine.torch.runner import TorchModelRunner
    from llmc.engine.types import ScheduledSequence, SchedulerOutput
    from tests.engine.torch.helpers import GREEDY

    def greedy(runner: TorchModelRunner) -> list[int]:
        prompt = tuple(range(5, 45))
        out = []
        seq = ScheduledSequence("a", prompt, 0, tuple(range(6)), True, GREEDY)
        token = runner.execute(SchedulerOutput(step=0, sequences=(seq,))).sampled_token_ids["a"]
        out.append(token)
        for step in range(1, 8):
            seq = ScheduledSequence("a", (token,), len(prompt) + step - 1, tuple(range(6)), True, GREEDY)
            token = runner.execute(SchedulerOutput(step=step, sequences=(seq,))).sampled_token_ids["a"]
            out.append(token)
        return out

    fp8 = TorchModelRunner(fp8_build[0], device="cuda", num_blocks=8)  # blocks of 16: 48 tokens in blocks 0-2
    assert fp8.kv_dtype == FP8 and fp8.kv_fallback is None and fp8.kv_caches[0][0].dtype == FP8
    eager = TorchModelRunner(fp8_build[0], device="cuda", num_blocks=8, cuda_graphs=False)
    assert greedy(fp8) == greedy(eager)
    monkeypatch.setenv(kv_alloc.FP8_ENV, "0")
    wide = TorchModelRunner(fp8_build[0], device="cuda", num_blocks=8)
    assert wide.kv_dtype == torch.bfloat16
    assert sum(a == b for a, b in zip(greedy(fp8), greedy(wide))) >= 6

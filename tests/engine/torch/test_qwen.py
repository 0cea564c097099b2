"""Qwen2 (q, k, v biases) and Qwen3 (per-head q, k norms) in the portable engine: its logits against transformers'
own Qwen2ForCausalLM / Qwen3ForCausalLM (float32, paged prefill chunks and decodes), the int4 CPU kernels and the
CUDA path (Triton's interpreter) against the dequantized model of the same IR."""

from __future__ import annotations

import json

import pytest
import torch

from llmc.engine.torch.loader import load_model
from tests import factories
from tests.engine.torch.helpers import PagedSession, rtn_quantize_hf, write_ir
from tests.engine.torch.test_model import assert_matches, random_ids, run_schedule

FAMILIES = ("qwen2", "qwen3")
SCHEDULE = [{"a": (0, 9), "b": (0, 5)}, {"a": (9, 10), "b": (5, 13)}, {"a": (10, 11), "b": (13, 14)},
            {"a": (11, 12), "b": (14, 15)}]  # prompt chunks, a decode beside a chunk, decodes


@pytest.fixture(scope="module", params=FAMILIES)
def qwen_hf_dir(request, tmp_path_factory, smollm2_tokenizer_dir):
    return factories.make_tiny_qwen(tmp_path_factory.mktemp(request.param) / "hf", smollm2_tokenizer_dir,
                                    family=request.param)


def _hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def test_qwen_logits_match_transformers(qwen_hf_dir, tmp_path):
    ir = write_ir(qwen_hf_dir, tmp_path / "ir")
    config = json.loads((ir / "config.json").read_text())
    model = load_model(ir, "cpu")
    attention = model.transformer.layers[0].attention
    if config["architecture"] == "Qwen2ForCausalLM":
        assert attention.qkv_bias is not None and attention.q_layernorm is None
    else:
        assert attention.qkv_bias is None and attention.q_layernorm.weight.shape == (32,)
    seqs = {"a": random_ids(12, 1), "b": random_ids(15, 2)}
    got = run_schedule(model, SCHEDULE, seqs)
    hf = _hf_model(qwen_hf_dir)
    assert_matches(hf, got, seqs)
    # The biases / head norms must matter, or matching transformers would prove nothing about them.
    with torch.no_grad():
        for layer in model.transformer.layers:
            if layer.attention.qkv_bias is not None:
                layer.attention.qkv_bias.zero_()
            else:
                layer.attention.q_layernorm.weight.fill_(1.0)
                layer.attention.k_layernorm.weight.fill_(1.0)
    changed = run_schedule(model, SCHEDULE, seqs)
    assert (changed["a"] - got["a"]).abs().max() > 1e-2


def test_qwen_tensor_parallel_ir_merges_to_the_same_logits(qwen_hf_dir, tmp_path):
    """tp 2: the qkv bias is split with q, k and v's rows, the head norms are held whole by both ranks."""
    one = load_model(write_ir(qwen_hf_dir, tmp_path / "tp1"), "cpu")
    two = load_model(write_ir(qwen_hf_dir, tmp_path / "tp2", tp_size=2), "cpu")
    seqs = {"a": random_ids(12, 1), "b": random_ids(15, 2)}
    a, b = run_schedule(one, SCHEDULE, seqs), run_schedule(two, SCHEDULE, seqs)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in seqs)


def _int4_ir(hf_dir, tmp_path):
    quantized, _ = rtn_quantize_hf(hf_dir, group_size=64)
    return write_ir(hf_dir, tmp_path / "w4a16", dtype="bfloat16", quantized=quantized, group_size=64)


def _run(model) -> torch.Tensor:
    seqs = {"a": random_ids(12, 1), "b": random_ids(15, 2)}
    out = run_schedule(model, SCHEDULE, seqs)
    return torch.cat([out["a"], out["b"]]).float()


def test_qwen_int4_cpu_kernels_match_the_dequantized_model(qwen_hf_dir, tmp_path):
    from llmc.engine.torch.int4_cpu import Int4Linear, int4_kernel_available

    ir = _int4_ir(qwen_hf_dir, tmp_path)
    fast = load_model(ir, "cpu", cpu_kernels=True)
    if int4_kernel_available():  # the kernels replace qkv; the bias stays with the attention
        assert isinstance(fast.transformer.layers[0].attention.qkv, Int4Linear)
    reference = load_model(ir, "cpu", cpu_kernels=False)
    ref, got = _run(reference), _run(fast)
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_qwen_cuda_path_matches_the_dequantized_model(qwen_hf_dir, tmp_path):
    """The CUDA decoder (Triton's interpreter on CPU tensors): packed int4 layers, folded prequant, the fused RoPE +
    KV write fed with the biased / head-normed q and k (never a qkv layer's own RoPE epilogue, which adds no bias
    and norms no head), against the dequantized bf16 model of the same IR; and a 16-bit IR's fused path."""
    ir = _int4_ir(qwen_hf_dir, tmp_path)
    fast = load_model(ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True)
    assert fast.cuda_fused
    for layer in fast.transformer.layers:
        def refuse(*args, **kwargs):
            raise AssertionError("the qkv layer's RoPE epilogue must not run for a biased / head-normed qkv")

        layer.attention.qkv.rope_write_kv = refuse
    reference = load_model(ir, "cpu", dtype=torch.bfloat16, cuda_kernels=False)
    ref, got = _run(reference), _run(fast)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    plain_ir = write_ir(qwen_hf_dir, tmp_path / "bf16", dtype="bfloat16")
    fused16 = load_model(plain_ir, "cpu", dtype=torch.bfloat16, triton_on_cpu=True)
    eager16 = load_model(plain_ir, "cpu", dtype=torch.bfloat16, cuda_kernels=False)
    ref16, got16 = _run(eager16), _run(fused16)
    assert fused16.cuda_fused and (got16 - ref16).abs().max() < 0.05 * ref16.abs().max()


def test_qwen_decode_session_keeps_its_cache(qwen_hf_dir, tmp_path):
    """Single-token decodes over a paged cache give the full sequence's logits (the biased k and v, or the normed
    k, are what the cache holds)."""
    model = load_model(write_ir(qwen_hf_dir, tmp_path / "ir"), "cpu")
    ids = random_ids(10, 5)
    session = PagedSession(model)
    got = torch.cat([session.step({"a": ids[:4]})["a"]] + [session.step({"a": [t]})["a"] for t in ids[4:]])
    assert_matches(_hf_model(qwen_hf_dir), {"a": got}, {"a": ids})


def test_qwen_gguf_converts_to_the_same_model(qwen_hf_dir, tmp_path):
    """A Qwen2 / Qwen3 GGUF (llama.cpp's names; Qwen3's head size only in attention.key_length, which transformers'
    GGUF loader does not read) converts to the HF model it was written from: the architecture, the tokenizer's ids
    and the engine's logits of the converted IR against the original model."""
    from llmc.recipe import ModelSource
    from llmc.source.load import resolve_source
    from llmc.tokenizer import load_tokenizer

    gguf = factories.write_qwen_gguf(qwen_hf_dir, tmp_path / "model.gguf")
    source = resolve_source(ModelSource(kind="path", path=gguf), cache_dir=tmp_path / "cache")
    original = json.loads((qwen_hf_dir / "config.json").read_text())
    assert source.hf_config["architectures"] == original["architectures"]
    text = "The capital of France is Paris. 你好"
    assert load_tokenizer(source.hf_dir).encode(text) == load_tokenizer(qwen_hf_dir).encode(text)
    model = load_model(write_ir(source.hf_dir, tmp_path / "ir"), "cpu")
    seqs = {"a": random_ids(12, 1), "b": random_ids(15, 2)}
    assert_matches(_hf_model(qwen_hf_dir), run_schedule(model, SCHEDULE, seqs), seqs)


def test_qwen_with_yarn_matches_transformers(tmp_path, smollm2_tokenizer_dir):
    """Qwen2.5's documented long-context setting (YaRN rope scaling added to its config), here with an original
    context of 16 tokens so the test's positions lie past it: paged prefill chunks and decodes equal transformers'."""
    from transformers import AutoModelForCausalLM

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    hf_dir = factories.make_tiny_qwen(tmp_path / "hf", smollm2_tokenizer_dir, rope_parameters=yarn)
    model = load_model(write_ir(hf_dir, tmp_path / "ir"), "cpu")
    assert model.config.rope_scaling.rope_type == "yarn"
    seqs = {"a": random_ids(40, 30)}
    got = run_schedule(model, [{"a": (0, 25)}, {"a": (25, 26)}, {"a": (26, 40)}], seqs)
    assert_matches(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), got, seqs)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_rope_kernel_adds_the_bias_and_norms_the_heads_like_the_reference(family):
    """CUDA decode steps of Qwen run one Triton kernel (here Triton's interpreter) for the bias, the per-head norms,
    RoPE and the KV write: its q, cached k and cached v equal the reference ops' (the model's ``_qkv_for_rope`` then
    the rope kernel without extras) within one bf16 rounding, and the extras change the result."""
    from llmc.engine.torch import fused_triton, triton_support
    from llmc.engine.torch.model import Attention, ModelConfig
    from llmc.engine.torch.rope import rope_cos_sin, rope_inv_freq

    if not triton_support.interpreting():
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by the test session)")
    nh, nkv, hd, t = 4, 2, 32, 3
    config = ModelConfig(vocab_size=8, hidden_size=64, num_layers=1, num_heads=nh, num_kv_heads=nkv, head_size=hd,
                         intermediate_size=64, norm_epsilon=1e-6, rotary_base=10000.0, rope_scaling=None,
                         max_position_embeddings=64, tie_word_embeddings=True, dtype="bfloat16",
                         qkv_bias=family == "qwen2", qk_norm=family == "qwen3")
    gen = torch.Generator().manual_seed(0)
    attention = Attention(config, torch.bfloat16)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 1 else 0.1) + (p.dim() == 1))
    x = torch.randn(t, 64, generator=gen).bfloat16()
    cos, sin = rope_cos_sin(rope_inv_freq(hd, 10000.0, None), torch.tensor([1, 7, 30]), torch.bfloat16)
    slots = torch.tensor([2, 5, 11])

    def run(fused: bool):
        caches = torch.zeros(2, 4, 4, nkv, hd, dtype=torch.bfloat16)
        with torch.no_grad():
            if fused:
                q = fused_triton.rope_write_kv(attention.qkv(x), cos, sin, caches[0], caches[1], slots, nh, nkv, hd,
                                               **attention._rope_extras())
            else:
                q = fused_triton.rope_write_kv(attention._qkv_for_rope(x), cos, sin, caches[0], caches[1], slots, nh,
                                               nkv, hd)
        return q.float(), caches.float()

    (q, caches), (q_ref, caches_ref) = run(True), run(False)
    for got, want in ((q, q_ref), (caches, caches_ref)):
        assert (got - want).abs().max() <= 2 ** -6 * want.abs().max()
    with torch.no_grad():
        plain_q = fused_triton.rope_write_kv(attention.qkv(x), cos, sin, torch.zeros_like(caches_ref[0]).bfloat16(),
                                             torch.zeros_like(caches_ref[1]).bfloat16(), slots, nh, nkv, hd).float()
    assert (plain_q - q_ref).abs().max() > 0.05 * q_ref.abs().max()

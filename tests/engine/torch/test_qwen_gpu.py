"""Qwen2 and Qwen3 on CUDA (run through the device tool): float32 logits against transformers, the int4 kernels
against the CPU engine on the same IR, and int4 decode steps replayed from CUDA graphs against eager steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmc.engine.torch.loader import CUDA_KERNELS_ENV, load_model
from tests import factories
from tests.engine.torch.helpers import rtn_quantize_hf, write_ir
from tests.engine.torch.test_gpu import paged_logits

pytestmark = pytest.mark.gpu

# Qwen2.5-0.5B's and Qwen3-0.6B's layer shapes (fewer layers, SmolLM2's vocabulary); random weights.
SHAPES = {
    "qwen2": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                  num_key_value_heads=2, head_dim=64, rope_theta=1000000.0),
    "qwen3": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, rope_theta=1000000.0),
}


def random_qwen(path, family, **overrides):
    (path / "no_tokenizer").mkdir(parents=True, exist_ok=True)
    return factories.make_tiny_qwen(path / "hf", path / "no_tokenizer", family=family, **overrides)


def kl(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return F.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tiny_qwen_fp32_logits_on_cuda_match_transformers(family, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = random_qwen(tmp_path, family)
    model = load_model(write_ir(hf_dir, tmp_path / "ir"), "cuda", dtype=torch.float32)
    ids = list(range(300, 345))
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval().cuda()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids], device="cuda")).logits[0].float()
    assert (paged_logits(model, ids) - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_int4_on_cuda_matches_the_cpu_engine_and_graphs_equal_eager(family, tmp_path, monkeypatch):
    """llmc's CUDA int4 kernels on a Qwen-shaped W4A16 IR vs its CPU engine (float32): no error beyond bf16's (the
    same IR dequantized to bf16 on CUDA is the yardstick); then decode steps from CUDA graphs give eager's tokens."""
    from llmc.engine.torch.cuda_graphs import CHUNKS_ENV
    from llmc.engine.torch.int4_cuda import Int4CudaLinear
    from tests.engine.torch.helpers import build_dir_around, graph_and_eager_tokens

    hf_dir = random_qwen(tmp_path, family, **SHAPES[family])
    quantized, _ = rtn_quantize_hf(hf_dir, group_size=64)
    ir = write_ir(hf_dir, tmp_path / "ir", dtype="bfloat16", quantized=quantized, group_size=64)
    ids = torch.randint(100, 49000, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    cuda_model = load_model(ir, "cuda")
    assert {m.backend for m in cuda_model.modules() if isinstance(m, Int4CudaLinear)} == {"mma"}
    got = paged_logits(cuda_model, ids)
    ref = paged_logits(load_model(ir, "cpu"), ids)
    with monkeypatch.context() as env:
        env.setenv(CUDA_KERNELS_ENV, "0")
        yardstick = kl(paged_logits(load_model(ir, "cuda"), ids), ref)
    print(f"{family}: mean KL vs the CPU engine: int4 kernels {kl(got, ref):.2e}, dequantized bf16 {yardstick:.2e}")
    assert kl(got, ref) <= 1.25 * yardstick + 1e-3
    del cuda_model
    monkeypatch.setenv(CHUNKS_ENV, "0")  # prompt chunks eager (see test_int4_cuda_gpu's graph test)
    outs = graph_and_eager_tokens(build_dir_around(ir, tmp_path / "build"))
    assert outs[True] == outs[False]

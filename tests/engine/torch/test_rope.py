"""RoPE tables and rotation: bit-identical to transformers' Llama rotary embedding, in float32 and bfloat16."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llmc.engine.torch.rope import apply_rope, rope_cos_sin, rope_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_equals_transformers(dtype):
    torch.manual_seed(0)
    head_size, positions = 64, torch.tensor([0, 1, 7, 300, 4095])
    inv_freq = rope_inv_freq(head_size, 10000.0, None)
    q = torch.randn(len(positions), 9, head_size).to(dtype)  # [T, nh, hd]
    k = torch.randn(len(positions), 3, head_size).to(dtype)  # [T, nkv, hd]
    # transformers: emb = cat(freqs, freqs); cos/sin in float32, cast to the activations' dtype; [B, heads, T, hd].
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, T, hd]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos().to(dtype),
                                      emb.sin().to(dtype))
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    assert cos.shape == sin.shape == (len(positions), 1, head_size) and cos.dtype == dtype
    qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)  # q and k heads rotated in one call, as the model does
    assert qk.dtype == dtype
    assert torch.equal(qk[:, :9], hf_q[0].transpose(0, 1))
    assert torch.equal(qk[:, 9:], hf_k[0].transpose(0, 1))


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="llmc's CPU kernels need AVX-512")
def test_the_cpu_kernel_rotates_bit_for_bit_like_the_torch_ops(monkeypatch):
    from llmc.engine.torch import cpu_ext

    torch.manual_seed(1)
    positions = torch.tensor([0, 3, 64, 2047, 9000, 5])
    cos, sin = rope_cos_sin(rope_inv_freq(64, 10000.0, None), positions)
    qkv = torch.randn(len(positions), (9 + 3 + 3) * 64)
    x = qkv[:, : 12 * 64].view(len(positions), 12, 64)  # q and k heads: a strided view of qkv, as in the model
    assert cpu_ext.rope_available(x, cos)
    fused = apply_rope(x, cos, sin)
    monkeypatch.setattr(cpu_ext, "rope_available", lambda x, cos: False)
    assert torch.equal(fused, apply_rope(x, cos, sin)) and not torch.equal(fused, x)


def test_position_zero_is_identity():
    inv_freq = rope_inv_freq(8, 10000.0, None)
    x = torch.randn(1, 2, 8)
    cos, sin = rope_cos_sin(inv_freq, torch.tensor([0]))
    assert torch.equal(apply_rope(x, cos, sin), x)


@pytest.mark.parametrize("params", [
    {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5's documented 128K setting
    {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.8},
    {"factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 1.3},
], ids=["qwen", "betas", "mscale", "attention_factor"])
def test_yarn_frequencies_and_attention_factor_equal_transformers(params):
    """YaRN's inverse frequencies and the factor on cos / sin, against transformers' own YaRN parameters."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmc.engine.torch.rope import RopeScaling, rope_attention_factor

    base, head_size = 1000000.0, 128
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=head_size, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "yarn", "rope_theta": base, **params})
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    scaling = RopeScaling.from_config({"type": "yarn", **params})
    got = rope_inv_freq(head_size, base, scaling)
    assert torch.allclose(got, want_inv_freq.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)
    assert not torch.allclose(got, rope_inv_freq(head_size, base, None))  # the scaling changes something
    cos, sin = rope_cos_sin(got, torch.tensor([0, 5]), torch.float32, rope_attention_factor(scaling))
    assert cos[0, 0, 0].item() == pytest.approx(want_factor) and sin[0, 0].abs().max().item() == 0


def test_yarn_needs_its_original_context():
    from llmc.engine.torch.rope import RopeScaling
    from llmc.errors import CheckpointError

    with pytest.raises(CheckpointError, match="original_max_position_embeddings"):
        RopeScaling.from_config({"rope_type": "yarn", "factor": 4.0})

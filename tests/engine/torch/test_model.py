"""The packed paged forward pass of llmc.engine.torch.model against transformers' LlamaForCausalLM (fp32)."""

from __future__ import annotations

import pytest
import torch

from llmc.engine.torch.loader import load_model
from llmc.engine.torch.model import ModelConfig
from llmc.errors import CheckpointError
from tests import factories
from tests.engine.torch.helpers import PagedSession, write_ir

TOL = 1e-4


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of one unpadded sequence, [n, V]."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def run_schedule(model, schedule: list[dict[str, tuple[int, int]]], seqs: dict[str, list[int]]) -> dict:
    """Run steps given as {request: (start, end)} token ranges; returns each request's logits, in order."""
    session = PagedSession(model)
    out: dict[str, list[torch.Tensor]] = {rid: [] for rid in seqs}
    for step in schedule:
        result = session.step({rid: seqs[rid][a:b] for rid, (a, b) in step.items()})
        for rid, logits in result.items():
            out[rid].append(logits)
    return {rid: torch.cat(chunks) for rid, chunks in out.items()}


def assert_matches(hf_model, got: dict[str, torch.Tensor], seqs: dict[str, list[int]]) -> None:
    for rid, ids in seqs.items():
        ref = reference_logits(hf_model, ids)
        assert got[rid].shape == ref.shape
        diff = (got[rid] - ref).abs().max().item()
        assert diff < TOL, f"{rid}: max abs logits diff {diff}"


def test_prefill_matches_transformers(tiny_model, tiny_hf_model):
    seqs = {"a": random_ids(21, 0)}
    assert_matches(tiny_hf_model, run_schedule(tiny_model, [{"a": (0, 21)}], seqs), seqs)


def test_chunked_prefill_matches_transformers(tiny_model, tiny_hf_model):
    seqs = {"a": random_ids(23, 1)}
    schedule = [{"a": (0, 6)}, {"a": (6, 15)}, {"a": (15, 23)}]  # chunks cross block boundaries (block size 4)
    assert_matches(tiny_hf_model, run_schedule(tiny_model, schedule, seqs), seqs)


def test_batched_decode_of_different_lengths_matches_transformers(tiny_model, tiny_hf_model):
    lengths = {"a": 5, "b": 12, "c": 1, "d": 17}
    seqs = {rid: random_ids(n + 6, i + 10) for i, (rid, n) in enumerate(lengths.items())}
    schedule = [{rid: (0, n) for rid, n in lengths.items()}]
    schedule += [{rid: (n + k, n + k + 1) for rid, n in lengths.items()} for k in range(6)]  # decode-only steps
    assert_matches(tiny_hf_model, run_schedule(tiny_model, schedule, seqs), seqs)


def test_mixed_prefill_chunks_and_decodes_in_one_step(tiny_model, tiny_hf_model):
    seqs = {"a": random_ids(10, 20), "b": random_ids(14, 21), "c": random_ids(4, 22)}
    schedule = [
        {"a": (0, 7), "b": (0, 3)},
        {"a": (7, 8), "b": (3, 11)},  # a decodes while b prefills its second chunk
        {"a": (8, 9), "b": (11, 12), "c": (0, 3)},  # c joins
        {"a": (9, 10), "b": (12, 14), "c": (3, 4)},
    ]
    assert_matches(tiny_hf_model, run_schedule(tiny_model, schedule, seqs), seqs)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},  # cos, sin scaled too
    ],
    ids=["llama3", "linear", "yarn"],
)
def test_rope_scaling_matches_transformers(rope, tiny_hf_dir, tmp_path):
    from transformers import LlamaForCausalLM

    hf_dir = factories.make_tiny_llama(tmp_path / "hf", tiny_hf_dir, rope_parameters={**rope, "rope_theta": 10000.0})
    model = load_model(write_ir(hf_dir, tmp_path / "ir"), "cpu")
    assert model.config.rope_scaling is not None and model.config.rope_scaling.rope_type == rope["rope_type"]
    hf_model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    seqs = {"a": random_ids(40, 30)}
    got = run_schedule(model, [{"a": (0, 25)}, {"a": (25, 26)}, {"a": (26, 40)}], seqs)
    assert_matches(hf_model, got, seqs)
    # The scaling must matter at these positions, or this test would prove nothing.
    unscaled = factories.make_tiny_llama(tmp_path / "hf0", tiny_hf_dir)
    plain = reference_logits(LlamaForCausalLM.from_pretrained(unscaled, dtype=torch.float32).eval(), seqs["a"])
    assert (plain - got["a"]).abs().max() > 1e-2


def test_logits_only_for_given_hidden_rows(tiny_model):
    hidden = torch.randn(3, tiny_model.config.hidden_size)
    logits = tiny_model.compute_logits(hidden)
    assert logits.shape == (3, tiny_model.config.vocab_size) and logits.dtype == torch.float32


def test_config_rejects_unsupported_models(tiny_ir_dir):
    import json

    cfg = json.loads((tiny_ir_dir / "config.json").read_text())
    for bad in ({"hidden_act": "gelu"}, {"attn_bias": True}, {"architecture": "GPTForCausalLM"},
                {"rotary_scaling": {"rope_type": "yarn", "factor": 2.0}}, {"num_key_value_heads": 3}):
        with pytest.raises(CheckpointError):
            ModelConfig.from_checkpoint_config({**cfg, **bad})
    with pytest.raises(CheckpointError, match="original_max_position_embeddings"):
        ModelConfig.from_checkpoint_config({**cfg, "rotary_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                       "low_freq_factor": 1, "high_freq_factor": 4}})


def test_loaded_mlps_run_fc_and_gate_as_one_gemm_without_changing_the_weights(tiny_model, tiny_hf_dir, tmp_path):
    mlp = tiny_model.transformer.layers[0].mlp
    assert mlp.fc_gate is not None  # fused by the loader
    # Both Linear weights are views of the stacked tensor: the state dict and memory are unchanged.
    assert mlp.fc.weight.data_ptr() == mlp.fc_gate.data_ptr()
    assert mlp.gate.weight.data_ptr() == mlp.fc_gate[mlp.fc.out_features:].data_ptr()
    assert set(tiny_model.state_dict()) == set(load_model(write_ir(tiny_hf_dir, tmp_path / "ir"), "cpu").state_dict())
    x = torch.randn(5, tiny_model.config.hidden_size)
    unfused = mlp.proj(torch.nn.functional.silu(mlp.fc(x)) * mlp.gate(x))
    torch.testing.assert_close(mlp(x), unfused, rtol=1e-5, atol=1e-6)


def test_float32_rmsnorm_fast_path_is_the_reference_formula(tiny_model):
    norm = tiny_model.transformer.layers[0].input_layernorm
    x = torch.randn(7, tiny_model.config.hidden_size) * 3
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
    torch.testing.assert_close(norm(x), reference, rtol=1e-6, atol=1e-6)


def test_prompt_steps_never_attend_through_cudnn(tiny_model, monkeypatch):
    # cuDNN's SDPA plans every new (query, key) length on the host (tens of ms on an H200): steps with prompt
    # tokens run with it off, decode steps leave the flags alone, and the flags come back after the step.
    import llmc.engine.torch.model as model_module

    seen = []
    original = model_module.paged_attention

    def spy(*args, **kwargs):
        seen.append((args[5].all_decode, torch.backends.cuda.cudnn_sdp_enabled(),
                     torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()))
        return original(*args, **kwargs)

    monkeypatch.setattr(model_module, "paged_attention", spy)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    run_schedule(tiny_model, [{"a": (0, 9)}, {"a": (9, 10)}], {"a": random_ids(10, 3)})
    layers = len(tiny_model.transformer.layers)
    assert seen == [(False, False, True, True)] * layers + [(True, True, True, True)] * layers
    assert torch.backends.cuda.cudnn_sdp_enabled()

"""scripts/greedy_check.py (the GPU-box greedy comparison): its near-tie rule, the KV cache it asks for, and a run
against transformers on the tiny build on CPU (float32: every token equal)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

_SPEC = importlib.util.spec_from_file_location(
    "greedy_check", Path(__file__).resolve().parents[1] / "scripts" / "greedy_check.py")
greedy_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(greedy_check)


def test_bf16_step_is_the_spacing_at_the_value():
    assert greedy_check.bf16_step(20.0) == 0.125 and greedy_check.bf16_step(-20.0) == 0.125
    assert greedy_check.bf16_step(1.0) == 2.0 ** -7 and greedy_check.bf16_step(0.0) == 2.0 ** -133
    # bfloat16 itself: the next number above 20 is 20.125
    assert float(torch.tensor(20.0625 + 1e-3, dtype=torch.bfloat16)) == 20.125


def test_gap_in_bf16_steps():
    logits = torch.tensor([20.0, 19.5, 19.875, -3.0])
    assert greedy_check.gap_of(logits, 0) == {"gap": 0.0, "bf16_step": 0.125, "gap_steps": 0.0}
    assert greedy_check.gap_of(logits, 1) == {"gap": 0.5, "bf16_step": 0.125, "gap_steps": 4.0}
    assert greedy_check.gap_of(logits, 3)["gap_steps"] == 184.0


def test_kv_blocks_cover_every_prompt_at_once(tiny_build_dir):
    prompts = greedy_check.prompts_for(1000, 4)
    assert [len(p) for p in prompts] == [7, 33, 130, 517]
    # the tiny build's blocks hold 8 tokens: (7 + 16) -> 3, (33 + 16) -> 7, (130 + 16) -> 19, (517 + 16) -> 67
    assert greedy_check.kv_blocks_for(tiny_build_dir, prompts, 16) == 3 + 7 + 19 + 67


def test_default_near_tie_is_four_bf16_steps(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["greedy_check.py", "x", "--reference", "dequantized"])
    seen = {}
    monkeypatch.setattr(greedy_check, "against_dequantized", lambda args: seen.setdefault("tie", args.tie_steps))
    greedy_check.main()
    assert seen["tie"] == 4.0


@pytest.mark.parametrize("flag", [[], ["--fp8-cache"]])
def test_an_fp8_build_is_checked_with_a_16bit_cache_unless_asked(flag, monkeypatch):
    """A check of the int4 kernels: both runs get a 16-bit cache (LLMC_KV_FP8=0) unless --fp8-cache is given."""
    from llmc.engine.torch.kv_alloc import FP8_ENV

    monkeypatch.delenv(FP8_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", ["greedy_check.py", "x", "--reference", "dequantized", *flag])
    seen = {}
    monkeypatch.setattr(greedy_check, "against_dequantized",
                        lambda args: seen.setdefault("env", os.environ.get(FP8_ENV)))
    greedy_check.main()
    assert seen["env"] == (None if flag else "0")


def test_tiny_build_matches_transformers_on_cpu(tiny_build_dir, tiny_hf_dir, monkeypatch, capsys):
    from llmc.runtime import api

    sizes = []
    real = api.Engine.from_dir.__func__

    def from_dir(cls, path, device="auto", num_blocks=None, **kw):
        sizes.append(num_blocks)
        return real(cls, path, device, num_blocks, **kw)

    monkeypatch.setattr(api.Engine, "from_dir", classmethod(from_dir))
    monkeypatch.setattr(sys, "argv", ["greedy_check.py", str(tiny_build_dir), str(tiny_hf_dir), "--tokens", "8",
                                      "--prompts", "3", "--device", "cpu"])
    assert greedy_check.main() == 0
    out = json.loads(capsys.readouterr().out)
    assert out["all_match"] and out["dtype"] == "torch.float32" and len(out["results"]) == 3
    assert all(r["match"] and r["first_difference"] is None for r in out["results"])
    prompts = greedy_check.build_prompts(tiny_build_dir, 3)
    assert sizes == [greedy_check.kv_blocks_for(tiny_build_dir, prompts, 8)]  # for the prompts, not the recipe's


def test_teacher_forced_logits_follow_the_engines_greedy_tokens(tiny_build_dir):
    """Along the engine's own greedy tokens (float32 on CPU: exact), each teacher-forced row's argmax is the next
    token; the float32 arbiter over one float32 IR finds every run exact."""
    from llmc.engine.torch.loader import load_model

    prompts = greedy_check.build_prompts(tiny_build_dir, 2)
    tokens, _, _ = greedy_check.greedy_tokens(tiny_build_dir, "cpu", prompts, 6)
    model = load_model(greedy_check.ir_dir(tiny_build_dir), "cpu")
    for prompt, generated in zip(prompts, tokens):
        rows = greedy_check.teacher_forced_logits(model, prompt, generated, "cpu")
        assert rows.shape == (6, model.config.vocab_size) and rows.dtype == torch.float32
        assert rows.argmax(-1).tolist() == generated
    report = greedy_check.float32_arbiter(tiny_build_dir, "cpu", prompts, tokens)
    assert report["int4_over_dequantized"] == 0.0 and len(report["per_prompt"]) == 2
    assert report["overall"]["int4"] == {"max_abs": 0.0, "mean_abs": 0.0, "top1_agree": 1.0}


def test_arbiter_ratio_compares_the_mean_errors_against_float32():
    gen = torch.Generator().manual_seed(0)
    exact = [torch.randn(4, 50, generator=gen) for _ in range(2)]
    noise = [torch.randn(4, 50, generator=gen) * 0.01 for _ in range(2)]
    closer = [e + n for e, n in zip(exact, noise)]
    further = [e + 3 * n for e, n in zip(exact, noise)]
    report = greedy_check.arbiter_report(closer, further, exact)
    assert report["int4_over_dequantized"] == pytest.approx(1 / 3, rel=1e-3)
    assert greedy_check.arbiter_report(further, closer, exact)["int4_over_dequantized"] == pytest.approx(3, rel=1e-3)
    one = report["per_prompt"][0]["int4"]
    assert one["max_abs"] == pytest.approx(float((closer[0] - exact[0]).abs().max()), abs=1e-4)
    assert greedy_check.arbiter_report(exact, exact, exact)["int4_over_dequantized"] == 0.0


def test_the_arbiter_needs_the_dequantized_reference(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["greedy_check.py", "x", "y", "--float32-arbiter"])
    with pytest.raises(SystemExit):
        greedy_check.main()
    assert "--float32-arbiter needs --reference dequantized" in capsys.readouterr().err

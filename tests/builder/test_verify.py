"""Accuracy gate: passes for a good int4 IR, fails with a worst-position table for a corrupted layer."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from rich.console import Console

from llmc.builder import gate_report, verify
from llmc.builder.quantize import quantize_checkpoint
from llmc.checkpoint.io import read_checkpoint, write_checkpoint
from llmc.errors import AccuracyGateError
from llmc.recipe import recipe_from_dict


def tiny_recipe(hf_dir, method="awq", max_mean_kl=0.15, max_ppl_ratio=None):
    return recipe_from_dict({"name": "tiny", "model": {"source": str(hf_dir)},
                             "quantization": {"method": method, "group_size": 32,
                                              "calibration": {"n_samples": 8, "seq_len": 64},
                                              "gate": {"max_mean_kl": max_mean_kl, "max_ppl_ratio": max_ppl_ratio,
                                                       "n_tokens": 512}}})


@pytest.fixture(scope="module")
def source(tiny_hf_dir):
    from llmc.source.load import resolve_source

    return resolve_source(tiny_recipe(tiny_hf_dir).model)


@pytest.fixture(scope="module")
def awq_checkpoint(source, tiny_hf_dir, tmp_path_factory):
    from llmc.builder import quantize

    ckpt = tmp_path_factory.mktemp("gate") / "checkpoint"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantize, "AWQ_N_GRID", 4)  # a short scale search is enough for a tiny model
        quantize_checkpoint(source, tiny_recipe(tiny_hf_dir), ckpt)
    return ckpt


@pytest.fixture(autouse=True)
def short_chat_check(monkeypatch):
    """The tiny random model never ends a turn; a short budget keeps the (vacuous) chat check fast."""
    monkeypatch.setattr(verify, "CHAT_PROMPTS", 1)
    monkeypatch.setattr(verify, "CHAT_BUDGET", 4)


def quiet() -> Console:
    return Console(file=open("/dev/null", "w"))


@pytest.mark.slow
def test_gate_passes_for_awq_and_reports_metrics(source, tiny_hf_dir, awq_checkpoint):
    report = verify.accuracy_gate(source, tiny_recipe(tiny_hf_dir), awq_checkpoint, console=quiet())
    m = report["metrics"]
    assert report["passed"] and report["failures"] == []
    assert m["tokens"] == 512 and m["windows"] == 1
    assert 0 <= m["kl_mean"] <= m["kl_p99"] <= m["kl_max"] and m["kl_mean"] < 0.15
    assert 0 < m["top1_agreement"] <= 1 and m["ppl_16bit"] > 1 and m["ppl_int4"] > 1
    assert len(report["worst_positions"]) == gate_report.WORST_POSITIONS
    assert report["worst_positions"][0]["kl"] == pytest.approx(m["kl_max"], abs=1e-3)


@pytest.mark.slow
def test_one_corrupted_layer_fails_the_gate(source, tiny_hf_dir, awq_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(awq_checkpoint, bad)
    config, (rank0,) = read_checkpoint(bad)
    rank0["transformer.layers.1.mlp.proj.weights_scaling_factor"] *= 50
    write_checkpoint(bad, config, [rank0])
    with pytest.raises(AccuracyGateError, match="mean KL .* > max_mean_kl 0.15") as info:
        verify.accuracy_gate(source, tiny_recipe(tiny_hf_dir), bad, console=quiet())
    message = str(info.value)
    assert "Worst positions" in message and "top-1 16-bit" in message
    report = info.value.report
    assert not report["passed"] and report["metrics"]["kl_mean"] > 0.15
    assert report["worst_positions"][0]["kl"] >= report["metrics"]["kl_p99"]


def test_ir_to_hf_state_dict_round_trips_a_16bit_export(source, tiny_hf_dir, tmp_path):
    from llmc.builder.export import export_checkpoint
    from llmc.source.load import load_state_dict

    recipe = recipe_from_dict({"name": "tiny", "model": {"source": str(tiny_hf_dir), "dtype": "float32"}})
    export_checkpoint(source, recipe, tmp_path / "ckpt")
    restored = verify.ir_to_hf_state_dict(tmp_path / "ckpt", source.hf_config)
    original = load_state_dict(tiny_hf_dir)
    assert set(restored) == {k for k in original if k != "lm_head.weight"}
    for name, tensor in restored.items():
        assert torch.equal(tensor, original[name].float()), name


def test_window_scores_zero_kl_for_identical_logits():
    ids = torch.tensor([3, 1, 4, 1])
    logits = torch.randn(4, 10)
    kl, nll_16, nll_int4, top_16, top_int4 = gate_report.window_scores(ids, logits, logits.clone())
    assert torch.allclose(kl, torch.zeros(4, dtype=torch.float64), atol=1e-12)
    assert torch.equal(nll_16, nll_int4) and torch.equal(top_16, top_int4)
    expected = -torch.log_softmax(logits.double(), -1)[0, 1]
    assert nll_16[0].item() == pytest.approx(expected.item())


def test_window_scores_kl_matches_definition():
    p_logits, q_logits = torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([[0.0, 2.0, 0.0]])
    kl, *_ = gate_report.window_scores(torch.tensor([0]), p_logits, q_logits)
    p, q = torch.softmax(p_logits.double(), -1)[0], torch.softmax(q_logits.double(), -1)[0]
    assert kl[0].item() == pytest.approx(float((p * (p / q).log()).sum()))


def test_summarize_and_thresholds():
    scores = gate_report.Scores(
        input_ids=torch.zeros(1, 3, dtype=torch.long), kl=torch.tensor([[0.1, 0.2, 0.9]], dtype=torch.float64),
        nll_16=torch.tensor([[1.0, 1.0]], dtype=torch.float64), nll_int4=torch.tensor([[1.5, 1.5]], dtype=torch.float64),
        top1_16=torch.tensor([[1, 2, 3]]), top1_int4=torch.tensor([[1, 2, 4]]))
    m = gate_report.summarize(scores)
    assert m["ppl_16bit"] == pytest.approx(math.e, abs=1e-3) and m["ppl_ratio"] == pytest.approx(math.exp(0.5), abs=1e-3)
    assert m["kl_mean"] == pytest.approx(0.4) and m["kl_max"] == pytest.approx(0.9)
    assert m["top1_agreement"] == pytest.approx(2 / 3, abs=1e-3)
    assert gate_report.check_thresholds(m, 0.5, None, []) == []
    assert len(gate_report.check_thresholds(m, 0.3, 1.5, ["prompt 0: lost"])) == 3


def test_heldout_windows_too_few_tokens_is_a_build_error(tiny_hf_dir):
    from llmc.errors import BuildError
    from llmc.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_hf_dir)
    assert verify.heldout_windows(tok, 1000).shape == (2, 512)
    with pytest.raises(BuildError, match="lower quantization.gate.n_tokens"):
        verify.heldout_windows(tok, 10_000_000)

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
def test_gate_scores_every_domain_against_16bit_and_rtn(source, tiny_hf_dir, awq_checkpoint):
    console = Console(record=True, width=120, file=open("/dev/null", "w"))
    report = verify.accuracy_gate(source, tiny_recipe(tiny_hf_dir), awq_checkpoint, console=console)
    assert report["passed"] and report["failures"] == [] and report["skipped_domains"] == {}
    assert list(report["domains"]) == ["pydoc", "prose", "code", "chat", "chinese"]
    for name, d in report["domains"].items():
        m, r = d["int4"], d["rtn"]
        assert d["tokens"] == 512 and d["windows"] == 1 and d["ppl_16bit"] > 1
        assert 0 <= m["kl_mean"] <= m["kl_p99"] <= m["kl_max"] and 0 < m["top1_agreement"] <= 1
        assert r["kl_mean"] > 0 and d["kl_vs_rtn"] == pytest.approx(m["kl_mean"] / r["kl_mean"], rel=1e-3)
        assert d["ppl_vs_rtn"] == pytest.approx(m["ppl_int4"] / r["ppl_int4"], rel=1e-3)
        worst = report["worst_positions"][name]
        assert len(worst) == gate_report.WORST_POSITIONS and worst[0]["kl"] == pytest.approx(m["kl_max"], abs=1e-3)
    mean = report["mean"]
    assert mean["domains"] == 5
    assert mean["int4"]["kl_mean"] == pytest.approx(
        sum(d["int4"]["kl_mean"] for d in report["domains"].values()) / 5, abs=1e-5)
    assert report["device"]["type"] == "cpu" and report["dtype"] == "float32" and report["peak_gpu_memory_bytes"] is None
    table = console.export_text()
    assert all(name in table for name in report["domains"]) and "KL/RTN" in table and "mean" in table


@pytest.mark.slow
def test_one_corrupted_layer_fails_the_gate(source, tiny_hf_dir, awq_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(awq_checkpoint, bad)
    config, (rank0,) = read_checkpoint(bad)
    rank0["transformer.layers.1.mlp.proj.weights_scaling_factor"] *= 50
    write_checkpoint(bad, config, [rank0])
    with pytest.raises(AccuracyGateError, match=r"pydoc: mean KL .* > max_mean_kl 0.15") as info:
        verify.accuracy_gate(source, tiny_recipe(tiny_hf_dir), bad, console=quiet())
    message = str(info.value)
    assert "Worst positions" in message and "top-1 16-bit" in message
    report = info.value.report
    assert not report["passed"] and all(d["int4"]["kl_mean"] > 0.15 for d in report["domains"].values())
    assert all(d["kl_vs_rtn"] > 1 for d in report["domains"].values())  # worse than plain rounding everywhere


@pytest.mark.slow
def test_bounds_relative_to_rtn_fail_the_gate_per_domain(source, tiny_hf_dir, awq_checkpoint):
    from dataclasses import replace

    recipe = tiny_recipe(tiny_hf_dir, max_mean_kl=10)
    strict = replace(recipe, quantization=replace(recipe.quantization, gate=replace(
        recipe.quantization.gate, max_kl_vs_rtn=1e-6, max_ppl_vs_rtn=1e-6, domains=("code", "chinese"))))
    with pytest.raises(AccuracyGateError) as info:
        verify.accuracy_gate(source, strict, awq_checkpoint, console=quiet())
    failures = info.value.report["failures"]
    assert list(info.value.report["domains"]) == ["code", "chinese"]
    assert any(f.startswith("code: mean KL") and "x RTN's > max_kl_vs_rtn" in f for f in failures)
    assert any(f.startswith("chinese: perplexity") and "max_ppl_vs_rtn" in f for f in failures)


def test_rtn_twin_is_the_rtn_build_bit_for_bit(source, tiny_hf_dir, tmp_path):
    rtn = tiny_recipe(tiny_hf_dir, method="rtn")
    quantize_checkpoint(source, rtn, tmp_path / "rtn")
    models = verify.GateModels(source, rtn, tmp_path / "rtn", torch.device("cpu"), torch.float32)
    written = {k: v.clone() for k, v in models.use("int4").state_dict().items()}
    twin = {k: v.clone() for k, v in models.use("rtn").state_dict().items()}
    assert set(written) == set(twin)
    for name, tensor in written.items():
        assert torch.equal(twin[name], tensor), name
    reference = models.use("16bit").state_dict()
    assert not torch.equal(reference["model.layers.0.mlp.up_proj.weight"], twin["model.layers.0.mlp.up_proj.weight"])


def test_rtn_dequantized_rounds_per_group_with_library_scales():
    w = torch.tensor([[0.0, 1.0, -3.0, 0.5, 2.0, 2.0, 2.0, -2.0]])
    out = verify.rtn_dequantized(w, 4, torch.float16)
    scale_a, scale_b = torch.tensor(3 / 7.5).half().float(), torch.tensor(2 / 7.5).half().float()
    expected_a = (w[0, :4] / scale_a).round().clamp(-8, 7) * scale_a
    expected_b = (w[0, 4:] / scale_b).round().clamp(-8, 7) * scale_b
    assert torch.equal(out[0], torch.cat([expected_a, expected_b]))
    assert torch.equal(verify.rtn_dequantized(torch.zeros(2, 4), 4, torch.float16), torch.zeros(2, 4))


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


def test_summarize_domain_metrics_mean_and_bounds():
    def scores(kl, nll_q, top_q):
        return gate_report.Scores(
            input_ids=torch.zeros(1, 3, dtype=torch.long), kl=torch.tensor([kl], dtype=torch.float64),
            nll_16=torch.tensor([[1.0, 1.0]], dtype=torch.float64), nll_int4=torch.tensor([nll_q], dtype=torch.float64),
            top1_16=torch.tensor([[1, 2, 3]]), top1_int4=torch.tensor([top_q]))
    m = gate_report.summarize(scores([0.1, 0.2, 0.9], [1.5, 1.5], [1, 2, 4]))
    assert m["ppl_16bit"] == pytest.approx(math.e, abs=1e-3) and m["ppl_ratio"] == pytest.approx(math.exp(0.5), abs=1e-3)
    assert m["kl_mean"] == pytest.approx(0.4) and m["kl_max"] == pytest.approx(0.9)
    assert m["top1_agreement"] == pytest.approx(2 / 3, abs=1e-3)
    good = gate_report.domain_metrics({"int4": scores([0.1, 0.1, 0.1], [1.1, 1.1], [1, 2, 3]),
                                       "rtn": scores([0.4, 0.4, 0.4], [1.4, 1.4], [1, 2, 4])})
    bad = gate_report.domain_metrics({"int4": scores([0.3, 0.3, 0.3], [1.5, 1.5], [1, 2, 3]),
                                      "rtn": scores([0.2, 0.2, 0.2], [1.2, 1.2], [1, 2, 4])})
    assert good["kl_vs_rtn"] == pytest.approx(0.25) and good["ppl_vs_rtn"] == pytest.approx(math.exp(-0.3), rel=1e-3)
    assert good["tokens"] == 3 and good["rtn"]["top1_agreement"] == pytest.approx(2 / 3, abs=1e-3)
    mean = gate_report.mean_over_domains({"a": good, "b": bad})
    assert mean["int4"]["kl_mean"] == pytest.approx(0.2) and mean["rtn"]["kl_mean"] == pytest.approx(0.3)
    assert mean["kl_vs_rtn"] == pytest.approx(0.2 / 0.3, rel=1e-3)
    gate = recipe_from_dict({"name": "t", "model": {"source": "/x"}, "quantization": {"gate": {
        "max_mean_kl": 0.5, "max_kl_vs_rtn": 0.6, "max_ppl_vs_rtn": 1.0}}}, check_inputs=False).quantization.gate
    assert gate_report.check_domains({"a": good}, gate) == []
    failures = gate_report.check_domains({"a": good, "b": bad}, gate)
    assert len(failures) == 2 and all(f.startswith("b: ") for f in failures)
    assert gate_report.worst_domain({"a": good, "b": bad}) == "b"


def test_no_readable_domain_is_a_build_error(source, tiny_hf_dir, tmp_path, monkeypatch):
    from dataclasses import replace

    from llmc.builder import heldout
    from llmc.errors import BuildError

    monkeypatch.setattr(heldout, "domain_text", lambda name: "too short")
    recipe = tiny_recipe(tiny_hf_dir)
    recipe = replace(recipe, quantization=replace(recipe.quantization, gate=replace(
        recipe.quantization.gate, domains=("prose",))))
    with pytest.raises(BuildError, match="no held-out text: prose: 2 tokens.*Fix"):
        verify.accuracy_gate(source, recipe, tmp_path, console=quiet())


def test_domains_table_prints_huge_perplexities_whole():
    # A random model's perplexities are ~1e12: 4 significant digits, and at the log width no cell is cut.
    def domain(ppl):
        return {"tokens": 2048, "ppl_16bit": ppl, "rtn": {"ppl_int4": ppl * 0.9, "kl_mean": 1.0},
                "int4": {"ppl_int4": ppl * 0.8, "kl_mean": 0.5, "top1_agreement": 0.5}, "kl_vs_rtn": 0.5}
    report = {"passed": True, "thresholds": {"max_mean_kl": 10, "max_ppl_ratio": None, "max_kl_vs_rtn": None,
                                             "max_ppl_vs_rtn": None},
              "special_token_check": {"ended_int4": 0, "ended_16bit": 0},
              "domains": {"pydoc": domain(3412786650881.2), "prose": domain(28.637)},
              "mean": {"int4": {"kl_mean": 0.5, "top1_agreement": 0.5}, "rtn": {"kl_mean": 1.0}, "kl_vs_rtn": 0.5}}
    out = Console(record=True, width=180, file=open("/dev/null", "w"))
    out.print(gate_report.domains_table(report))
    text = out.export_text()
    assert "3.413e+12" in text and "2.73e+12" in text and "28.64" in text and "25.77" in text and "…" not in text


def test_batched_chat_check_ends_where_each_prompt_alone_ends(tiny_hf_dir):
    """The chat end check decodes its prompts as one left-padded batch: each prompt's end must be where its own
    unbatched greedy decoding puts it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()
    prompts = [[5, 17, 29, 3, 11, 8, 40], [7, 9], [21, 4, 33, 12]]  # different lengths: left padding is exercised
    alone = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                                 pad_token_id=0)[0, len(ids):].tolist()
            alone.append(out)
    eos = [alone[0][2]]  # a token the model really produces: prompt 0 ends after 3 tokens

    def first_end(tokens):
        return next((i + 1 for i, t in enumerate(tokens) if t in eos), None)

    expected = [first_end(tokens) for tokens in alone]
    assert expected[0] is not None and expected[0] <= 3  # at least one prompt really ends
    with torch.no_grad():
        got = verify._greedy_ends(model, prompts, eos, 8, torch.device("cpu"))
    assert got == expected


def test_window_scores_in_row_chunks_equal_those_of_the_whole_window_bit_for_bit():
    """window_scores goes SCORE_ROWS positions at a time on the CPU; every figure equals the whole window's
    computation exactly, the last chunk (one position short of targets) included."""
    gen = torch.Generator().manual_seed(0)
    length, vocab = 2 * gate_report.SCORE_ROWS + 7, 300
    ids = torch.randint(0, vocab, (length,), generator=gen)
    p_logits, q_logits = torch.randn(length, vocab, generator=gen), torch.randn(length, vocab, generator=gen)
    logp, logq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    targets = ids[1:].unsqueeze(-1)
    whole = ((logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0), -logp[:-1].gather(-1, targets).squeeze(-1),
             -logq[:-1].gather(-1, targets).squeeze(-1), logp.argmax(-1), logq.argmax(-1))
    chunked = gate_report.window_scores(ids, p_logits, q_logits)
    assert [tuple(t.shape) for t in chunked] == [(length,), (length - 1,), (length - 1,), (length,), (length,)]
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole)) and float(chunked[0].mean()) > 0


def test_the_cpu_passes_and_the_gate_run_their_float32_gemms_through_the_chosen_library(source, tiny_hf_dir,
                                                                                        tmp_path, monkeypatch,
                                                                                        gemm_library):
    """With oneDNN chosen (LLMC_CPU_GEMM=onednn) the calibration passes' and the gate's float32 linears go through
    it, the reports say so, and F.linear is PyTorch's own again afterwards."""
    from llmc.builder import quantize
    from llmc.engine.torch import cpu_gemm

    gemm_library("onednn")
    monkeypatch.setattr(quantize, "AWQ_N_GRID", 4)
    calls = []
    real = cpu_gemm._onednn_linear
    monkeypatch.setattr(cpu_gemm, "_onednn_linear", lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    original = torch.nn.functional.linear
    built = quantize_checkpoint(source, tiny_recipe(tiny_hf_dir), tmp_path / "ckpt")
    in_passes = len(calls)
    report = verify.accuracy_gate(source, tiny_recipe(tiny_hf_dir), tmp_path / "ckpt", console=quiet())
    assert in_passes > 0 and len(calls) > in_passes
    assert built["device"]["fp32_gemm"]["library"] == report["device"]["fp32_gemm"]["library"] == "onednn"
    assert report["passed"] and torch.nn.functional.linear is original

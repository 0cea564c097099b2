"""AWQ + GPTQ rounding: same scales and IR as AWQ alone, lower layer error, special tokens out of the Hessian."""

from __future__ import annotations

import pytest
import torch

from llmc.builder import llmcompressor_driver, llmcompressor_patches
from llmc.builder.quantize import export_int4, load_float32_model, quantize_checkpoint
from llmc.checkpoint.int4 import unpack_int4
from llmc.checkpoint.io import read_checkpoint
from tests.builder.test_quantize import GROUP, _spiked_models, calib, source, tiny_recipe  # noqa: F401 - fixtures

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def options(rounding: str, mask: bool = True, gptq_mask: bool = False) -> llmcompressor_driver.Int4Options:
    return llmcompressor_driver.Int4Options(method="awq", group_size=GROUP, scale_dtype=torch.float16, n_grid=4,
                               batch_size=4, use_loss_mask=mask, rounding=rounding, gptq_use_loss_mask=gptq_mask)


@pytest.fixture(scope="module")
def runs(tiny_hf_dir, calib):
    """The tiny model after masked AWQ with nearest rounding and with GPTQ rounding (same AWQ search)."""
    out = {}
    for rounding in ("nearest", "gptq"):
        model = load_float32_model(tiny_hf_dir)
        summary = llmcompressor_driver.run_oneshot(model, options(rounding), calib)
        out[rounding] = (model, summary)
    return out


def test_gptq_keeps_awq_scales_and_rounds_every_layer(runs):
    (nearest, none), (gptq, summary) = runs["nearest"], runs["gptq"]
    assert none == {} and summary == {"modules": 2 * len(PROJECTIONS), "fallback_to_nearest": [],
                                      "hessian_excludes_special_tokens": False}
    n_mods, g_mods = dict(nearest.named_modules()), dict(gptq.named_modules())
    changed = 0
    for layer in range(2):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}"
            assert torch.equal(n_mods[name].weight_scale, g_mods[name].weight_scale), name  # same scales
            q_n = llmcompressor_driver.extract_int4(nearest, GROUP)[name][0]
            q_g = llmcompressor_driver.extract_int4(gptq, GROUP)[name][0]
            changed += int((q_n != q_g).sum())
    assert changed > 0  # GPTQ chose other int4 values than rounding to nearest
    for key in ("model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert torch.equal(nearest.state_dict()[key], gptq.state_dict()[key])  # the same AWQ folding


def test_gptq_lowers_the_layer_output_error_on_calibration_tokens(runs, calib):
    """||X (W - Q)^T|| for the first layer's q/k/v and gate/up, X = their inputs on the kept calibration tokens."""
    (nearest, _), (gptq, _) = runs["nearest"], runs["gptq"]
    keep = calib.loss_mask.bool()
    with torch.no_grad():
        hidden = nearest.model.embed_tokens(calib.input_ids)[keep]  # [N, H]: layer 0's residual input
        layer_n, layer_g = nearest.model.layers[0], gptq.model.layers[0]
        x_attn = layer_n.input_layernorm(hidden)
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = getattr(layer_n.self_attn, proj).weight  # the float AWQ-scaled weight (nearest fake-quantizes)
            q_n = llmcompressor_driver.library_dequantized_weight(getattr(layer_n.self_attn, proj))
            q_g = llmcompressor_driver.library_dequantized_weight(getattr(layer_g.self_attn, proj))
            err_n = float(torch.linalg.norm(x_attn @ (w - q_n).T))
            err_g = float(torch.linalg.norm(x_attn @ (w - q_g).T))
            assert err_g < 0.95 * err_n, (proj, err_g, err_n)


def test_gptq_ir_reproduces_the_library_weights_bit_for_bit(runs, source, tiny_hf_dir, tmp_path):
    gptq, _ = runs["gptq"]
    export_int4(gptq, source, tiny_recipe(tiny_hf_dir), tmp_path / "c")
    _, (rank0,) = read_checkpoint(tmp_path / "c")
    modules = dict(gptq.named_modules())
    for layer in range(2):
        prefix = f"transformer.layers.{layer}.mlp.proj"
        q = unpack_int4(rank0[f"{prefix}.weight"]).float()
        scales = rank0[f"{prefix}.weights_scaling_factor"].float().repeat_interleave(GROUP, dim=1)
        library = llmcompressor_driver.library_dequantized_weight(modules[f"model.layers.{layer}.mlp.down_proj"])
        assert torch.equal(q * scales, library)
        assert torch.equal(library, modules[f"model.layers.{layer}.mlp.down_proj"].weight)  # GPTQ wrote q * s


def _gptq_int4(tiny_hf_dir, calib, gptq_mask):
    """AWQ (masked) + GPTQ on the two spiked models of test_quantize: (base, planted) int4 tensors and norms."""
    results = []
    for model in _spiked_models(tiny_hf_dir):
        llmcompressor_driver.run_oneshot(model, options("gptq", gptq_mask=gptq_mask), calib)
        norm = model.state_dict()["model.layers.0.post_attention_layernorm.weight"].clone()
        results.append((llmcompressor_driver.extract_int4(model, GROUP), norm))
    return results


@pytest.mark.slow
def test_special_token_outliers_stay_out_of_the_gptq_hessian_when_asked(tiny_hf_dir, calib):
    """A 1e3 spike at special-token positions only: with the Hessian masked too, bit-identical int4."""
    assert calib.excluded_positions > 0
    (base, _), (planted, _) = _gptq_int4(tiny_hf_dir, calib, gptq_mask=True)
    for name in base:
        assert all(torch.equal(x, y) for x, y in zip(base[name], planted[name])), name


@pytest.mark.slow
def test_by_default_gptq_weighs_special_token_rows_and_awq_does_not(tiny_hf_dir, calib):
    """The default: AWQ's scales ignore the spike (same folded norms), GPTQ's rounding of the MLP sees it."""
    (base, base_norm), (planted, planted_norm) = _gptq_int4(tiny_hf_dir, calib, gptq_mask=False)
    assert torch.equal(base_norm, planted_norm)
    mlp = [n for n in base if n.endswith(("gate_proj", "up_proj"))]
    assert any(not torch.equal(base[n][0], planted[n][0]) for n in mlp)


def test_quantize_checkpoint_defaults_to_gptq_for_awq_and_reports_it(source, tiny_hf_dir, tmp_path):
    recipe = tiny_recipe(tiny_hf_dir)
    assert recipe.quantization.rounding == "auto" and recipe.quantization.effective_rounding == "gptq"
    report = quantize_checkpoint(source, recipe, tmp_path / "ckpt")
    assert report["rounding"] == "gptq"
    assert report["gptq"]["modules"] == 2 * len(PROJECTIONS) and report["gptq"]["fallback_to_nearest"] == []
    assert report["gptq"]["hessian_excludes_special_tokens"] is False and report["loss_mask"] is True
    assert tiny_recipe(tiny_hf_dir, method="rtn").quantization.effective_rounding == "nearest"


def test_progress_counts_both_calibration_passes():
    events = []
    shim = llmcompressor_patches._tqdm_shim(lambda *e: events.append(e), ("awq", "gptq"))
    for _ in range(2):
        for i in range(1, 4):
            list(shim(range(2), desc=f"({i}/3): Calibrating"))
    shim(desc="Smoothing")  # other bars are silent
    assert [e[1:] for e in events] == [(0, 6), (1, 6), (2, 6), (3, 6), (4, 6), (5, 6)]
    assert events[0][0] == "awq pass 1/2: calibrating 1/3"
    assert events[-1][0] == "gptq pass 2/2: calibrating 3/3"
    single = []
    list(llmcompressor_patches._tqdm_shim(lambda *e: single.append(e))(range(1), desc="(2/31): Calibrating"))
    assert single == [("calibrating 2/31", 1, 31)]

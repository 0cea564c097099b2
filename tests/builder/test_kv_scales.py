"""``kv_cache.dtype: fp8`` in the build: each layer's scale from the calibration text's keys and values (special
tokens included), the transformers attention function that emulates the cache, the held-out KL it reports, the
bound a 16-bit build must meet, and the gate scoring a quantized build with its fp8 cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmc.builder import hf_kv, kv_scales, verify
from llmc.errors import BuildError
from llmc.recipe import recipe_from_dict


def tiny_recipe(hf_dir, method="none", max_mean_kl=0.15):
    quant = {"method": method, "gate": {"max_mean_kl": max_mean_kl, "n_tokens": 512}}
    if method != "none":
        quant.update({"group_size": 32, "calibration": {"n_samples": 8, "seq_len": 64}})
    return recipe_from_dict({"name": "tiny", "model": {"source": str(hf_dir)}, "quantization": quant,
                             "kv_cache": {"dtype": "fp8"}})


@pytest.fixture(scope="module")
def source(tiny_hf_dir):
    from llmc.source.load import resolve_source

    return resolve_source(tiny_recipe(tiny_hf_dir).model)


@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()


def test_each_layers_scale_is_its_largest_cached_key_or_value_over_448(model, source):
    """Independently of the attention function: the keys (after RoPE) and values transformers' own cache holds."""
    from llmc.tokenizer import load_tokenizer

    sequences = kv_scales.calibration_sequences(load_tokenizer(source.hf_dir), source.chat_template)
    scales = kv_scales.calibrate(model, sequences, torch.device("cpu"))
    largest = torch.zeros(len(scales))
    with torch.no_grad():
        for ids in sequences:
            cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
            for n, layer in enumerate(cache.layers):
                largest[n] = max(largest[n], layer.keys.abs().max(), layer.values.abs().max())
    assert scales == pytest.approx((largest / 448).tolist(), rel=1e-6)


def test_calibration_text_has_the_chat_templates_special_tokens_and_no_held_out_text(source):
    from llmc.builder import heldout
    from llmc.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(source.hf_dir)
    sequences = kv_scales.calibration_sequences(tokenizer, source.chat_template)
    assert len(sequences) == kv_scales.CALIB_WINDOWS + kv_scales.CALIB_CHATS
    assert all(len(s) == kv_scales.WINDOW for s in sequences[:kv_scales.CALIB_WINDOWS])
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert all(im_start in s for s in sequences[kv_scales.CALIB_WINDOWS:])  # the keys the cache stores for them
    held = heldout.domain_ids("pydoc", tokenizer, source.chat_template)[:64]
    text = [t for s in sequences for t in s]
    assert not any(text[i:i + 64] == held for i in range(len(text) - 63))


def test_the_emulated_cache_moves_logits_a_little_and_switches_off_exactly(model):
    ids = torch.randint(0, 1000, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        hf_kv.use_fp8_cache(model, [0.02, 0.02])
        fp8 = model(input_ids=ids).logits
        hf_kv.use_fp8_cache(model, [1e-6, 1e-6])  # everything clamped: a visibly different model
        clamped = model(input_ids=ids).logits
        hf_kv.use_fp8_cache(model, None)
        again = model(input_ids=ids).logits
    assert torch.equal(plain, again)
    assert 0 < (fp8 - plain).abs().max() < 0.1 * (clamped - plain).abs().max()


def test_a_16bit_build_whose_fp8_cache_moves_it_past_the_gate_fails(source, tiny_hf_dir, tmp_path):
    from llmc.builder.pipeline import build

    out = tmp_path / "out" / "tiny"
    with pytest.raises(BuildError, match="fp8 KV cache moves this model's next-token distributions by a mean KL"):
        build(tiny_recipe(tiny_hf_dir, max_mean_kl=1e-9), out_dir=out)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


@pytest.mark.slow
def test_the_gate_scores_a_quantized_build_with_its_fp8_cache(source, tiny_hf_dir, tmp_path, monkeypatch):
    """An RTN build with an fp8 cache: the scales are calibrated on the int4 weights and written into the IR, and the
    gate's int4 and RTN models compute with them (its 16-bit reference with a 16-bit cache): their KL is that of
    the same gate without the cache plus the cache's."""
    from rich.console import Console

    from llmc.builder.quantize import quantize_checkpoint
    from llmc.checkpoint import kv_scales as ir_scales
    from llmc.checkpoint.io import read_checkpoint

    monkeypatch.setattr(verify, "CHAT_PROMPTS", 1)
    monkeypatch.setattr(verify, "CHAT_BUDGET", 4)
    recipe = tiny_recipe(tiny_hf_dir, method="rtn")
    ckpt = tmp_path / "checkpoint"
    quantize_checkpoint(source, recipe, ckpt)
    report = kv_scales.calibrate_checkpoint(source, recipe, ckpt)
    config, ranks = read_checkpoint(ckpt)
    assert ir_scales.read(config, ranks[0], 2) == pytest.approx(report["scales"], rel=1e-7)
    models = verify.GateModels(source, recipe, ckpt, torch.device("cpu"), torch.float32)
    assert models.kv_scales == pytest.approx(report["scales"], rel=1e-7)
    states = lambda: [a.llmc_kv.scale for a in hf_kv.attention_layers(models.model)]  # noqa: E731
    models.use("int4")
    assert states() == models.kv_scales
    models.use("16bit")
    assert states() == [None, None]
    quiet = Console(file=open("/dev/null", "w"))
    with_cache = verify.accuracy_gate(source, recipe, ckpt, console=quiet)
    assert with_cache["kv_cache"] == "fp8"
    monkeypatch.setattr(verify, "read_kv_scales", lambda *args: None)
    without = verify.accuracy_gate(source, recipe, ckpt, console=quiet)
    assert without["kv_cache"] == "16-bit"
    assert with_cache["mean"]["int4"]["kl_mean"] > without["mean"]["int4"]["kl_mean"]

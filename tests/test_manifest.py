"""manifest.json: round trip and the errors read_manifest gives for missing, corrupt or newer files."""

from __future__ import annotations

import json

import pytest

from llmc import manifest as mf
from llmc.errors import EngineError


def sample() -> mf.Manifest:
    return mf.Manifest(name="m", recipe={"name": "m"}, recipe_sha256="a" * 64, backend="torch", dtype="float16",
                       quantization={"method": "none"}, eos_token_ids=(2, 0), special_token_ids=(0, 1, 2),
                       source={"kind": "hf", "origin": "/x", "sha256": "b" * 64}, model={"num_hidden_layers": 2},
                       tools=mf.tool_versions(), timings={"total": 1.5}, eos_warnings=("w",))


def test_round_trip(tmp_path):
    m = sample()
    mf.write_manifest(tmp_path, m)
    assert mf.read_manifest(tmp_path) == m
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["format_version"] == mf.FORMAT_VERSION == 1 and on_disk["eos_token_ids"] == [2, 0]


def test_tool_versions_name_the_stack():
    tools = mf.tool_versions()
    assert {"python", "llmc", "torch", "transformers", "tokenizers"} <= set(tools)
    import torch

    assert tools["torch"] in (torch.__version__, torch.__version__.split("+")[0])


def test_missing_folder_and_missing_manifest(tmp_path):
    with pytest.raises(EngineError, match="does not exist.*llmc build"):
        mf.read_manifest(tmp_path / "nope")
    with pytest.raises(EngineError, match="has no manifest.json"):
        mf.read_manifest(tmp_path)


@pytest.mark.parametrize("text,match", [("{not json", "corrupt"), ("[1, 2]", "not a JSON object"),
                                        ('{"name": "x"}', "no integer format_version"),
                                        ('{"format_version": 1, "name": "x"}', "missing or has unknown fields")])
def test_corrupt_manifest(tmp_path, text, match):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(EngineError, match=match) as err:
        mf.read_manifest(tmp_path)
    assert "Fix:" in str(err.value)


def test_newer_format_version_asks_to_upgrade(tmp_path):
    d = sample().to_dict()
    d["format_version"] = mf.FORMAT_VERSION + 1
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(EngineError, match="newer than this llmc reads.*upgrade llmc"):
        mf.read_manifest(tmp_path)

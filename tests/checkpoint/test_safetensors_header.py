"""The safetensors header reader: header only, clear errors, and no torch (``llmc validate`` stays light)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmc.checkpoint.safetensors_header import MAX_HEADER_BYTES, read_safetensors_header
from llmc.errors import CheckpointError


def header_file(path, header: bytes, length: int | None = None, data: bytes = b""):
    path.write_bytes((len(header) if length is None else length).to_bytes(8, "little") + header + data)
    return path


def test_reads_the_json_header(tmp_path):
    header = {"w": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 12]}, "__metadata__": {"format": "pt"}}
    assert read_safetensors_header(header_file(tmp_path / "a", json.dumps(header).encode(), data=bytes(12))) == header


def test_a_file_cut_short_is_a_checkpoint_error(tmp_path):
    header = {"w": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 12]}}
    with pytest.raises(CheckpointError, match="'w' ends at byte 12 of the data but the file holds 5"):
        read_safetensors_header(header_file(tmp_path / "a", json.dumps(header).encode(), data=bytes(5)))


@pytest.mark.parametrize("content, length, words", [
    (b"[1, 2]", None, "not a JSON object"),
    (b"{}", MAX_HEADER_BYTES + 1, "implausible"),
    (b"{bad", None, "not a readable safetensors file"),
    (b"", 0, "not a readable safetensors file"),
])
def test_malformed_headers_are_checkpoint_errors(tmp_path, content, length, words):
    with pytest.raises(CheckpointError, match=words):
        read_safetensors_header(header_file(tmp_path / "bad", content, length))


def test_llmc_validate_reads_headers_without_importing_torch():
    code = "import sys, llmc.builder.preflight; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

"""Fuzzing the safetensors header reader (issue 18): damaged files end in a CheckpointError or a header whose
every tensor lies inside the file (so loading it cannot fail on a truncation)."""

from __future__ import annotations

import json
import struct

import torch
from hypothesis import strategies as st
from safetensors.torch import load_file, save

from llmc.checkpoint.io import read_safetensors_header
from tests.fuzzing import JSON, fuzz_tests, mutations, scratch_dir

VALID = save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16)},
             metadata={"format": "pt"})
_DIR = scratch_dir("llmc-safetensors-fuzz-")


def with_header(header) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + VALID[8 + struct.unpack("<Q", VALID[:8])[0]:]


HEADERS = st.one_of(JSON, st.dictionaries(st.sampled_from(["a", "b", "__metadata__"]), st.fixed_dictionaries(
    {"dtype": st.sampled_from(["F32", "F16", "X"]) | JSON, "shape": JSON | st.lists(st.integers(0, 9), max_size=3),
     "data_offsets": JSON | st.lists(st.integers(-4, 64), min_size=2, max_size=2)}), max_size=3)).map(with_header)


def check(data: bytes) -> None:
    path = _DIR / "fuzz.safetensors"
    path.write_bytes(data)
    header = read_safetensors_header(path)
    assert isinstance(header, dict)
    if data == VALID:
        assert set(load_file(str(path))) == {"a", "b"}


test_safetensors_header, test_safetensors_header_slow = fuzz_tests(st.one_of(mutations(VALID), HEADERS), check)

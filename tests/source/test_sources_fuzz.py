"""Fuzzing the GGUF header reader (issue 18): damaged or hostile files end in a SourceError or a result."""

from __future__ import annotations

import struct

import pytest
from hypothesis import strategies as st

from llmc.source.sources import read_gguf_metadata
from llmc.errors import SourceError
from tests.fuzzing import fuzz_tests, mutations, scratch_dir


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def small_gguf() -> bytes:
    """A valid GGUF v3 file: 3 metadata keys (string, uint32, string array), 2 float32 tensors, aligned data."""
    kv = (_string("general.architecture") + struct.pack("<I", 8) + _string("llama")
          + _string("llama.block_count") + struct.pack("<I", 4) + struct.pack("<I", 2)
          + _string("tokenizer.ggml.tokens") + struct.pack("<I", 9) + struct.pack("<IQ", 8, 2) + _string("a")
          + _string("b"))
    tensors = (_string("token_embd.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 4, 2)
               + struct.pack("<IQ", 0, 0)
               + _string("output_norm.weight") + struct.pack("<I", 1) + struct.pack("<Q", 4)
               + struct.pack("<IQ", 0, 32))
    head = b"GGUF" + struct.pack("<IQQ", 3, 2, 3) + kv + tensors
    head += b"\0" * (-len(head) % 32)
    return head + b"\1" * (32 + 16)


VALID = small_gguf()
_DIR = scratch_dir("llmc-gguf-fuzz-")


def test_the_small_gguf_is_valid():
    path = _DIR / "valid.gguf"
    path.write_bytes(VALID)
    kv, names = read_gguf_metadata(path)
    assert kv["general.architecture"] == "llama" and names == ["token_embd.weight", "output_norm.weight"]


HOSTILE = st.builds(lambda version, n_tensors, n_kv, rest: b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)
                    + rest, st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                    st.binary(max_size=64))


def check(data: bytes) -> None:
    path = _DIR / "fuzz.gguf"
    path.write_bytes(data)
    kv, names = read_gguf_metadata(path)
    assert isinstance(kv, dict) and all(isinstance(n, str) for n in names)


test_gguf_header, test_gguf_header_slow = fuzz_tests(st.one_of(mutations(VALID), HOSTILE), check)


def test_lengths_past_the_end_are_a_source_error():
    """Found by the fuzzer: a string length of 2**63 overflowed the cursor instead of ending the header."""
    path = _DIR / "huge.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**63))
    with pytest.raises(SourceError, match="runs past the end"):
        read_gguf_metadata(path)

"""The stop_words_list tensor: int32 [batch, 2, N], row 0 flattened ids padded with 0, row 1 cumulative end
offsets padded with -1 (triton.md lines 33-35). Expected arrays are written out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from llmc.engine.tensorrt_llm.stop_words import from_stop_words_list, to_stop_words_list
from llmc.errors import RequestError


def test_two_requests_are_padded_to_the_longest():
    words = [[[5, 6], [7]], [[9]]]
    out = to_stop_words_list(words)
    assert out.dtype == np.int32 and out.shape == (2, 2, 3)
    np.testing.assert_array_equal(out, np.array([
        [[5, 6, 7], [2, 3, -1]],
        [[9, 0, 0], [1, -1, -1]],
    ], dtype=np.int32))


def test_single_request_multi_token_words():
    out = to_stop_words_list([[[128009], [1, 2, 3], [4, 5]]])
    np.testing.assert_array_equal(out, np.array([[[128009, 1, 2, 3, 4, 5], [1, 4, 6, -1, -1, -1]]], dtype=np.int32))


def test_request_without_words_has_no_offsets():
    out = to_stop_words_list([[], [[3]]])
    np.testing.assert_array_equal(out, np.array([[[0], [-1]], [[3], [1]]], dtype=np.int32))
    assert to_stop_words_list([[]]).shape == (1, 2, 1)


def test_round_trip():
    words = [[[5, 6], [7]], [], [[1, 2, 3]]]
    assert from_stop_words_list(to_stop_words_list(words)) == words


def test_empty_word_is_refused():
    with pytest.raises(RequestError, match="encodes to no tokens"):
        to_stop_words_list([[[1], []]])

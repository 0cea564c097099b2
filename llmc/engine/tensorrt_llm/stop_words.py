"""The ``stop_words_list`` tensor TensorRT-LLM takes (triton.md lines 33-35).

Format: int32 ``[batch, 2, N]``. For each request, row 0 holds the token ids of all its stop words
concatenated, row 1 the cumulative end offset of each word in row 0; row 0 is padded with 0 and row 1
with -1 up to N, the longest request's total.

Example: words ``[[5, 6], [7]]`` -> row 0 ``[5, 6, 7]``, row 1 ``[2, 3, -1]`` when N = 3.
"""

from __future__ import annotations

import numpy as np

from llmc.errors import RequestError


def to_stop_words_list(word_id_lists: list[list[list[int]]]) -> np.ndarray:
    """``word_id_lists[b]`` = request b's stop words, each a list of token ids -> int32 ``[batch, 2, N]``.

    N is at least 1 so the tensor never has a zero-sized dimension (a request without stop words is
    then row 0 ``[0]``, row 1 ``[-1]``: no offsets, so no word). Empty words are refused.
    """
    flat: list[list[int]] = []
    offsets: list[list[int]] = []
    for words in word_id_lists:
        ids: list[int] = []
        ends: list[int] = []
        for word in words:
            if not word:
                raise RequestError("stop", "a stop word encodes to no tokens; remove the empty stop string")
            ids.extend(int(t) for t in word)
            ends.append(len(ids))
        flat.append(ids)
        offsets.append(ends)
    n = max([1] + [len(ids) for ids in flat])
    out = np.zeros((len(word_id_lists), 2, n), dtype=np.int32)  # [batch, 2, N]
    out[:, 1, :] = -1
    for b, (ids, ends) in enumerate(zip(flat, offsets)):
        out[b, 0, : len(ids)] = ids
        out[b, 1, : len(ends)] = ends
    return out


def from_stop_words_list(tensor: np.ndarray) -> list[list[list[int]]]:
    """Inverse of :func:`to_stop_words_list` (used by tests and debugging)."""
    result = []
    for row_ids, row_ends in tensor:  # each [N]
        words, start = [], 0
        for end in row_ends:
            if end < 0:
                break
            words.append([int(t) for t in row_ids[start:end]])
            start = int(end)
        result.append(words)
    return result

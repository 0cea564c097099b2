"""The pass rule of the GPU-box acceptance comparison (the GPU run itself is scripts/acceptance_trtllm.sh)."""

from __future__ import annotations

from llmc.engine.tensorrt_llm.acceptance import common_prefix, compare


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5, 6], [5, 6]) == 2


def test_identical_outputs_pass_even_when_shorter_than_max_new_tokens():
    out = compare([[1, 2, 3], [4]], [[1, 2, 3], [4]], min_prefix=8)
    assert out == {"prefixes": [3, 1], "mean_prefix_fraction": 1.0, "passed": True, "exact": [True, True]}


def test_early_divergence_fails():
    ref = [list(range(10)), list(range(10))]
    out = compare([list(range(10)), [0, 1, 99] + list(range(3, 10))], ref, min_prefix=8)
    assert out["prefixes"] == [10, 2] and out["passed"] is False


def test_late_divergence_passes():
    ref = [list(range(20))] * 2
    out = compare([list(range(20)), list(range(15)) + [99] * 5], ref, min_prefix=8)
    assert out["prefixes"] == [20, 15] and out["mean_prefix_fraction"] == 0.875 and out["passed"] is True

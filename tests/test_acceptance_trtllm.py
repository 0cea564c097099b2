"""The pure parts of the GPU-box acceptance harness scripts/acceptance_trtllm.py (the GPU run itself is
scripts/acceptance_trtllm.sh): the pass rule of the comparison and the stop-string check's expectations."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "acceptance_trtllm", Path(__file__).resolve().parents[1] / "scripts" / "acceptance_trtllm.py")
acceptance = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(acceptance)
common_prefix, compare = acceptance.common_prefix, acceptance.compare


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


def test_stop_check_expects_the_text_before_the_first_stop_string(smollm2_hf_dir):
    from llmc.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_hf_dir)
    ref = tok.encode(" The capital of France is Paris, a city on the Seine.", add_special_tokens=False)
    first, absent = acceptance.stop_strings_from(tok, ref)
    assert first == tok.decode(ref[4:7]) and len(tok.encode(first, add_special_tokens=False)) > 1
    text = tok.decode(ref)
    assert absent not in text
    assert acceptance.cut_at(text, first) == text[: text.index(first)] and first not in acceptance.cut_at(text, first)

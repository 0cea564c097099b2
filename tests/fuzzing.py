"""Fuzz-test helpers (hypothesis): every parser of untrusted input must end in a typed llmc error or a result.

:func:`fuzz_tests` turns one check into two tests: a few hundred examples in the default run (CI) and a few
thousand in one marked ``slow`` and ``long_fuzz``, deselected by default (run them with
``python -m pytest -m long_fuzz``). Any exception other than an
:class:`~llmc.errors.LlmcError` fails the test with the input that raised it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmc.errors import LlmcError

CI_EXAMPLES = 300
SLOW_EXAMPLES = 3000

# Any JSON value, a few levels deep (numbers include huge ints, NaN and infinities, as json.loads can produce).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**80, max_value=2**80)
    | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


_SCRATCH: list[tempfile.TemporaryDirectory] = []


def scratch_dir(prefix: str) -> Path:
    """A folder for a fuzz module's files, removed when the test process exits (made at import, so a module-level
    folder of ``tempfile.mkdtemp`` was left in the temp folder by every run, even by ``--collect-only``)."""
    folder = tempfile.TemporaryDirectory(prefix=prefix)
    _SCRATCH.append(folder)
    return Path(folder.name)


def typed_error_or_result(check: Callable[[Any], Any], value: Any) -> None:
    """Run ``check(value)``; an LlmcError is an accepted outcome, anything else propagates."""
    try:
        check(value)
    except LlmcError:
        pass


def fuzz_tests(strategy: st.SearchStrategy, check: Callable[[Any], Any]) -> tuple[Callable[[], None], ...]:
    """(CI test, slow test) running ``check`` on ``strategy``'s examples."""
    def run(examples: int) -> None:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=examples == CI_EXAMPLES,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.filter_too_much])
        @given(strategy)
        def property_holds(value: Any) -> None:
            typed_error_or_result(check, value)

        property_holds()

    def ci() -> None:
        run(CI_EXAMPLES)

    @pytest.mark.slow
    @pytest.mark.long_fuzz
    def slow() -> None:
        run(SLOW_EXAMPLES)

    return ci, slow


def mutations(data: bytes) -> st.SearchStrategy[bytes]:
    """``data`` cut short, with bytes overwritten, or with a random tail: how real files get damaged."""
    n = len(data)
    cut = st.integers(0, n).map(lambda k: data[:k])
    flips = st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.integers(0, 255)), min_size=1, max_size=8).map(
        lambda edits: _apply(data, edits))
    tail = st.binary(max_size=64).map(lambda extra: data + extra)
    return st.one_of(cut, flips, tail, st.binary(max_size=256))


def _apply(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, value in edits:
        if out:
            out[pos % len(out)] = value
    return bytes(out)

"""``from llmc import Engine, SamplingParams``: the public API at the package face, resolved on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import llmc
from llmc.request.outputs import Completion, StreamEvent
from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine


def test_public_names_are_the_defining_modules_objects() -> None:
    from llmc import Completion as C, Engine as E, SamplingParams as S, StreamEvent as SE

    assert (E, S, C, SE) == (Engine, SamplingParams, Completion, StreamEvent)
    assert {"Engine", "SamplingParams"} <= set(dir(llmc)) and set(llmc.__all__) >= {"Engine", "SamplingParams"}


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        llmc.Engin  # noqa: B018


def test_import_llmc_loads_neither_torch_nor_the_runtime() -> None:
    code = "import sys, llmc; print('torch' in sys.modules, 'llmc.runtime.api' in sys.modules, llmc.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", llmc.__version__]

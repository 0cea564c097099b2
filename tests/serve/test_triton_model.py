"""Helpers shared by llmc's Triton Python models, exercised with a stand-in for triton_python_backend_utils."""

from __future__ import annotations

import json

import numpy as np

from llmc.serve.triton_model import input_arrays, model_parameters


class FakeTensor:
    def __init__(self, array):
        self.array = array

    def as_numpy(self):
        return self.array


class FakePbUtils:
    """Stands in for triton_python_backend_utils: a request is a dict of input name -> array."""

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return FakeTensor(request[name]) if name in request else None


def test_model_parameters_reads_string_values():
    config = {"parameters": {"tokenizer_dir": {"string_value": "/b/tokenizer"}, "add_special_tokens": {
        "string_value": "true"}}}
    assert model_parameters({"model_config": json.dumps(config)}) == {
        "tokenizer_dir": "/b/tokenizer", "add_special_tokens": "true"}
    assert model_parameters({"model_config": "{}"}) == {}


def test_input_arrays_gives_none_for_absent_optional_inputs():
    request = {"QUERY": np.array([[b"hi"]], dtype=np.object_), "END_ID": np.array([[2]], dtype=np.int32)}
    arrays = input_arrays(FakePbUtils, request, ("QUERY", "END_ID", "PAD_ID"))
    assert arrays["QUERY"][0, 0] == b"hi" and arrays["END_ID"][0, 0] == 2 and arrays["PAD_ID"] is None

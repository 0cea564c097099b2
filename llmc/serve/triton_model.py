"""What every llmc Triton Python model (``model_repo/*/1/model.py``) does the same way, testable without Triton."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def model_parameters(args: Mapping[str, Any]) -> dict[str, str]:
    """``{name: string_value}`` of the model's config.pbtxt ``parameters`` (from ``initialize(args)``)."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def input_arrays(pb_utils: Any, request: Any, names: Iterable[str]) -> dict[str, Any]:
    """``{name: numpy array}`` of a request's inputs; ``None`` for an optional input the client left out."""
    arrays = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        arrays[name] = None if tensor is None else tensor.as_numpy()
    return arrays

"""config.pbtxt helpers: fill ``${name}`` templates, parse with Triton's real schema, check ensemble wiring.

Parsing uses ``tritonclient.grpc.model_config_pb2.ModelConfig`` through ``google.protobuf.text_format``, so
a file that passes here has the field names and types tritonserver reads.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from llmc.errors import BuildError
from llmc.serve.protocol import FieldSpec, config_tensor


def fill_template(text: str, values: Mapping[str, Any], source: str = "template") -> str:
    """Substitute every ``${name}``; BuildError naming the placeholder when a value is missing."""
    try:
        return string.Template(text).substitute({k: _pbtxt_value(v) for k, v in values.items()})
    except KeyError as exc:
        raise BuildError(f"{source}: no value for the placeholder ${{{exc.args[0]}}}; this is an llmc bug "
                         f"(the template and llmc.serve.repo disagree)") from None


def _pbtxt_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def render_inputs(specs: Iterable[FieldSpec], outputs: bool = False) -> str:
    """``input [...]`` entries for ensemble-style tensors (the batch dim is implied by max_batch_size); with
    ``outputs``, ``output [...]`` entries (Triton outputs have no ``optional``: a model may leave one out of a
    response, as the log-probability outputs are unless the request asked for them)."""
    lines = []
    for tensor in (config_tensor(spec, outputs) for spec in specs):
        dims = ", ".join(str(d) for d in tensor["dims"])
        optional = " optional: true" if tensor.get("optional") else ""
        lines.append(f'  {{ name: "{tensor["name"]}" data_type: {tensor["data_type"]} dims: [ {dims} ]'
                     f'{optional} }}')
    return ",\n".join(lines)


def parse_config(text: str, source: str = "config.pbtxt") -> Any:
    """Parse config.pbtxt text into Triton's ``ModelConfig``; BuildError with the parser's message."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise BuildError(f"{source} does not parse as a Triton model config: {exc}") from None
    unfilled = re.search(r"\$\{\w+\}", text)
    if unfilled:
        raise BuildError(f"{source} still contains the placeholder {unfilled.group(0)}")
    return config


def read_config(model_dir: Path) -> Any:
    """Parse ``<model_dir>/config.pbtxt``."""
    path = Path(model_dir) / "config.pbtxt"
    if not path.is_file():
        raise BuildError(f"{path} is missing; regenerate the repository with `llmc repo BUILD_DIR OUT`")
    return parse_config(path.read_text(), str(path))


def _tensor_table(tensors: Iterable[Any]) -> dict[str, tuple[int, tuple[int, ...], bool]]:
    return {t.name: (t.data_type, tuple(t.dims), bool(getattr(t, "optional", False))) for t in tensors}


def _dims_match(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))


def check_ensemble(repo_dir: Path, ensemble: str = "ensemble") -> list[str]:
    """Check the ensemble's wiring against its composing models; returns the problems (empty when sound).

    Every step's model exists; every input_map key is an input of that model and its value is an ensemble
    input or another step's output with the same dtype and compatible dims; every required model input is
    mapped; every output_map key is an output of the model; every ensemble output is produced with its dtype.
    """
    from tritonclient.grpc import model_config_pb2

    repo_dir = Path(repo_dir)
    config = read_config(repo_dir / ensemble)
    type_name = model_config_pb2.DataType.Name
    tensors = {name: (dtype, dims, "ensemble input") for name, (dtype, dims, _) in _tensor_table(config.input).items()}
    problems: list[str] = []
    steps = list(config.ensemble_scheduling.step)
    models = {}
    for step in steps:
        if not (repo_dir / step.model_name / "config.pbtxt").is_file():
            problems.append(f"step model {step.model_name!r} has no config.pbtxt in {repo_dir}")
            continue
        models[step.model_name] = read_config(repo_dir / step.model_name)
        outputs = _tensor_table(models[step.model_name].output)
        for key, value in step.output_map.items():
            if key not in outputs:
                problems.append(f"{step.model_name}: output_map key {key!r} is not an output of the model")
            else:
                tensors[value] = (outputs[key][0], outputs[key][1], f"{step.model_name}.{key}")
    for step in steps:
        if step.model_name not in models:
            continue
        inputs = _tensor_table(models[step.model_name].input)
        for key, value in step.input_map.items():
            if key not in inputs:
                problems.append(f"{step.model_name}: input_map key {key!r} is not an input of the model")
            elif value not in tensors:
                problems.append(f"{step.model_name}.{key}: tensor {value!r} is neither an ensemble input nor a "
                                f"step output")
            else:
                dtype, dims, origin = tensors[value]
                if dtype != inputs[key][0] or not _dims_match(dims, inputs[key][1]):
                    problems.append(f"{step.model_name}.{key} is {type_name(inputs[key][0])} {list(inputs[key][1])} "
                                    f"but {value!r} ({origin}) is {type_name(dtype)} {list(dims)}")
        for name, (_, _, optional) in inputs.items():
            if not optional and name not in step.input_map:
                problems.append(f"{step.model_name}: required input {name!r} is not mapped")
    for name, (dtype, dims, _) in _tensor_table(config.output).items():
        if name not in tensors:
            problems.append(f"ensemble output {name!r} is produced by no step")
        elif tensors[name][0] != dtype or not _dims_match(tensors[name][1], dims):
            problems.append(f"ensemble output {name!r} is {type_name(dtype)} but {tensors[name][2]} is "
                            f"{type_name(tensors[name][0])}")
    return problems

"""Write and read TensorRT-LLM checkpoint folders: ``config.json`` + ``rank{r}.safetensors`` per rank.

``expected_tensor_specs(config, rank)`` is the exact per-rank contract (names, shapes, dtypes) computed
from the config alone; the writer, the reader, the torch loader and the TensorRT-LLM backend share it.
A missing tensor, a wrong shape or a wrong dtype is a CheckpointError; an extra tensor only warns.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from llmc.checkpoint import kv_scales, names
from llmc.checkpoint.config import ModelShape
from llmc.checkpoint.convert import torch_dtype
from llmc.checkpoint.safetensors_header import read_safetensors_header
from llmc.errors import CheckpointError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.int8: "I8"}


class TensorSpec(NamedTuple):
    """Expected shape and dtype of one tensor of one rank."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def rank_file(rank: int) -> str:
    """File name of a rank's tensors."""
    return f"rank{rank}.safetensors"


def expected_tensor_specs(config: dict[str, Any], rank: int) -> dict[str, TensorSpec]:
    """Every tensor rank ``rank`` must hold, with its exact shape and dtype, from the IR config."""
    shape = ModelShape.from_config(config)
    dtype = torch_dtype(shape.dtype)
    tp, hidden = shape.tp_size, shape.hidden_size
    specs = {
        names.VOCAB_EMBEDDING: TensorSpec((shape.vocab_size, hidden), dtype),
        names.LN_F: TensorSpec((hidden,), dtype),
        names.LM_HEAD: TensorSpec((shape.padded_vocab_size // tp, hidden), dtype),
    }
    for layer in range(shape.num_layers):
        for norm in names.LAYER_NORMS:
            specs[names.trt_layer(layer, norm)] = TensorSpec((hidden,), dtype)
        for spec in names.LINEARS:
            specs.update(_linear_specs(shape, layer, spec, dtype))
        for norm in names.QK_NORMS if shape.qk_norm else ():
            specs[names.trt_layer(layer, norm)] = TensorSpec((shape.head_size,), dtype)
        if shape.kv_cache_quant_algo == "FP8":
            specs[names.trt_layer(layer, "attention", names.KV_CACHE_SCALING_FACTOR)] = TensorSpec((1,), torch.float32)
    return specs


def _linear_specs(shape: ModelShape, layer: int, spec: names.LinearSpec, dtype: torch.dtype) -> dict[str, TensorSpec]:
    out_f, in_f = shape.linear_dims(spec.trt)
    tp = shape.tp_size
    if spec is names.QKV:
        out_f = shape.qkv_out_per_rank
    elif spec.parallel == "column":
        out_f //= tp
    else:
        in_f //= tp
    prefix = f"transformer.layers.{layer}.{spec.trt}"
    result: dict[str, TensorSpec] = {}
    if shape.is_w4a16:
        g = shape.group_size
        result[f"{prefix}.weight"] = TensorSpec((out_f // 2, in_f), torch.int8)
        result[f"{prefix}.{names.WEIGHTS_SCALING_FACTOR}"] = TensorSpec((out_f, in_f // g), dtype)
        result[f"{prefix}.{names.PREQUANT_SCALING_FACTOR}"] = TensorSpec((in_f,), dtype)
    else:
        result[f"{prefix}.weight"] = TensorSpec((out_f, in_f), dtype)
    if shape.has_bias(spec.trt):
        # Row-parallel biases are added after the all-reduce, so each rank holds the whole [O].
        result[f"{prefix}.bias"] = TensorSpec((out_f,), dtype)
    return result


def check_rank_tensors(tensors: dict[str, Any], config: dict[str, Any], rank: int, where: str) -> None:
    """Compare tensors (or safetensors header entries with ``shape``/``dtype``) against the expected specs.

    Raises CheckpointError listing every missing tensor, or naming the first shape/dtype mismatch.
    Extra tensors are logged as a warning (TensorRT-LLM ignores them too).
    """
    specs = expected_tensor_specs(config, rank)
    missing = sorted(set(specs) - set(tensors))
    if missing:
        shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
        raise CheckpointError(
            f"{where}: {len(missing)} tensors missing: {shown}; re-export the checkpoint (llmc build --force)"
        )
    for name, spec in specs.items():
        shape, dtype = _shape_dtype(tensors[name])
        if shape != spec.shape:
            raise CheckpointError(
                f"{where}: {name} has shape {list(shape)}, expected {list(spec.shape)} from config.json"
            )
        if dtype != SAFETENSORS_DTYPES[spec.dtype]:
            raise CheckpointError(f"{where}: {name} has dtype {dtype}, expected {SAFETENSORS_DTYPES[spec.dtype]}")
    extra = sorted(set(tensors) - set(specs))
    if extra:
        log.warning("%s: %d unexpected tensors ignored: %s", where, len(extra), ", ".join(extra[:10]))


def _shape_dtype(entry: Any) -> tuple[tuple[int, ...], str]:
    if isinstance(entry, torch.Tensor):
        return tuple(entry.shape), SAFETENSORS_DTYPES.get(entry.dtype, str(entry.dtype))
    return tuple(entry["shape"]), entry["dtype"]


def write_checkpoint(
    directory: str | Path, config: dict[str, Any], rank_weights: list[dict[str, torch.Tensor]]
) -> None:
    """Write ``config.json`` and ``rank{r}.safetensors`` for every rank, validated against the config.

    Each file goes to a temporary name first and is renamed into place; config.json is renamed last, so a
    folder with a config.json is complete. Tensors are stored contiguous and unshared.
    """
    directory = Path(directory)
    shape = ModelShape.from_config(config)
    if len(rank_weights) != shape.tp_size:
        raise CheckpointError(
            f"got tensors for {len(rank_weights)} ranks, but the config's tp_size is {shape.tp_size}"
        )
    directory.mkdir(parents=True, exist_ok=True)
    for rank, tensors in enumerate(rank_weights):
        check_rank_tensors(tensors, config, rank, f"rank {rank}")
        tmp = directory / f".{rank_file(rank)}.tmp-{os.getpid()}"
        save_file(_unshared(tensors), str(tmp), metadata={"format": "pt"})
        os.replace(tmp, directory / rank_file(rank))
    tmp = directory / f".{CONFIG_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, directory / CONFIG_FILE)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors with no two sharing storage (safetensors refuses shared storage)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[name] = t
    return out


def read_config(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json (CheckpointError if missing or not JSON)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; {directory} is not a checkpoint folder (run llmc build)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); rebuild with llmc build --force") from exc


def read_kv_scales(directory: str | Path) -> list[float] | None:
    """An FP8 KV cache's per-layer scales in the IR in ``directory`` (:func:`kv_scales.read`; None for a 16-bit
    cache), loading only rank 0's scale tensors, not its weights."""
    config = read_config(directory)
    if not kv_scales.fp8_kv(config):
        return None
    num_layers = int(config["num_hidden_layers"])
    with safe_open(str(Path(directory) / rank_file(0)), "pt") as f:
        present = set(f.keys())
        rank0 = {kv_scales.scale_name(n): f.get_tensor(kv_scales.scale_name(n)) for n in range(num_layers)
                 if kv_scales.scale_name(n) in present}
    return kv_scales.read(config, rank0, num_layers)


def read_checkpoint(
    directory: str | Path, ranks: list[int] | None = None, device: str | torch.device = "cpu"
) -> tuple[dict[str, Any], list[dict[str, torch.Tensor]]]:
    """(config, [tensors of each rank in ``ranks``, default all]) with every rank checked against the config."""
    directory = Path(directory)
    config = read_config(directory)
    shape = ModelShape.from_config(config)
    ranks = list(range(shape.tp_size)) if ranks is None else list(ranks)
    result = []
    for rank in ranks:
        if not 0 <= rank < shape.tp_size:
            raise CheckpointError(f"rank {rank} is outside 0..{shape.tp_size - 1} (tp_size {shape.tp_size})")
        path = directory / rank_file(rank)
        if not path.is_file():
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete (rebuild with llmc build --force)")
        header = {k: v for k, v in read_safetensors_header(path).items() if k != "__metadata__"}
        check_rank_tensors(header, config, rank, str(path))
        try:
            result.append(load_file(str(path), device=str(device)))
        except SafetensorError as exc:
            raise CheckpointError(f"{path} cannot be loaded ({exc}); rebuild with llmc build --force") from None
    return config, result

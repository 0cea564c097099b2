"""Checks of the checkpoint IR that TensorRT-LLM's builder will read, done before any build work.

The per-rank tensor contract (names, shapes, dtypes) is llmc's one copy in
:func:`llmc.checkpoint.io.expected_tensor_specs`; this module adds what the engine backend needs on top:
the recipe and the IR agree (tp_size, dtype), groupwise layers are padded to multiples of
max(64, g) * tp (reference line 60-61), and FP8 KV scales exist when asked (line 32).
"""

from __future__ import annotations

from pathlib import Path

from llmc.checkpoint.config import W4A16_AWQ, ModelShape
from llmc.checkpoint.io import check_rank_tensors, read_config, rank_file
from llmc.checkpoint.safetensors_header import read_safetensors_header
from llmc.engine.tensorrt_llm.config import require_kv_cache_scales
from llmc.errors import CheckpointError
from llmc.recipe import Recipe


def read_ir_config(checkpoint_dir: Path) -> dict:
    """The IR's config.json (CheckpointError when missing or not JSON)."""
    return read_config(checkpoint_dir)


def hf_view(ir_config: dict) -> dict:
    """The HF-style fields :func:`checks.check_recipe` reads, from an IR config (line 23-28 names)."""
    heads = ir_config["num_attention_heads"]
    return {
        "architectures": [ir_config.get("architecture")],
        "num_attention_heads": heads,
        "num_key_value_heads": ir_config.get("num_key_value_heads") or heads,
        "hidden_size": ir_config["hidden_size"],
        "head_dim": ir_config["head_size"],
    }


def groupwise_multiple(group_size: int, tp_size: int) -> int:
    """Groupwise layers' features must be multiples of max(64, g) * tp (line 60-61)."""
    return max(64, group_size) * tp_size


def check_groupwise_features(ir_config: dict) -> None:
    """CheckpointError unless every W4A16_AWQ layer's in/out features are multiples of max(64, g) * tp."""
    shape = ModelShape.from_config(ir_config)
    if shape.quant_algo != W4A16_AWQ:
        return
    multiple = groupwise_multiple(int(shape.group_size), shape.tp_size)
    for module in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        out_f, in_f = shape.linear_dims(module)
        if out_f % multiple or in_f % multiple:
            raise CheckpointError(
                f"{module} has [out {out_f}, in {in_f}] features, not multiples of max(64, group_size "
                f"{shape.group_size}) * tp {shape.tp_size} = {multiple}, which TensorRT-LLM's groupwise int4 "
                "layers need. Fix: rebuild with llmc build --force (the exporter pads intermediate_size), or "
                "choose a group_size / tp_size that divides the model's hidden and attention sizes"
            )


def check_ir(recipe: Recipe, checkpoint_dir: Path, ir_config: dict) -> list[set[str]]:
    """Check the IR in ``checkpoint_dir`` against the recipe and the tensor contract, reading headers only.

    Returns each rank's tensor names. Raises :class:`CheckpointError` naming the file and the fix.
    """
    shape = ModelShape.from_config(ir_config)
    if shape.tp_size != recipe.engine.tp_size or shape.dtype != recipe.model.dtype:
        raise CheckpointError(
            f"{checkpoint_dir} was exported with tp_size {shape.tp_size} and dtype {shape.dtype}, but the recipe "
            f"asks for tp_size {recipe.engine.tp_size} and dtype {recipe.model.dtype}. "
            "Fix: rebuild with llmc build --force"
        )
    check_groupwise_features(ir_config)
    names = []
    for rank in range(shape.tp_size):
        path = Path(checkpoint_dir) / rank_file(rank)
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: the checkpoint has tp_size {shape.tp_size}, so ranks 0..{shape.tp_size - 1} "
                "must all be present. Fix: rebuild with llmc build --force"
            )
        header = {k: v for k, v in read_safetensors_header(path).items() if k != "__metadata__"}
        check_rank_tensors(header, ir_config, rank, str(path))
        names.append(set(header))
    if recipe.kv_cache.dtype == "fp8":
        require_kv_cache_scales(shape.num_layers, names)
    return names

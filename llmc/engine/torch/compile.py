"""The torch backend's "compile" step: validate the checkpoint IR and write ``engine/engine.json``.

The portable engine runs the IR directly, so its engine folder holds only a self-description:
``{backend: "torch", format_version, checkpoint (relative path), dtype, quantization, model, limits,
kv_cache, kv_bytes_per_token}``. ``kv_bytes_per_token`` is for the engine dtype (a CUDA deployment; fp8: one byte
an element); on CPU the runner computes in float32 and an ``auto`` KV cache then takes twice that.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llmc.checkpoint import kv_scales
from llmc.checkpoint.convert import torch_dtype
from llmc.engine.torch import cpu_ext
from llmc.engine.torch.kv_alloc import kv_bytes_per_token, kv_cache_dtype
from llmc.engine.torch.model import ModelConfig
from llmc.engine.torch.prefill_cpu import prefill_path
from llmc.errors import CheckpointError, EngineError
from llmc.recipe import Recipe

BACKEND = "torch"
ENGINE_JSON = "engine.json"
FORMAT_VERSION = 1


def compile_torch_engine(recipe: Recipe, checkpoint_dir: str | Path, engine_dir: str | Path) -> dict[str, Any]:
    """Write ``engine_dir/engine.json`` for the IR in ``checkpoint_dir``; returns a report dict.

    Raises CheckpointError when the IR config is missing or describes a model the torch engine cannot run,
    EngineError when the recipe's KV-cache dtype is not supported by this backend.
    """
    checkpoint_dir, engine_dir = Path(checkpoint_dir), Path(engine_dir)
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} is missing. Fix: export the checkpoint IR before compiling the engine")
    ir_config = json.loads(config_path.read_text())
    model = ModelConfig.from_checkpoint_config(ir_config)
    kv_dtype = kv_cache_dtype(recipe.kv_cache.dtype, torch_dtype(model.dtype))
    if (recipe.kv_cache.dtype == "fp8") != kv_scales.fp8_kv(ir_config):
        raise EngineError(f"kv_cache.dtype is {recipe.kv_cache.dtype} but the checkpoint's kv_cache_quant_algo is "
                          f"{(ir_config.get('quantization') or {}).get('kv_cache_quant_algo')}. Fix: rebuild the "
                          f"checkpoint from this recipe (`llmc build --force`)")
    bytes_per_token = kv_bytes_per_token(model, kv_dtype)
    engine = {
        "backend": BACKEND,
        "format_version": FORMAT_VERSION,
        "checkpoint": os.path.relpath(checkpoint_dir, engine_dir),
        "dtype": model.dtype,
        "quantization": ir_config.get("quantization") or {"quant_algo": None},
        "model": {
            "num_layers": model.num_layers,
            "hidden_size": model.hidden_size,
            "num_heads": model.num_heads,
            "num_kv_heads": model.num_kv_heads,
            "head_size": model.head_size,
            "vocab_size": model.vocab_size,
        },
        "limits": asdict(recipe.engine),
        "kv_cache": asdict(recipe.kv_cache),
        "kv_bytes_per_token": bytes_per_token,
    }
    engine_dir.mkdir(parents=True, exist_ok=True)
    (engine_dir / ENGINE_JSON).write_text(json.dumps(engine, indent=2, sort_keys=True) + "\n")
    return {
        "backend": BACKEND,
        "engine_dir": str(engine_dir),
        "kv_bytes_per_token": bytes_per_token,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        # Ahead of time: build llmc's CPU kernels now (~40 s once per machine) rather than in the first
        # `llmc generate` on CPU. On a machine without them the CPU engine uses PyTorch's ops (reported).
        "cpu_kernels": cpu_ext.status(),
        "cpu_prefill": prefill_path(model.dtype),  # bfloat16 where the CPU has AVX512-BF16 (16-bit, AWQ IRs)
    }


def read_engine_config(engine_dir: str | Path) -> dict[str, Any]:
    """Read ``engine.json`` of a torch engine folder; EngineError when missing, foreign or too new."""
    path = Path(engine_dir) / ENGINE_JSON
    fix = "Fix: rebuild with `llmc build RECIPE --force`"
    if not path.is_file():
        raise EngineError(f"{path} is missing, so {engine_dir} is not a torch engine. {fix}")
    engine = json.loads(path.read_text())
    if engine.get("backend") != BACKEND:
        raise EngineError(f"{path} is for backend {engine.get('backend')!r}, not {BACKEND!r}. {fix}")
    if int(engine.get("format_version", 0)) > FORMAT_VERSION:
        raise EngineError(
            f"{path} has format_version {engine.get('format_version')}, newer than this llmc reads "
            f"({FORMAT_VERSION}). Fix: upgrade llmc or rebuild the engine with this version"
        )
    return engine

"""Build TensorRT engines from llmc's checkpoint IR with TensorRT-LLM's Python API (1.0 - 1.2).

Order (each step fails with a typed error before the next starts):
1. read the IR's config.json and check the recipe (:func:`checks.check_recipe`) - no TensorRT-LLM yet;
2. check the IR (:func:`ir.check_ir`: every rank's tensor names/shapes/dtypes from the safetensors headers,
   groupwise padding, FP8 KV scales when asked);
3. import TensorRT-LLM (:func:`versions.require_tensorrt_llm`);
4. write ``build_config.json`` and ``trtllm-build.sh`` next to the engines;
5. per rank: ``LLaMAForCausalLM.from_checkpoint(ckpt_dir, rank=r)`` (``QWenForCausalLM`` for a Qwen2 IR) ->
   ``tensorrt_llm.builder.build(model, build_config)`` -> ``engine.save(engine_dir)`` (reference line 69);
6. write ``engine_manifest.json`` (versions, GPU, build time).

``tensorrt_llm.builder.build`` saves TensorRT's timing cache to ``BuildConfig.output_timing_cache``, whose
default is ``model.cache`` in the working directory (``BuildConfig.from_dict`` falls back to that default):
llmc points it into a temporary folder beside the engine folder (inside ``llmc build``'s temp build folder),
removed after the build, so a build leaves nothing in the user's directory.

BuildConfig construction: ``BuildConfig.from_dict(build_config_json)`` when the class has it - the same
path ``trtllm-build --build_config file.json`` (line 71) takes - else keyword construction with the
plugin fields set by attribute on ``build_config.plugin_config``. Neither ran here (docs/TENSORRT_LLM.md).
"""

from __future__ import annotations

import importlib
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llmc.engine.tensorrt_llm import config as trt_config
from llmc.engine.tensorrt_llm.checks import check_recipe
from llmc.engine.tensorrt_llm.ir import check_ir, hf_view, read_ir_config
from llmc.engine.tensorrt_llm.manifest import FORMAT_VERSION, EngineManifest
from llmc.engine.tensorrt_llm.versions import Importer, probe_module, require_tensorrt_llm
from llmc.recipe import Recipe


def model_class(models: Any, ir_config: dict) -> Any:
    """TensorRT-LLM's model class of the IR's ``architecture``: ``LLaMAForCausalLM``, or ``QWenForCausalLM`` for
    ``Qwen2ForCausalLM`` (what ``tensorrt_llm.models.MODEL_MAP`` maps it to; it reads ``qwen_type`` from the
    config)."""
    return models.QWenForCausalLM if ir_config.get("architecture") == "Qwen2ForCausalLM" else models.LLaMAForCausalLM


def apply_kv_cache_quantization(recipe: Recipe, checkpoint_dir: Path, ir_config: dict) -> dict:
    """Write the recipe's KV-cache quantization into the IR's config.json when it differs (line 32)."""
    updated = trt_config.kv_cache_quantization(ir_config.get("quantization"), recipe.kv_cache.dtype)
    if updated == ir_config.get("quantization"):
        return ir_config
    ir_config = {**ir_config, "quantization": updated}
    (Path(checkpoint_dir) / "config.json").write_text(json.dumps(ir_config, indent=2) + "\n")
    return ir_config


def make_build_config(builder: Any, build_config: dict) -> Any:
    """A ``tensorrt_llm.builder.BuildConfig`` from llmc's dict (the module docstring gives the two paths)."""
    cls = builder.BuildConfig
    if hasattr(cls, "from_dict"):
        return cls.from_dict(build_config)
    top = {k: v for k, v in build_config.items() if k != "plugin_config"}
    obj = cls(**top)
    for key, value in build_config["plugin_config"].items():
        setattr(obj.plugin_config, key, value)
    return obj


def gpu_identity() -> tuple[str | None, str | None]:
    """(GPU name, compute capability "9.0") of device 0 through torch.cuda; (None, None) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None, None
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"{major}.{minor}"


def build_engines(recipe: Recipe, checkpoint_dir: Path, engine_dir: Path,
                  importer: Importer = importlib.import_module) -> dict:
    """Compile one TensorRT engine per rank from the IR in ``checkpoint_dir`` into ``engine_dir``.

    ``importer`` imports ``tensorrt_llm`` (tests pass a test double). Returns a JSON-able report:
    engine_dir, world_size, versions, GPU, build_time_s, build_config.
    """
    checkpoint_dir, engine_dir = Path(checkpoint_dir), Path(engine_dir)
    ir_config = read_ir_config(checkpoint_dir)
    check_recipe(recipe, hf_view(ir_config))
    check_ir(recipe, checkpoint_dir, ir_config)
    trtllm = require_tensorrt_llm(importer)
    ir_config = apply_kv_cache_quantization(recipe, checkpoint_dir, ir_config)
    build_config = trt_config.build_config_dict(recipe, ir_config)
    engine_dir.mkdir(parents=True, exist_ok=True)
    (engine_dir / "build_config.json").write_text(json.dumps(build_config, indent=2) + "\n")
    script = engine_dir / "trtllm-build.sh"
    script.write_text(trt_config.build_script(checkpoint_dir, engine_dir, build_config))
    script.chmod(0o755)
    builder, models = importer("tensorrt_llm.builder"), importer("tensorrt_llm.models")
    world_size = int(ir_config.get("mapping", {}).get("world_size", 1))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".timing-cache-", dir=engine_dir.parent) as cache_dir:
        run_config = {**build_config, "output_timing_cache": str(Path(cache_dir) / "model.cache")}
        for rank in range(world_size):
            model = model_class(models, ir_config).from_checkpoint(str(checkpoint_dir), rank=rank)
            engine = builder.build(model, make_build_config(builder, run_config))
            engine.save(str(engine_dir))
    gpu_name, capability = gpu_identity()
    manifest = EngineManifest(
        format_version=FORMAT_VERSION, backend="tensorrt_llm",
        tensorrt_version=probe_module("tensorrt", importer).version or "unknown",
        tensorrt_llm_version=str(trtllm.__version__), gpu_name=gpu_name, compute_capability=capability,
        world_size=world_size, build_time_s=round(time.perf_counter() - start, 3), build_config=build_config,
    )
    manifest.write(engine_dir)
    return {"engine_dir": str(engine_dir), **asdict(manifest)}

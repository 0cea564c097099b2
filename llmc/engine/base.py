"""Backend dispatch: compile a checkpoint IR into an engine folder, and load a build folder's model runner.

Backends: ``torch`` (the portable engine in ``llmc.engine.torch``) and ``tensorrt_llm`` (``llmc.engine.
tensorrt_llm``, imported lazily so that llmc works where TensorRT-LLM is not installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmc.engine.tensorrt_llm.build import build_engines
from llmc.engine.torch.compile import compile_torch_engine
from llmc.engine.torch.runner import TorchModelRunner
from llmc.engine.types import StepRunner
from llmc.errors import EngineError
from llmc.manifest import read_manifest
from llmc.recipe import Recipe

BACKENDS = ("torch", "tensorrt_llm")


def compile_engine(recipe: Recipe, checkpoint_dir: str | Path, engine_dir: str | Path) -> dict[str, Any]:
    """Turn the IR in ``checkpoint_dir`` into ``engine_dir`` for ``recipe.backend``; returns the backend's report.

    torch: writes ``engine.json``. tensorrt_llm: ``llmc.engine.tensorrt_llm.build.build_engines``.
    """
    if recipe.backend == "torch":
        return compile_torch_engine(recipe, checkpoint_dir, engine_dir)
    if recipe.backend == "tensorrt_llm":
        return build_engines(recipe, checkpoint_dir, engine_dir)
    raise EngineError(f"unknown backend {recipe.backend!r}. Fix: set backend to one of {', '.join(BACKENDS)}")


def load_runner(build_dir: str | Path, device: torch.device | str = "cpu", num_blocks: int | None = None
                ) -> StepRunner:
    """The step-level model runner of a build folder (:class:`~llmc.engine.types.StepRunner`).

    ``device="auto"`` picks CUDA when available. Only the torch backend has a step-level runner: a
    tensorrt_llm engine batches and samples inside TensorRT-LLM's own executor and is driven through
    ``llmc.engine.tensorrt_llm.runner.TrtllmRunner.from_build_dir`` instead (EngineError here says so).
    Raises EngineError for an unreadable build folder or an unknown backend.
    """
    backend = read_manifest(Path(build_dir)).backend
    if backend == "torch":
        return TorchModelRunner(build_dir, device=device, num_blocks=num_blocks)
    if backend == "tensorrt_llm":
        raise EngineError(
            f"{build_dir} is a tensorrt_llm build: it runs inside TensorRT-LLM's executor, which has no "
            f"step-level runner. Fix: open it with llmc.Engine.from_dir (generate/stream), serve it "
            f"with tritonserver --model-repository <build>/model_repo, or rebuild the recipe with backend: torch"
        )
    raise EngineError(f"{build_dir}: unknown backend {backend!r} in manifest.json. Fix: rebuild with llmc build")

"""Test doubles for TensorRT-LLM's Python API (never registered as modules, never named tensorrt_llm).

They are passed to llmc explicitly: as the ``importer`` of ``require_tensorrt_llm`` / ``build_engines``
(a callable from a module name to an object) or as ``model_runner_cls`` of ``TrtllmRunner``. Each one
records how llmc called it so the tests can check the calls against the documented API
(/work/shared/reference/tensorrt-llm.md lines 69-91).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np


class MissingModuleImporter:
    """An importer on a machine without TensorRT-LLM: every import fails. Records the names asked for."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name: str) -> Any:
        self.calls.append(name)
        raise ModuleNotFoundError(f"No module named {name!r}")


class VersionOnlyImporter:
    """An importer whose 'tensorrt_llm' is a plain namespace with only ``__version__``."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.calls: list[str] = []

    def __call__(self, name: str) -> Any:
        self.calls.append(name)
        return SimpleNamespace(__version__=self.version)


class RecordingBuildApi:
    """Stands in for the parts of TensorRT-LLM 1.2 that ``build_engines`` uses, recording every call.

    ``importer(name)`` returns namespaces for "tensorrt_llm", "tensorrt_llm.builder", "tensorrt_llm.models"
    and "tensorrt" (TensorRT's version).
    """

    def __init__(self, version: str = "1.2.0", tensorrt_version: str = "10.13.2") -> None:
        self.calls: list[tuple[str, dict]] = []
        api = self

        class BuildConfigDouble:
            @classmethod
            def from_dict(cls, config: dict) -> Any:
                api.calls.append(("BuildConfig.from_dict", {"config": config}))
                return SimpleNamespace(kind="BuildConfig", config=config)

        class EngineDouble:
            def __init__(self, rank: int) -> None:
                self.rank = rank

            def save(self, engine_dir: str) -> None:
                api.calls.append(("engine.save", {"engine_dir": engine_dir, "rank": self.rank}))
                Path(engine_dir, f"rank{self.rank}.engine").write_bytes(b"not an engine")

        class LlamaDouble:
            @classmethod
            def from_checkpoint(cls, ckpt_dir: str, rank: int) -> Any:
                api.calls.append(("LLaMAForCausalLM.from_checkpoint", {"ckpt_dir": ckpt_dir, "rank": rank}))
                return SimpleNamespace(rank=rank)

        def build(model: Any, build_config: Any) -> Any:
            api.calls.append(("builder.build", {"model": model, "build_config": build_config}))
            return EngineDouble(model.rank)

        self.modules = {
            "tensorrt_llm": SimpleNamespace(__version__=version),
            "tensorrt_llm.builder": SimpleNamespace(BuildConfig=BuildConfigDouble, build=build),
            "tensorrt_llm.models": SimpleNamespace(LLaMAForCausalLM=LlamaDouble),
            "tensorrt": SimpleNamespace(__version__=tensorrt_version),
        }

    def importer(self, name: str) -> Any:
        self.calls.append(("import", {"name": name}))
        if name not in self.modules:
            raise ModuleNotFoundError(name)
        return self.modules[name]


class RecordingModelRunnerCpp:
    """Stands in for ``tensorrt_llm.runtime.ModelRunnerCpp``: records ``from_dir`` and ``generate`` calls
    (argument names and types) and streams scripted tokens shaped like the reference says (line 91):
    ``output_ids`` int32 [batch, beams, max_seq_len] padded with end_id, including the prompt, plus
    ``sequence_lengths`` [batch, beams]. ``script[b]`` is request b's generated tokens; ``chunk`` tokens
    arrive per streamed step (each step cumulative, as the full buffer).
    """

    instances: list[RecordingModelRunnerCpp]  # set per test by ``with_script``

    def __init__(self, engine_dir: str, kwargs: dict, script: list[list[int]], chunk: int, max_seq_len: int):
        self.engine_dir, self.from_dir_kwargs = engine_dir, kwargs
        self.script, self.chunk, self.max_seq_len = script, chunk, max_seq_len
        self.generate_calls: list[dict] = []

    @classmethod
    def with_script(cls, script: list[list[int]], chunk: int = 2, max_seq_len: int = 64) -> type:
        """A subclass whose ``from_dir`` builds instances that will stream ``script``."""
        made: list[RecordingModelRunnerCpp] = []

        class Scripted(cls):
            instances = made

            @classmethod
            def from_dir(klass, engine_dir: str, **kwargs: Any) -> RecordingModelRunnerCpp:
                runner = cls(engine_dir, kwargs, script, chunk, max_seq_len)
                made.append(runner)
                return runner

        return Scripted

    def generate(self, batch_input_ids: list, **kwargs: Any):
        self.generate_calls.append({"batch_input_ids": batch_input_ids, **kwargs})
        return self._stream(batch_input_ids, kwargs["end_id"], kwargs["max_new_tokens"])

    def _stream(self, batch_input_ids: list, end_id: int, max_new_tokens: int):
        batch = len(batch_input_ids)
        produced = 0
        longest = max(len(s) for s in self.script)
        while produced < min(longest, max_new_tokens):
            produced = min(produced + self.chunk, longest, max_new_tokens)
            output_ids = np.full((batch, 1, self.max_seq_len), end_id, dtype=np.int32)  # [batch, beams, max_seq_len]
            lengths = np.zeros((batch, 1), dtype=np.int32)  # [batch, beams]
            for b, prompt in enumerate(batch_input_ids):
                new = self.script[b][:produced]
                seq = list(prompt.tolist()) + new
                output_ids[b, 0, : len(seq)] = seq
                lengths[b, 0] = len(seq)
            yield {"output_ids": output_ids, "sequence_lengths": lengths}

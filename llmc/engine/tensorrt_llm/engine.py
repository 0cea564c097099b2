"""``Engine.from_dir`` for TensorRT-LLM builds: llmc's request API over :class:`TrtllmRunner`.

TensorRT-LLM schedules in-flight batches inside its own C++ executor, so this facade offers the
request-level subset of :class:`llmc.runtime.api.Engine` that maps onto ``ModelRunnerCpp``: ``generate``
(one batch) and ``stream`` (one request), with the same prompt handling (text, chat messages, token ids),
the same recipe sampling defaults and validation, and the same events (llmc's own stop handling and
incremental detokenizer run on top, inside :class:`TrtllmRunner`). Continuous batching across concurrent
callers (``llmc serve``, offline ``llmc bench``) is the job of Triton's ``tensorrt_llm`` backend: serve a
TensorRT-LLM build with ``tritonserver --model-repository <build>/model_repo`` and benchmark it with
``llmc bench --url``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from llmc.engine.tensorrt_llm.runner import TrtllmRunner
from llmc.engine.types import BatchRunner
from llmc.errors import EngineError
from llmc.manifest import read_manifest
from llmc.recipe import Recipe
from llmc.request.inputs import Prompt, check_prompt_length, prompt_to_token_ids
from llmc.request.outputs import Completion, StreamEvent
from llmc.request.params import SamplingParams

CONCURRENCY_HINT = (
    "TensorRT-LLM engines batch requests inside Triton's tensorrt_llm backend: run "
    "`tritonserver --model-repository <build>/model_repo` and use `llmc bench --url` or the client scripts; "
    "or rebuild the recipe with backend: torch to use llmc's own scheduler"
)


class TrtllmEngine:
    """Request API of a TensorRT-LLM build folder (see the module docstring for what it covers)."""

    backend = "tensorrt_llm"

    def __init__(self, runner: BatchRunner, recipe: Recipe):
        self.runner = runner
        self.recipe = recipe
        self.tokenizer = runner.tokenizer
        self.eos_token_ids = runner.eos_token_ids
        self.default_params = recipe.runtime.sampling
        self.vocab_size = runner.vocab_size

    @classmethod
    def from_build_dir(cls, build_dir: str | Path, model_runner_cls: Any = None,
                       found_versions: dict[str, str | None] | None = None) -> TrtllmEngine:
        """Open a build folder whose manifest says ``backend: tensorrt_llm`` (versions checked first)."""
        build_dir = Path(build_dir)
        recipe = read_manifest(build_dir).recipe_obj()
        runner = TrtllmRunner.from_build_dir(build_dir, model_runner_cls=model_runner_cls,
                                             found_versions=found_versions)
        return cls(runner, recipe)

    def _token_ids(self, prompt: Prompt) -> list[int]:
        ids = prompt_to_token_ids(self.tokenizer, prompt, self.recipe.model.add_special_tokens, self.vocab_size)
        check_prompt_length(len(ids), self.recipe.engine.max_input_len)
        return list(ids)

    def _params(self, params: SamplingParams | None) -> SamplingParams:
        return (self.default_params if params is None else params).validate(self.vocab_size)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[Completion]:
        """Run ``prompts`` as one TensorRT-LLM batch; one :class:`Completion` per prompt, in order."""
        params = self._params(params)
        return self.runner.generate([self._token_ids(p) for p in prompts], params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str = "trt-0") -> Iterator[StreamEvent]:
        """One request's :class:`StreamEvent` objects as TensorRT-LLM produces tokens."""
        params = self._params(params)
        return self.runner.stream(self._token_ids(prompt), params, request_id)

    def add_request(self, *args: Any, **kwargs: Any) -> str:
        raise EngineError(f"add_request is not available for a TensorRT-LLM build. {CONCURRENCY_HINT}")

    def astream(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineError(f"astream is not available for a TensorRT-LLM build. {CONCURRENCY_HINT}")

    def start(self) -> None:
        raise EngineError(f"a background step loop is not available for a TensorRT-LLM build. {CONCURRENCY_HINT}")

    def abort(self, request_id: str) -> bool:
        """Nothing to abort: requests run synchronously inside ``generate``/``stream``."""
        return False

    def shutdown(self) -> None:
        """Nothing to stop (no background loop)."""

"""Test doubles for TensorRT-LLM's Python API (never registered as modules, never named tensorrt_llm).

They are passed to llmc explicitly: as the ``importer`` of ``require_tensorrt_llm`` / ``build_engines``
(a callable from a module name to an object) or as ``model_runner_cls`` of ``TrtllmRunner``. Each one
records how llmc called it so the tests can check the calls against the documented API
(TensorRT-LLM 1.0 - 1.2 sources; docs/TENSORRT_LLM.md names the files and commits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


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

        class QwenDouble:
            @classmethod
            def from_checkpoint(cls, ckpt_dir: str, rank: int) -> Any:
                api.calls.append(("QWenForCausalLM.from_checkpoint", {"ckpt_dir": ckpt_dir, "rank": rank}))
                return SimpleNamespace(rank=rank)

        def build(model: Any, build_config: Any) -> Any:
            api.calls.append(("builder.build", {"model": model, "build_config": build_config}))
            # Like tensorrt_llm.builder.build: rank 0 saves the timing cache to output_timing_cache, whose
            # BuildConfig default is the relative path "model.cache" (the working directory).
            if model.rank == 0:
                Path(build_config.config.get("output_timing_cache", "model.cache")).write_bytes(b"timing cache")
            return EngineDouble(model.rank)

        self.modules = {
            "tensorrt_llm": SimpleNamespace(__version__=version),
            "tensorrt_llm.builder": SimpleNamespace(BuildConfig=BuildConfigDouble, build=build),
            "tensorrt_llm.models": SimpleNamespace(LLaMAForCausalLM=LlamaDouble, QWenForCausalLM=QwenDouble),
            "tensorrt": SimpleNamespace(__version__=tensorrt_version),
        }

    def importer(self, name: str) -> Any:
        self.calls.append(("import", {"name": name}))
        if name not in self.modules:
            raise ModuleNotFoundError(name)
        return self.modules[name]


@dataclass
class RequestDouble:
    """What ``ModelRunnerCpp.generate`` puts into one ``trtllm.Request`` (the fields llmc influences)."""

    input_token_ids: list[int]
    max_tokens: int
    end_id: int
    pad_id: int
    stop_words: list[list[int]] | None


@dataclass
class ResponseDouble:
    """An executor ``Response``: ``result.output_token_ids[0]`` are the new tokens since the last response.
    Like the binding, reading ``result`` of an error response raises."""

    request_id: int
    _result: SimpleNamespace | None
    error_msg: str = ""

    def has_error(self) -> bool:
        return bool(self.error_msg)

    @property
    def result(self) -> SimpleNamespace:
        if self._result is None:
            raise RuntimeError(f"Cannot get the result for a response with an error ({self.error_msg})")
        return self._result


@dataclass
class _Active:
    request: RequestDouble
    script: list[int]
    produced: list[int] = field(default_factory=list)
    cancelled: bool = False


class RecordingExecutor:
    """Stands in for ``tensorrt_llm.bindings.executor.Executor`` as TensorRT-LLM 1.0 - 1.2 behaves:

    - ``enqueue_requests`` returns new ids (increasing); request b of a batch generates ``script[b]``;
    - each ``await_responses()`` gives every active request one response with its next ``chunk`` tokens;
      a request is final after ``max_tokens`` tokens, when the script ends, when it samples ``end_id``
      (not output), or when its output ends with one of its stop words (output, as TensorRT-LLM does);
    - ``cancel_request(id)``: the request's next response is final, with no new tokens
      (executorImpl.cpp ``terminateCancelledRequests``); an unknown or finished id is only recorded;
    - ``await_responses(id, timeout)``: that request's next response, ``[]`` when it is not active;
    - ``fail[b] = n``: request b of the next batch answers with an error (final) after ``n`` responses.
    Records everything in ``enqueued``, ``cancelled``, ``finished`` (id -> reason) and ``stray_cancels``.
    """

    def __init__(self, script: list[list[int]], chunk: int) -> None:
        self.script, self.chunk = script, chunk
        self.next_id = 100
        self.active: dict[int, _Active] = {}
        self.enqueued: list[tuple[int, RequestDouble]] = []
        self.cancelled: list[int] = []
        self.stray_cancels: list[int] = []
        self.finished: dict[int, str] = {}
        self.fail: dict[int, int] = {}
        self._fail_at: dict[int, int] = {}

    def enqueue_requests(self, requests: list[RequestDouble]) -> list[int]:
        ids = []
        for b, request in enumerate(requests):
            rid, self.next_id = self.next_id, self.next_id + 1
            self.active[rid] = _Active(request, list(self.script[b]))
            if b in self.fail:
                self._fail_at[rid] = self.fail.pop(b)
            self.enqueued.append((rid, request))
            ids.append(rid)
        return ids

    def cancel_request(self, rid: int) -> None:
        self.cancelled.append(rid)
        if rid in self.active:
            self.active[rid].cancelled = True
        else:
            self.stray_cancels.append(rid)

    def await_responses(self, rid: int | None = None, timeout: Any = None) -> list[ResponseDouble]:
        ids = list(self.active) if rid is None else [rid] if rid in self.active else []
        return [self._respond(i) for i in ids]

    def _respond(self, rid: int) -> ResponseDouble:
        state = self.active[rid]
        if self._fail_at.get(rid) == 0 and not state.cancelled:
            self.finished[rid] = "error"
            del self.active[rid]
            return ResponseDouble(rid, None, "scripted executor error")
        if rid in self._fail_at:
            self._fail_at[rid] -= 1
        new, reason = [], None
        if state.cancelled:
            reason = "cancelled"
        while reason is None and len(new) < self.chunk:
            if len(state.produced) >= state.request.max_tokens:
                reason = "length"
            elif len(state.produced) >= len(state.script):
                reason = "end_id"
            else:
                token = state.script[len(state.produced)]
                state.produced.append(token)
                if token == state.request.end_id:
                    reason = "end_id"
                    break
                new.append(token)
                if any(state.produced[-len(w):] == w for w in state.request.stop_words or [] if w):
                    reason = "stop_words"
        if reason is None and len(state.produced) >= state.request.max_tokens:
            reason = "length"
        if reason is not None:
            self.finished[rid] = reason
            del self.active[rid]
        result = SimpleNamespace(output_token_ids=[new], is_final=reason is not None, sequence_index=0)
        return ResponseDouble(rid, result)


class RecordingModelRunnerCpp:
    """Stands in for ``tensorrt_llm.runtime.ModelRunnerCpp`` (model_runner_cpp.py, TensorRT-LLM 1.0 - 1.2):
    records ``from_dir`` and ``generate`` calls (argument names and types), and behaves like upstream:
    ``generate`` builds one request per prompt, zipping ``stop_words_list`` per request, enqueues them on
    ``self.executor`` and returns a stream that awaits responses until each of its requests is final,
    raising ``ValueError`` (``request_ids.index``) for a response of another request and ``RuntimeError``
    for an error response. Each streamed item holds ``output_ids`` int32 [batch, beams, max_seq_len]
    (prompt + tokens so far, padded with end_id) and ``sequence_lengths`` [batch, beams].
    """

    instances: list[RecordingModelRunnerCpp]  # set per test by ``with_script``

    def __init__(self, engine_dir: str, kwargs: dict, script: list[list[int]], chunk: int, max_seq_len: int):
        self.engine_dir, self.from_dir_kwargs = engine_dir, kwargs
        self.max_seq_len = max_seq_len
        self.executor: Any = RecordingExecutor(script, chunk)
        self.generate_calls: list[dict] = []

    @property
    def recording(self) -> RecordingExecutor:
        """The executor double (``self.executor`` may be wrapped by llmc)."""
        return getattr(self.executor, "_executor", self.executor)

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
        prompts = [t.tolist() for t in batch_input_ids]
        stop_words_list = kwargs.get("stop_words_list") or [None] * len(prompts)
        requests = [RequestDouble(p, kwargs["max_new_tokens"], kwargs["end_id"], kwargs["pad_id"],
                                  None if sw is None else [[int(t) for t in word] for word in sw])
                    for p, sw in zip(prompts, stop_words_list)]
        request_ids = self.executor.enqueue_requests(requests)
        return self._stream(request_ids, prompts, kwargs["end_id"])

    def _stream(self, request_ids: list[int], prompts: list[list[int]], end_id: int):
        output_ids = [list(p) for p in prompts]
        finished: set[int] = set()
        while finished != set(request_ids):
            responses = self.executor.await_responses()
            for response in responses:
                if response.result.is_final:
                    finished.add(response.request_id)
            for response in responses:
                if response.has_error():
                    raise RuntimeError(response.error_msg)
                output_ids[request_ids.index(response.request_id)] += response.result.output_token_ids[0]
            lengths = torch.tensor([[len(ids)] for ids in output_ids], dtype=torch.int32)  # [batch, beams]
            padded = [[ids + [end_id] * (self.max_seq_len - len(ids))] for ids in output_ids]
            yield {"output_ids": torch.tensor(padded, dtype=torch.int32), "sequence_lengths": lengths}

"""The transformers baseline (``--baseline hf``): ``model.generate`` on the same model, prompts and sampling.

Concurrency 1 runs the prompts one after another; concurrency N > 1 runs them as static batches of N,
left-padded (transformers has no continuous batching). A streamer timestamps every generation step, so TTFT
and ITL are measured exactly like llmc's (TTFT from the start of the ``generate`` call). Output length is
enforced with ``min_new_tokens == max_new_tokens``, the transformers equivalent of ``ignore_eos``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from llmc.bench.records import LevelResult, PeakMonitor, RequestRecord
from llmc.bench.plan import BenchPlan
from llmc.bench.workload import BenchPrompt
from llmc.errors import SourceError
from llmc.manifest import read_manifest
from llmc.request.params import SamplingParams
from llmc.runtime.compute import run_compute
from llmc.source.load import resolve_source


class StepTimer(BaseStreamer):
    """A streamer that records when each generated token (one per step, for the whole batch) appears."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands the streamer the prompt ids
            self._prompt_seen = True
            return
        self.times.append(self.clock())

    def end(self) -> None:
        """Nothing to flush: only timestamps are kept."""


def resolve_hf_dir(build_dir: str | Path) -> Path:
    """The Hugging Face folder a build was made from: the recorded source folder, or the cached conversion
    of its GGUF file (converted again if the cache was cleared). Raises SourceError when the source is gone."""
    manifest = read_manifest(Path(build_dir))
    recipe = manifest.recipe_obj()
    try:
        return resolve_source(recipe.model, sha256=manifest.source.get("sha256")).hf_dir
    except SourceError as exc:
        raise SourceError(f"the HF baseline needs the build's source model: {exc}. Fix: pass --baseline-model "
                          f"with a Hugging Face folder of the same model") from None


class HFBaseline:
    """transformers ``generate`` on one model, measured the way llmc's engine is."""

    def __init__(self, hf_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.hf_dir = Path(hf_dir)
        self.device = torch.device(device)
        # The portable engine computes in float32 on CPU; on a GPU the caller passes the engine's dtype.
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.float16)
        self.model = run_compute(
            lambda: AutoModelForCausalLM.from_pretrained(str(self.hf_dir), dtype=self.dtype).to(self.device).eval())
        tokenizer = AutoTokenizer.from_pretrained(str(self.hf_dir))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def describe(self) -> dict[str, Any]:
        import transformers

        return {"name": "hf", "model_dir": str(self.hf_dir), "dtype": str(self.dtype).removeprefix("torch."),
                "device": str(self.device), "transformers": transformers.__version__,
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                "batching": "sequential at concurrency 1, static left-padded batches above",
                "prefix_caching": False}

    @torch.inference_mode()
    def generate_batch(self, prompts: Sequence[BenchPrompt], params: SamplingParams) -> list[RequestRecord]:
        """One ``generate`` call over ``prompts`` (left-padded); one record per prompt, each cut to its OSL."""
        width = max(p.prompt_tokens for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, width]
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, width]
        for row, p in enumerate(prompts):
            ids[row, width - p.prompt_tokens:] = torch.tensor(p.token_ids)
            mask[row, width - p.prompt_tokens:] = 1
        new_tokens = max(p.max_new_tokens for p in prompts)
        timer = StepTimer()
        start = timer.clock()
        self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=timer,
                            pad_token_id=self.pad_id, **_sampling_kwargs(params))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        records = []
        for p in prompts:
            times = tuple(timer.times[:p.max_new_tokens])
            records.append(RequestRecord(p.prompt_tokens, len(times), start, times, times[-1], "length"))
        return records

    def _run_level(self, prompts: Sequence[BenchPrompt], concurrency: int, params: SamplingParams) -> LevelResult:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        records: list[RequestRecord] = []
        with PeakMonitor() as monitor:
            start = time.perf_counter()
            for i in range(0, len(prompts), concurrency):
                records.extend(self.generate_batch(prompts[i:i + concurrency], params))
            wall = time.perf_counter() - start
        memory: dict[str, Any] = {"rss_peak_mb": round(monitor.peaks["rss_mb"], 1),
                                  "weights_mb": round(self.weight_bytes / 2**20, 1)}
        if self.device.type == "cuda":
            memory["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        # generate() keeps no KV cache between calls: every prompt token is computed again
        return LevelResult(concurrency, tuple(records), wall, memory, prefix_cache={"hit_tokens": 0})

    def warm_up(self, prompts: Sequence[BenchPrompt], params: SamplingParams) -> None:
        """Run ``prompts`` one at a time, unmeasured (first-call costs, allocator growth)."""
        self._in_worker(lambda: [self.generate_batch([p], params) for p in prompts])

    def run_level(self, prompts: Sequence[BenchPrompt], concurrency: int, params: SamplingParams) -> LevelResult:
        """All ``prompts`` in consecutive batches of ``concurrency`` (1 = one at a time)."""
        return self._in_worker(self._run_level, prompts, concurrency, params)

    def run(self, plan: BenchPlan, params: SamplingParams,
            on_level: Callable[[LevelResult], None] | None = None) -> list[LevelResult]:
        """Warm up with ``plan.warmup`` (not measured), then measure every level (``on_level`` after each)."""
        self.warm_up(plan.warmup, params)
        results = []
        for concurrency, prompts in plan.levels:
            results.append(self.run_level(prompts, concurrency, params))
            if on_level is not None:
                on_level(results[-1])
        return results

    def _in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the process's compute thread, where llmc's engine runs its steps too: every torch
        call of the benchmark then uses one OpenMP thread team, so neither side is throttled by the other's
        (see llmc/runtime/compute.py: a second live team made each CPU step ~2x slower)."""
        return run_compute(fn, *args)


def _sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """transformers generate() arguments for the same sampling as llmc (greedy when temperature is 0)."""
    if params.greedy:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "repetition_penalty": params.repetition_penalty}

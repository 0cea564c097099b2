"""Offline benchmark: drive an in-process :class:`~llmc.runtime.api.Engine` with a closed loop of streams.

At each concurrency level N, N threads each stream one request at a time through ``Engine.stream`` while the
engine's background loop (``Engine.start()``) steps the batch. Latencies come from the engine's own
``RequestMetrics`` (TTFT from acceptance, one timestamp per token); memory peaks are sampled during the
level; step metrics come from the engine's JSON-lines metrics log when one is attached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from llmc.bench.records import LevelResult, PeakMonitor, RequestRecord, closed_loop
from llmc.bench.plan import BenchPlan, bench_params
from llmc.bench.workload import BenchPrompt
from llmc.errors import EngineError
from llmc.request.metrics import percentiles, read_metrics_log
from llmc.request.params import SamplingParams


def run_request(engine: Any, prompt: BenchPrompt, params: SamplingParams) -> RequestRecord:
    """Stream one prompt (as token ids) to the end and turn the engine's metrics into a record."""
    last = None
    for event in engine.stream(list(prompt.token_ids), params):
        last = event
    if last is None or last.metrics is None:
        raise EngineError("the engine finished a stream without metrics on its last event; the runtime must attach "
                          "RequestMetrics to the finishing StreamEvent")
    m = last.metrics
    return RequestRecord(prompt_tokens=m.prompt_tokens, generated_tokens=m.generated_tokens, start=m.arrival_time,
                         token_times=tuple(m.token_times), end=m.finished_time, finish_reason=last.finish_reason)


def run_level(engine: Any, prompts: Sequence[BenchPrompt], concurrency: int, params: SamplingParams,
              step_log: Path | None = None) -> LevelResult:
    """Run ``prompts`` through a closed loop of ``concurrency`` streams; the engine must be started."""
    cuda = _cuda_device(engine)
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats(engine.runner.device)
    per_prompt = {p.max_new_tokens: bench_params(params, p.max_new_tokens) for p in prompts}
    before = engine.stats()
    t0 = engine.clock()
    with PeakMonitor(lambda: _engine_load(engine)) as monitor:
        records, wall = closed_loop(list(prompts), concurrency,
                                    lambda p: run_request(engine, p, per_prompt[p.max_new_tokens]), engine.clock)
    t1 = engine.clock()
    if step_log is not None:
        engine.flush_metrics()  # the last step's record is written after its requests' final events
    after = engine.stats()
    steps = summarize_steps(read_metrics_log(step_log), t0, t1) if step_log is not None and step_log.exists() else {}
    memory = _memory(engine, monitor.peaks, cuda, steps)
    return LevelResult(concurrency, tuple(records), wall, memory, steps, prefix_cache_delta(before, after))


def prefix_cache_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Prompt tokens looked up in / served from the prefix cache between two ``Engine.stats()`` snapshots (the
    engine is idle at both: every allocation in between belongs to the level)."""
    return {key: after[f"prefix_cache_{key}"] - before[f"prefix_cache_{key}"]
            for key in ("queried_tokens", "hit_tokens")}


def run_offline(engine: Any, plan: BenchPlan, params: SamplingParams, step_log: Path | None = None,
                on_level: Callable[[str, LevelResult], None] | None = None, baseline: Any | None = None,
                ) -> tuple[list[LevelResult], list[LevelResult] | None]:
    """Warm up with ``plan.warmup`` (not measured), then measure every level of the plan in order.

    ``baseline`` (optional, e.g. :class:`~llmc.bench.baseline.HFBaseline`: ``warm_up(prompts, params)`` and
    ``run_level(prompts, concurrency, params)``) is measured on the same prompts right after llmc at each
    level, so both see the same machine load. ``on_level(label, result)`` is called after each measurement.
    Returns ``(llmc levels, baseline levels or None)``. Starts the engine's background loop (and leaves it
    running; the caller shuts the engine down)."""
    engine.start()
    for prompt in plan.warmup:
        run_request(engine, prompt, bench_params(params, prompt.max_new_tokens))
    if baseline is not None:
        baseline.warm_up(plan.warmup, params)
    ours: list[LevelResult] = []
    theirs: list[LevelResult] | None = [] if baseline is not None else None
    for concurrency, prompts in plan.levels:
        ours.append(run_level(engine, prompts, concurrency, params, step_log))
        if on_level is not None:
            on_level("llmc", ours[-1])
        if baseline is not None and theirs is not None:
            theirs.append(baseline.run_level(prompts, concurrency, params))
            if on_level is not None:
                on_level("baseline", theirs[-1])
    return ours, theirs


def summarize_steps(records: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Summary of the engine steps that started in ``[t0, t1]``: count, durations, batch sizes, tokens."""
    steps = [r for r in records if r.get("type") == "step" and t0 <= r.get("time", t0 - 1) <= t1]
    if not steps:
        return {}
    durations = [s["duration_s"] for s in steps]
    out = {
        "count": len(steps),
        "duration_s": {"mean": sum(durations) / len(durations), **percentiles(durations)},
        "mean_scheduled_tokens": sum(s["scheduled_tokens"] for s in steps) / len(steps),
        "max_running": max(s["running"] for s in steps),
        "max_waiting": max(s["waiting"] for s in steps),
        "max_kv_blocks_used": max(s["kv_blocks_used"] for s in steps),
        "preemptions": sum(s.get("preemptions", 0) for s in steps),
    }
    if all("scheduled_seqs" in s for s in steps):
        out["mean_batch_size"] = sum(s["scheduled_seqs"] for s in steps) / len(steps)
    for key in ("prefill_tokens", "decode_tokens"):
        if all(key in s for s in steps):
            out[key] = sum(s[key] for s in steps)
    if all("prefill_tokens" in s and "decode_tokens" in s for s in steps):
        out["by_kind"] = steps_by_kind(steps)
    return out


STEP_KINDS = ("decode", "mixed", "prompt")


def step_kind(step: dict[str, Any]) -> str | None:
    """``decode`` (decodes only), ``prompt`` (prompt tokens only), ``mixed`` (both), None (an empty step)."""
    decode, prompt = step["decode_tokens"] > 0, step["prefill_tokens"] > 0
    return "mixed" if decode and prompt else "decode" if decode else "prompt" if prompt else None


def steps_by_kind(steps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of step (:func:`step_kind`): count, total and mean seconds, duration percentiles, mean decode and
    prompt tokens. A kind whose steps cost much more than their tokens suggest points at work outside the
    kernels (e.g. a backend that plans every new shape on the host)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in STEP_KINDS:
        group = [s for s in steps if step_kind(s) == kind]
        if not group:
            continue
        durations = [s["duration_s"] for s in group]
        out[kind] = {"count": len(group), "total_s": sum(durations), "mean_s": sum(durations) / len(group),
                     **{f"{k}_s": v for k, v in percentiles(durations).items()},
                     "mean_decode_tokens": sum(s["decode_tokens"] for s in group) / len(group),
                     "mean_prompt_tokens": sum(s["prefill_tokens"] for s in group) / len(group)}
    return out


def _engine_load(engine: Any) -> dict[str, float]:
    stats = engine.stats()
    return {"kv_blocks_used": stats["kv_blocks_used"], "running": stats["running"], "waiting": stats["waiting"]}


def _cuda_device(engine: Any) -> bool:
    device = getattr(engine.runner, "device", None)
    return getattr(device, "type", str(device)) == "cuda"


def _memory(engine: Any, peaks: dict[str, float], cuda: bool, steps: dict[str, Any]) -> dict[str, Any]:
    """Memory used during a level: process RSS peak, KV blocks (and bytes) peak, CUDA peak allocation.

    The KV and batch peaks take the larger of the sampled value and the step log's (``steps``, every step's
    own count): a short level can start and finish its requests between two samples of the monitor."""
    runner = engine.runner
    stats = engine.stats()
    blocks = int(max(peaks.get("kv_blocks_used", 0), steps.get("max_kv_blocks_used", 0)))
    out: dict[str, Any] = {
        "rss_peak_mb": round(peaks["rss_mb"], 1),
        "kv_blocks_used_peak": blocks,
        "kv_blocks_total": stats["kv_blocks_total"],
        "kv_block_tokens": runner.block_size,
        "max_running": int(max(peaks.get("running", 0), steps.get("max_running", 0))),
        "max_waiting": int(peaks.get("waiting", 0)),
    }
    per_token = getattr(runner, "kv_bytes_per_token", None)
    if per_token:
        out["kv_used_peak_mb"] = round(blocks * runner.block_size * per_token / 2**20, 2)
        out["kv_cache_total_mb"] = round(stats["kv_blocks_total"] * runner.block_size * per_token / 2**20, 2)
    if cuda:
        import torch

        out["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated(runner.device) / 2**20, 1)
    return out

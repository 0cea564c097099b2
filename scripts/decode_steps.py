"""Time the torch engine's decode steps, CUDA graphs on vs off, at several batch sizes (one process, same build).

    python scripts/decode_steps.py BUILD_DIR --batch 1,8,64 --context 2048 [--device cuda] [--steps 30] [--profile]
    python scripts/decode_steps.py BUILD_DIR --batch '' --prefill 1x2048,4x2048 --profile   # prefill steps only

Each step decodes one token for every sequence of the batch at ``--context`` cached tokens (cache contents do
not change the speed). Reports the median step time of each mode and their ratio; JSON on stdout. ``--profile``
adds where a graph-replayed step's GPU time goes: kernel time per kind (torch.profiler, CUDA activity; a kernel
launched programmatically counts the time it waits for its predecessor too, so the kinds can add up to more than
the step), the time at least one kernel ran (``gpu_busy_ms``) and the step's wall time outside it
(``not_kernels_ms``: host work, launch gaps, the sync that brings the tokens back) and what each kind adds in
place (``added_ms_by_kind``: a kernel's end minus the previous end, so the kinds add up to the step's GPU span).
``--prefill NxL,...`` times prefill steps too: N fresh prompts of L tokens in one step (each samples its first
token), with the model FLOPs of the step and the rate they ran at (the same kernel breakdown with ``--profile``).
``--mixed D@C+N@P,...`` times mixed steps as the scheduler makes them under a ``serving.mixed_step_tokens``
budget: D decodes at C cached tokens plus one prompt chunk of N tokens after P cached ones (P = 0: a fresh chunk).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.engine.torch.runner import TorchModelRunner  # noqa: E402
from llmc.engine.types import ScheduledSequence, SchedulerOutput  # noqa: E402
from llmc.request.params import SamplingParams  # noqa: E402


def decode_step(batch: int, context: int, block_size: int) -> SchedulerOutput:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2**20, ignore_eos=True)
    per_seq = -(-(context + 1) // block_size)
    seqs = tuple(
        ScheduledSequence(f"r{i}", (1000 + i,), context, tuple(range(i * per_seq, (i + 1) * per_seq)), True, greedy,
                          prompt_token_ids=tuple(range(context)))
        for i in range(batch))
    return SchedulerOutput(step=0, sequences=seqs)


def prefill_step(prompts: int, length: int, block_size: int, vocab_size: int) -> SchedulerOutput:
    """One step that computes ``prompts`` whole, distinct prompts of ``length`` tokens from an empty cache."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2**20, ignore_eos=True)
    per_seq = -(-length // block_size)
    seqs = []
    for i in range(prompts):
        ids = tuple((7919 * (i * length + j) + 10) % vocab_size for j in range(length))
        seqs.append(ScheduledSequence(f"p{i}", ids, 0, tuple(range(i * per_seq, (i + 1) * per_seq)), True, greedy,
                                      prompt_token_ids=ids))
    return SchedulerOutput(step=0, sequences=tuple(seqs))


def mixed_step(decodes: int, context: int, chunk: int, cached: int, block_size: int, vocab_size: int
               ) -> SchedulerOutput:
    """``decodes`` decodes at ``context`` cached tokens, then one prompt chunk of ``chunk`` tokens after ``cached``
    (it samples when it ends the prompt, which is ``cached + chunk`` tokens long here)."""
    decode = decode_step(decodes, context, block_size).sequences
    first = decodes * -(-(context + 1) // block_size)
    length = cached + chunk
    ids = tuple((7919 * j + 10) % vocab_size for j in range(length))
    blocks = tuple(range(first, first + -(-length // block_size)))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2**20, ignore_eos=True)
    chunk_seq = ScheduledSequence("chunk", ids[cached:], cached, blocks, True, greedy, prompt_token_ids=ids)
    return SchedulerOutput(step=0, sequences=decode + (chunk_seq,))


def parse_mixed(spec: str) -> tuple[int, int, int, int]:
    """``D@C+N@P`` -> (D, C, N, P)."""
    try:
        dec, chunk = spec.split("+")
        return (*(int(v) for v in dec.split("@")), *(int(v) for v in chunk.split("@")))  # type: ignore[return-value]
    except ValueError:
        raise SystemExit(f"--mixed {spec!r}: write D@C+N@P, e.g. 64@2048+960@1024") from None


def prefill_flops(shape: dict, prompts: int, length: int) -> float:
    """Model FLOPs of a prefill step of fresh prompts (``shape``: :func:`llmc.bench.bounds.shape_of`): each
    prompt's linears and causal attention (:func:`llmc.bench.bounds.prompt_flops`) plus the lm_head at its
    sampled row."""
    from llmc.bench.bounds import prompt_flops

    return prompts * (prompt_flops(shape, length) + 2.0 * shape["hidden_size"] * shape["vocab_size"])


def time_steps(runner: TorchModelRunner, step: SchedulerOutput, steps: int) -> float:
    for _ in range(3):
        runner.execute(step)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.execute(step)  # ends with the sampled ids on the host: a full step, synchronised
        times.append(time.perf_counter() - start)
    return statistics.median(times)


KINDS = (  # (kind, substrings of kernel names), first match wins
    ("int4 matmul (llmc)", ("w4a16_matmul", "w4a16_pipe_kernel", "w4a16_pipe_fused_kernel", "w4a16_reg_kernel")),
    ("int4 dequantize (llmc)", ("w4a16_dequant", "w4a16_mma_dequant")),
    ("attention split merge (llmc)", ("paged_decode_combine",)),
    ("attention (llmc paged decode)", ("paged_decode",)),
    ("attention (prefill: SDPA / flash)", ("flash", "fmha", "attention", "efficient_attention")),
    ("add + RMSNorm (llmc)", ("add_rms_norm",)),
    ("RoPE + KV write (llmc)", ("rope_kv",)),
    ("SiLU x gate (llmc)", ("silu_mul",)),
    ("cuBLAS GEMM (16-bit linears, lm_head)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")),
    ("argmax / sampler", ("argmax", "reduce", "nan_to_num")),
)


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lower for k in keys)), "other")


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end)`` intervals given in microseconds, in ms: the time the GPU ran at
    least one kernel. Kernels launched with programmatic dependent launch overlap their predecessors (and count the
    time they wait in it), so the sum of kernel durations can exceed a step's wall time; the union cannot."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def profile_steps(runner: TorchModelRunner, step: SchedulerOutput, steps: int = 10) -> dict:
    """GPU kernel time per kind per step (ms), from torch.profiler over ``steps`` steps; ``gpu_busy_ms``: the time
    per step at least one kernel ran (overlapping kernels counted once)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.execute(step)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.execute(step)
    per_kind: dict[str, float] = {}
    top: dict[str, float] = {}
    from torch.autograd import DeviceType

    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", 0.0) or getattr(evt, "self_cuda_time_total", 0.0)
        # Kernels only: an operator's event (aten::mm) carries its kernels' time too (counted once, as kernels).
        if us <= 0 or evt.device_type != DeviceType.CUDA or evt.key.startswith("ProfilerStep"):
            continue
        per_kind[kind_of(evt.key)] = per_kind.get(kind_of(evt.key), 0.0) + us / steps / 1e3
        top[evt.key[:90]] = us / steps / 1e3
    kernels_ms = sum(per_kind.values())
    events = prof.events()
    spans = [(evt.time_range.start, evt.time_range.end, evt.name) for evt in events
             if evt.device_type == DeviceType.CUDA and not evt.name.startswith("ProfilerStep")]
    runtime: dict[str, float] = {}  # host time in CUDA runtime / driver calls (launches, syncs, allocations)
    for evt in events:
        if evt.device_type == DeviceType.CPU and evt.name.startswith("cu"):
            runtime[evt.name] = runtime.get(evt.name, 0.0) + (evt.time_range.end - evt.time_range.start) / steps / 1e3
    return {"kernel_ms_by_kind": {k: round(v, 4) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
            "kernel_ms_total": round(kernels_ms, 4), "gpu_busy_ms": round(busy_ms([s[:2] for s in spans]) / steps, 4),
            "largest_gaps": largest_gaps(spans),
            "idle_ms_by_kinds": {k: round(v / steps, 4) for k, v in idle_by_kinds(spans).items()},
            "added_ms_by_kind": {k: round(v / steps, 4) for k, v in added_by_kind(spans).items()},
            "runtime_calls_ms": {k: round(v, 4) for k, v in sorted(runtime.items(), key=lambda kv: -kv[1])[:8]},
            "top_kernels_ms": {k: round(v, 4) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:20]}}


def idle_stretches(spans: list[tuple[float, float, str]], within_us: float = 20_000.0):
    """``(idle_us, kernel_before, kernel_after)`` for each stretch in which no kernel ran, in time order; stretches
    of ``within_us`` or more are the pauses between profiled steps and are left out."""
    reach, last = float("-inf"), ""
    for start, end, name in sorted(spans):
        if reach < start < reach + within_us:
            yield start - reach, last, name
        if end > reach:
            reach, last = end, name


def added_by_kind(spans: list[tuple[float, float, str]], within_us: float = 100.0) -> dict[str, float]:
    """Time (ms, summed over the profile) each kind of kernel adds to the steps: a kernel's end minus the latest end
    before it (idle time before it included, overlap with its predecessor not; 0 where it ends inside another), in
    order of starts. Within a step's kernels these add up to their span, so a kind's figure is what it costs in
    place; a kernel starting ``within_us`` or more after the latest end (the host between steps: each step here
    ends with its tokens on the host) counts from its own start."""
    added: dict[str, float] = {}
    reach = float("-inf")
    for start, end, name in sorted(spans):
        base = reach if start < reach + within_us else start
        added[kind_of(name)] = added.get(kind_of(name), 0.0) + max(0.0, end - base) / 1e3
        reach = max(reach, end)
    return dict(sorted(added.items(), key=lambda kv: -kv[1]))


def idle_by_kinds(spans: list[tuple[float, float, str]], top: int = 10) -> dict[str, float]:
    """GPU idle time (ms, summed over the profile) by the kinds of the kernels around each idle stretch
    (``"cuBLAS GEMM -> int4 dequantize"``), largest first: which transitions the GPU waits at, a little each time."""
    idle: dict[str, float] = {}
    for us, before, after in idle_stretches(spans):
        key = f"{kind_of(before).split(' (')[0]} -> {kind_of(after).split(' (')[0]}"
        idle[key] = idle.get(key, 0.0) + us / 1e3
    return dict(sorted(idle.items(), key=lambda kv: -kv[1])[:top])


def largest_gaps(spans: list[tuple[float, float, str]], top: int = 6) -> list[dict]:
    """The longest stretches in which no kernel ran (:func:`idle_stretches`), with the kernels on either side:
    where the GPU waited for the host."""
    gaps = [{"us": round(us, 1), "after": before[:60], "before": after[:60]}
            for us, before, after in idle_stretches(spans)]
    return sorted(gaps, key=lambda g: -g["us"])[:top]


def step_row(runner: TorchModelRunner, step: SchedulerOutput, args: argparse.Namespace) -> dict:
    """A prefill or mixed step's row: its tokens, ms per step and (``--profile``) the kernel breakdown with the
    time not covered by kernels."""
    row = {"tokens": step.num_tokens, "ms": round(time_steps(runner, step, max(3, args.steps // 3)) * 1e3, 3)}
    if args.profile:
        row["profile"] = profile_steps(runner, step, steps=3)
        row["profile"]["not_kernels_ms"] = round(row["ms"] - row["profile"]["gpu_busy_ms"], 4)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="kernel time by kind for the graph-replayed steps")
    ap.add_argument("--modes", default="graphs,eager", help="graphs, eager or both (comma-separated)")
    ap.add_argument("--prefill", default="", help="prefill steps to time, e.g. 1x2048,4x2048 (prompts x tokens)")
    ap.add_argument("--mixed", default="", help="mixed steps to time, e.g. 64@2048+960@1024 (decodes@context + "
                                                "chunk@cached)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",") if b]
    prefills = [tuple(int(v) for v in item.lower().split("x")) for item in args.prefill.split(",") if item]
    mixed = [parse_mixed(item) for item in args.mixed.split(",") if item]
    from llmc.manifest import read_manifest

    block_size = read_manifest(Path(args.build)).recipe_obj().kv_cache.tokens_per_block
    blocks_needed = max([b * -(-(args.context + 1) // block_size) for b in batches]
                        + [n * -(-length // block_size) for n, length in prefills]
                        + [d * -(-(c + 1) // block_size) + -(-(n + p) // block_size) for d, c, n, p in mixed]) + 8
    result = {"context": args.context, "device": args.device, "steps": args.steps, "batches": {}}
    runners = {}
    modes = [m for m in ("graphs", "eager") if m in args.modes.split(",")]
    for mode, graphs in ((m, m == "graphs") for m in modes):
        start = time.perf_counter()
        runners[mode] = TorchModelRunner(args.build, device=args.device, num_blocks=blocks_needed, cuda_graphs=graphs)
        result[f"{mode}_load_s"] = round(time.perf_counter() - start, 2)
    for batch in batches:
        row = {}
        for mode, runner in runners.items():
            row[f"{mode}_ms"] = round(time_steps(runner, decode_step(batch, args.context, runner.block_size),
                                                 args.steps) * 1e3, 3)
        if len(runners) == 2:
            row["eager_over_graphs"] = round(row["eager_ms"] / row["graphs_ms"], 2)
        if args.profile and "graphs" in runners:
            row["graphs_profile"] = profile_steps(runners["graphs"], decode_step(batch, args.context,
                                                                                 runners["graphs"].block_size))
            row["graphs_profile"]["not_kernels_ms"] = round(row["graphs_ms"] - row["graphs_profile"]["gpu_busy_ms"], 4)
        result["batches"][batch] = row
        print(json.dumps({batch: row}), file=sys.stderr, flush=True)
    first = next(iter(runners.values()))
    if prefills:
        from llmc.bench.bounds import shape_of

        shape = shape_of(first.model.config)
        result["prefill"] = {}
        for prompts, length in prefills:
            row = step_row(first, prefill_step(prompts, length, first.block_size, first.vocab_size), args)
            flops = prefill_flops(shape, prompts, length)
            row["tflop"] = float(f"{flops / 1e12:.4g}")
            row["tflop_per_s"] = round(flops / (row["ms"] / 1e3) / 1e12, 1)
            result["prefill"][f"{prompts}x{length}"] = row
            print(json.dumps({f"prefill {prompts}x{length}": row}), file=sys.stderr, flush=True)
    if mixed:
        result["mixed"] = {}
        for d, c, n, p in mixed:
            row = step_row(first, mixed_step(d, c, n, p, first.block_size, first.vocab_size), args)
            result["mixed"][f"{d}@{c}+{n}@{p}"] = row
            print(json.dumps({f"mixed {d}@{c}+{n}@{p}": row}), file=sys.stderr, flush=True)
    result["graphs_used"] = "graphs" in runners and runners["graphs"].graphs is not None
    result["weight_bytes_on_device"] = first.weight_bytes
    result["weight_bytes_on_host"] = first.host_weight_bytes
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

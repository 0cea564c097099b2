#!/usr/bin/env python3
"""Time one model step's linears, int4 (llmc's CUDA kernels) against 16-bit cuBLAS, as the engines run them.

For each linear shape of the model (default: Llama-3.1-8B's qkv, o, fc + gate and down projection, group 128),
32 distinct random layers (one per decoder layer, so nothing is served from L2) are launched in one CUDA graph,
median of the replays, at every row count of ``--rows`` (decode steps: 1-64 rows; prefill: 2,048):

- **int4**: ``Int4CudaLinear`` with the shipped configs (the tensor-core kernel below its ``dense_from_m``,
  dequantize + cuBLAS above), programmatic dependent launch as the engine sets it (``LLMC_CUDA_PDL``). Its fc +
  gate layer returns ``silu(fc) * gate``: the activation is part of the layer.
- **bf16**: ``F.linear`` over 16-bit weights of the same shapes. The bf16 engine runs fc + gate as one GEMM and
  then llmc's SiLU x gate kernel (``int4_cuda.silu_mul``), so the like-for-like figure (``bf16``) includes that
  kernel on fc + gate; ``bf16_gemm_only`` leaves it out (the figure this script's predecessors reported).

    python scripts/bench_linears.py --rows 1,8,16,32,64,2048 --json out/linears.json

Prints the 32-layer sums per row count and the int4 / bf16 ratios; ``--json`` keeps every shape's timing.
``--step-order`` also times all 128 int4 linears in one graph in the order a decode step runs them (qkv, o, fc +
gate, down of layer 0, then of layer 1, ...): each kernel then follows one of another shape, as in the engine,
where the per-shape sums put each layer after a layer of its own shape. ``--timeline`` (with ``--step-order``) also
profiles one replay of that graph and prints, per shape, the mean time a kernel adds to the step (its end minus the
previous kernel's end, us a layer): what each linear costs in place, overlaps with its neighbours included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tune_int4_cuda import LLAMA8B, STEP  # noqa: E402

from llmc.engine.torch.int4_cuda import silu_mul  # noqa: E402
from llmc.engine.torch.int4_tune import LAYERS, mma_layers, step_chain, step_inputs, time_graph  # noqa: E402


def totals(per_shape: dict[str, dict[str, dict[int, float]]]) -> dict[int, dict[str, float]]:
    """``{rows: {"int4", "bf16", "bf16_gemm_only": 32-layer ms summed over the shapes, "int4_over_bf16", ...}}``
    from ``{shape: {kind: {rows: ms}}}``."""
    rows = sorted({m for kinds in per_shape.values() for times in kinds.values() for m in times})
    out: dict[int, dict[str, float]] = {}
    for m in rows:
        sums = {kind: round(sum(kinds[kind][m] for kinds in per_shape.values()), 3)
                for kind in ("int4", "bf16", "bf16_gemm_only")}
        sums["int4_over_bf16"] = round(sums["int4"] / sums["bf16"], 3)
        sums["int4_over_bf16_gemm_only"] = round(sums["int4"] / sums["bf16_gemm_only"], 3)
        out[m] = sums
    return out


def time_int4(spec: tuple, rows: list[int], replays: int) -> dict[int, float]:
    """ms of the shape's 32 int4 layers per row count."""
    layers, _ = mma_layers(spec)
    out = {}
    for m in rows:
        x = torch.randn(m, spec[2], device="cuda", dtype=torch.bfloat16)
        out[m] = time_graph(lambda: [layer(x) for layer in layers], replays) * 1e3
    return out


def added_us(ends_us: list[float], names: tuple[str, ...] = STEP) -> dict[str, float]:
    """Per name, the mean time each kernel adds to a chain (its end minus the previous kernel's end, us) from the
    chain's kernel end times in launch order, names repeating in ``names``' order (the first kernel is left out)."""
    added: dict[str, list[float]] = {name: [] for name in names}
    for i in range(1, len(ends_us)):
        added[names[i % len(names)]].append(ends_us[i] - ends_us[i - 1])
    return {name: round(sum(v) / len(v), 2) for name, v in added.items() if v}


def profile_ends(fn, count: int) -> list[float] | None:
    """End times (us) of the ``count`` int4 kernels of one replay of a CUDA graph of ``fn``, in launch order; None
    where the replay ran another number of them (rows at which the layers dequantize for cuBLAS)."""
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "w4a16_mma_dequant" not in e.name and "w4a16" in e.name), key=lambda e: e.time_range.start)
    return [e.time_range.end for e in kernels] if len(kernels) == count else None


def time_step_order(rows: list[int], replays: int, timeline: bool = False) -> tuple[dict[int, float], dict]:
    """ms of the 128 int4 linears in decode-step order (one graph) per row count, and with ``timeline`` what each
    shape's kernel adds to that step per row count (:func:`added_us`; absent where the layers dequantize)."""
    chain = [layer for _, layer in step_chain(LLAMA8B)]
    inputs = {m: step_inputs(LLAMA8B, m) for m in rows}
    times, added = {}, {}
    for m in rows:
        def step():
            return [layer(inputs[m][layer.in_features]) for layer in chain]

        times[m] = time_graph(step, replays) * 1e3
        ends = profile_ends(step, len(chain)) if timeline else None
        if ends is not None:
            added[m] = added_us(ends)
    return times, added


def time_bf16(spec: tuple, rows: list[int], replays: int) -> dict[str, dict[int, float]]:
    """``{"bf16", "bf16_gemm_only": {rows: ms}}`` of the shape's 32 16-bit layers (fc + gate: with SiLU x gate)."""
    _, n, k, _, silu, _ = spec
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    out: dict[str, dict[int, float]] = {"bf16": {}, "bf16_gemm_only": {}}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        gemm = time_graph(lambda: [torch.nn.functional.linear(x, w) for w in dense], replays) * 1e3
        out["bf16_gemm_only"][m] = gemm
        out["bf16"][m] = (time_graph(lambda: [silu_mul(torch.nn.functional.linear(x, w)) for w in dense], replays)
                          * 1e3 if silu else gemm)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16,32,64,2048", help="row counts (M) to time, comma-separated")
    ap.add_argument("--replays", type=int, default=20, help="graph replays per timing (median)")
    ap.add_argument("--json", type=Path, help="write every shape's timing here")
    ap.add_argument("--step-order", action="store_true", help="also time the int4 linears in decode-step order")
    ap.add_argument("--timeline", action="store_true",
                    help="with --step-order: what each shape's kernel adds to the step, from a profiled replay")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_linears.py times CUDA kernels: run it on a machine with an NVIDIA GPU")
    if args.timeline and not args.step_order:
        raise SystemExit("--timeline profiles the step-order graph: add --step-order")
    rows = [int(v) for v in args.rows.split(",") if v]
    per_shape: dict[str, dict[str, dict[int, float]]] = {}
    for spec in LLAMA8B:
        times = {"int4": time_int4(spec, rows, args.replays), **time_bf16(spec, rows, args.replays)}
        torch.cuda.empty_cache()
        per_shape[spec[0]] = times
        print(spec[0], {kind: {m: round(t, 3) for m, t in by_m.items()} for kind, by_m in times.items()}, flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "layers_per_shape": LAYERS,
              "totals_ms": totals(per_shape), "per_shape_ms": per_shape}
    for m, row in result["totals_ms"].items():
        print(f"M={m:5d}: int4 {row['int4']:8.3f} ms  bf16 {row['bf16']:8.3f} ms (GEMM only "
              f"{row['bf16_gemm_only']:8.3f})  int4/bf16 {row['int4_over_bf16']:.3f} "
              f"({row['int4_over_bf16_gemm_only']:.3f})", flush=True)
    if args.step_order:
        result["int4_step_order_ms"], added = time_step_order(rows, args.replays, args.timeline)
        torch.cuda.empty_cache()
        for m, ms in result["int4_step_order_ms"].items():
            print(f"M={m:5d}: int4 in step order {ms:8.3f} ms", flush=True)
            if m in added:
                print(f"         each kernel adds, us a layer: {added[m]}", flush=True)
        if args.timeline:
            result["int4_step_order_added_us"] = added
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

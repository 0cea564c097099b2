#!/usr/bin/env python3
"""Check and tune llmc's W4A16 CUDA kernels on this GPU; write the shipped config table and a timing report.

``--kernels mma`` (default): llmc's CUDA tensor-core kernels (``csrc_cuda/w4a16_mma.cu``): every (row tiles,
column tiles, warps, stages) config of ``int4_configs.mma_configs`` per row bucket (1, 8, 16, 32, 64, 128;
the warpgroup kernel's configs only on sm_90),
checked and timed as below, and ``dense_from_m`` against dequantize + cuBLAS; stored under the shape's ``"mma"``
key as ``[m_max, row tiles, column tiles, warps, stages]`` (table version 2). ``--kernels triton``: the Triton
fallback, as follows.

For each linear shape of a model (default: Llama-3.1-8B's qkv, o, fc + gate, down projection at group 128, and
SmolLM2-135M's at group 64 for correctness) and each row bucket (1, 2-16, 17-32, 33-64, 65-128, 129-256):

1. every candidate config is compiled (in parallel worker processes that fill Triton's cache) and checked against
   a float32 product over the dequantized weight (fresh random inputs; relative error bound per dtype);
2. timed as 32 launches over 32 distinct weight copies (one per layer, as in a decode step, so nothing is served
   from the 60 MB L2) captured in one CUDA graph, median of 20 replays;
3. the fastest config is kept; from the larger row counts on, dequantize + cuBLAS is timed too and
   ``dense_from_m`` is the smallest measured row count where it wins.

Shape by shape, each kernel follows one of its own shape; ``tune_step_order.py`` then chooses the decode buckets
again from this report's timings, by the linears of a whole step in step order (the shipped 1-16-row buckets went
through it on the H200).

The same launches with the 16-bit weight through cuBLAS (``F.linear``) are the baseline. Writes
``--configs`` (merged into an existing table, the file ``llmc/engine/torch/int4_cuda_configs.json`` ships) and
``--report`` (every timing). Prints the decode-step table: the 32-layer sum over the four shapes per row count.

    python scripts/tune_int4_cuda.py --configs llmc/engine/torch/int4_cuda_configs.json --report out/tune.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4  # noqa: E402
from llmc.engine.torch.int4_configs import (TABLE_VERSION, KernelConfig, is_wgmma, mma_configs,  # noqa: E402
                                            shape_key, upgrade_table)
from llmc.engine.torch import cuda_ext  # noqa: E402
from llmc.engine.torch.int4_cuda import Scratch, Int4CudaLinear  # noqa: E402
from scripts.tune_int4_triton import (BUCKETS, DENSE_MS, LAYERS, candidates, precompile,  # noqa: E402
                                      triton_layers)

# (name, N columns, K, group, silu_output, prequant in kernel): how the loader builds each layer (qkv and fc + gate
# have their prequant folded into the norms; o and down apply it in the input load; fc + gate, with interleaved
# columns, returns silu(fc) * gate).
LLAMA8B = [("qkv", 6144, 4096, 128, False, False), ("o", 4096, 4096, 128, False, True),
           ("fc_gate", 28672, 4096, 128, True, False), ("down", 4096, 14336, 128, False, True)]
SMOLLM2 = [("qkv", 960, 576, 64, False, False), ("o", 576, 576, 64, False, True),
           ("fc_gate", 3072, 576, 64, True, False), ("down", 576, 1536, 64, False, True)]
SM90 = cuda_ext.warpgroup_kernels()  # the warpgroup kernel's GPUs


def time_graph(fn, replays: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph that runs ``fn`` once (fn itself launches 32 layers)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def fastest(configs, error_of, seconds_of, label=str) -> tuple:
    """``(best config, its seconds, {label: microseconds or why not})``: the fastest config whose relative error is
    below 1e-2; one that fails to compile or launch, or is wrong, is reported and skipped."""
    best, best_t, tried = None, float("inf"), {}
    for config in configs:
        try:
            err = error_of(config)
        except Exception as exc:  # noqa: BLE001 - reported in the table, the config is skipped
            tried[label(config)] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        if not err < 1e-2:
            tried[label(config)] = f"wrong: rel err {err:.3g}"
            continue
        t = seconds_of(config)
        tried[label(config)] = round(t * 1e6, 1)
        if t < best_t:
            best, best_t = config, t
    return best, best_t, tried


def rel_error(layer, weight, silu_ref, run, m) -> float:
    """Relative error of ``run(x)`` vs a float32 product over the dequantized ``weight`` [N, K] (fresh inputs);
    ``silu_ref`` (fc + gate layers) turns that product into silu(fc) * gate in the family's column order."""
    x = torch.randn(m, layer.in_features, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ weight.T
    if silu_ref is not None:
        ref = silu_ref(ref)
    return ((run(x).float() - ref).norm() / ref.norm()).item()


@dataclass(frozen=True)
class Family:
    """How one kernel family is tuned: its row buckets and configs, its kernel call, its report keys."""

    title: str  # in the printed lines
    prefix: str  # report keys: f"{prefix}{m}" per bucket, f"{prefix}dense_{m}" for the dense comparison
    buckets: list  # (bucket's largest M, M tuned at)
    dense_ms: tuple  # row counts at which dequantize + cuBLAS may take over (dense_from_m)
    report_ms: tuple  # every row count of the dense comparison
    candidates: Callable  # (m, quick) -> configs
    run: Callable  # (layer, x, config) -> y
    to_list: Callable  # config -> the table's list
    from_list: Callable  # the table's list -> config
    silu_ref: Callable  # float32 product -> silu(fc) * gate


MMA_BUCKETS = [(1, 1), (8, 8), (16, 16), (32, 32), (64, 64), (128, 128)]
MMA_DENSE_MS = (32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512)

TRITON = Family("int4", "", BUCKETS, DENSE_MS, DENSE_MS, candidates,
                lambda layer, x, cfg: layer.matmul(x, cfg), lambda cfg: cfg.to_list(),
                lambda values: KernelConfig(*values),
                lambda ref: torch.nn.functional.silu(ref[:, 0::2]) * ref[:, 1::2])  # fc, gate interleaved
MMA = Family("mma int4", "mma_", MMA_BUCKETS, MMA_DENSE_MS, MMA_DENSE_MS + (2048,),
             lambda m, quick: [c for c in mma_configs() if SM90 or not is_wgmma(c)],
             lambda layer, x, cfg: layer.mma(x, *cfg), list, tuple,
             lambda ref: torch.nn.functional.silu(ref[:, : ref.shape[1] // 2]) * ref[:, ref.shape[1] // 2:])


def make_mma_layer(n: int, k: int, group: int, silu: bool, prequant: bool, seed: int, scratch: Scratch,
                   dtype: torch.dtype = torch.bfloat16):
    """A random int4 layer of the CUDA mma kernels and its float32 reference weight ``[N, K]`` (fc + gate: the
    first N/2 rows are fc, the rest gate)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8, device="cuda")
    scales = (torch.rand(n, k // group, generator=gen, device="cuda") * 0.01 + 0.002).to(dtype)
    pq = (torch.rand(k, generator=gen, device="cuda") + 0.5).to(dtype) if prequant else None
    packed = pack_int4(q)
    parts = [(packed[: n // 4], scales[: n // 2]), (packed[n // 4:], scales[n // 2:])] if silu else [(packed, scales)]
    layer = Int4CudaLinear.from_ir(parts, pq, group, scratch, silu_output=silu, backend="mma")
    return layer, (packed, scales, pq)


def mma_layers(spec) -> tuple[list, torch.Tensor]:
    """32 random layers of the CUDA mma kernels (their split-K buffers sized for any config at any row count tried)
    and the float32 reference weight ``[N, K]`` of the first."""
    _, n, k, group, silu, prequant = spec
    scratch = Scratch(torch.bfloat16, torch.device("cuda"))
    made = [make_mma_layer(n, k, group, silu, prequant, seed, scratch) for seed in range(LAYERS)]
    scratch.reserve_splits(((c, max(MMA_DENSE_MS + (2048,))) for c in mma_configs()), n)
    scratch.allocate()
    packed, scales, pq = made[0][1]
    return [lay for lay, _ in made], dequantize_w4a16(packed, scales, pq if pq is not None else
                                                      torch.ones(k, device="cuda"), group)


STEP = ("qkv", "o", "fc_gate", "down")  # a layer's linears in the order a decode step runs them


def step_chain() -> list[tuple[str, Int4CudaLinear]]:
    """The 8B shape's 128 int4 linears of a decode step (32 random layers a shape, :func:`mma_layers`) in the order
    the step runs them, each with its shape's name."""
    made = {spec[0]: mma_layers(spec)[0] for spec in LLAMA8B}
    return [(name, made[name][i]) for i in range(LAYERS) for name in STEP]


def step_inputs(m: int) -> dict[int, torch.Tensor]:
    """Random ``[m, K]`` activations for each input width K of the 8B shapes."""
    return {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in {spec[2] for spec in LLAMA8B}}


def tune_family(spec, family: Family, layers: list, weight: torch.Tensor, report: dict, quick: bool = False,
                old: dict | None = None, dense_only: bool = False) -> dict:
    """One shape's table entry ``{"buckets": [[m_max, *config]], "dense_from_m": m}``: the fastest correct config
    per row bucket, and the smallest row count of ``family.dense_ms`` from which dequantize + cuBLAS (checked
    too) beats the largest bucket's config. Every timing goes into ``report``. With ``old`` (the shape's entry
    in the table), only the buckets that hold ``family.buckets``' row counts are tuned: the others and
    ``dense_from_m`` stay as they were; with ``dense_only`` too, no bucket is tuned and only ``dense_from_m`` is
    chosen again, against ``old``'s buckets."""
    name, n, k, group, silu, _ = spec
    silu_ref = family.silu_ref if silu else None
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    entry = {"buckets": [], "dense_from_m": None}
    rows_report = report.setdefault(shape_key(n, k, group), {"name": name})
    if dense_only:
        entry["buckets"] = [list(bucket) for bucket in old["buckets"]]
    for m_max, m in [] if dense_only else family.buckets:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cublas = time_graph(lambda: [torch.nn.functional.linear(x, w) for w in dense])
        configs = list(family.candidates(m, quick))
        current = next((b[1:] for b in (old or {}).get("buckets", []) if b[0] == m_max), None)
        if current is not None and family.from_list(current) not in configs:  # a narrowed list: the table's competes
            configs.append(family.from_list(current))
        best, best_t, tried = fastest(
            configs,
            lambda cfg: rel_error(layers[0], weight, silu_ref, lambda inp: family.run(layers[0], inp, cfg), m),
            lambda cfg: time_graph(lambda: [family.run(layer, x, cfg) for layer in layers]),
            lambda cfg: str(family.to_list(cfg)))
        if best is None:
            raise SystemExit(f"{name} M={m}: no {family.title} config is correct: {tried}")
        entry["buckets"].append([m_max, *family.to_list(best)])
        rows_report[f"{family.prefix}{m}"] = {"best": family.to_list(best), "us_32_layers": round(best_t * 1e6, 1),
                                              "cublas_bf16_us_32_layers": round(cublas * 1e6, 1), "tried_us": tried}
        print(f"{name:8s} M={m:4d}: {family.title} {best_t * 1e3:7.3f} ms  bf16 cuBLAS {cublas * 1e3:7.3f} ms  "
              f"({cublas / best_t:.2f}x)  best {family.to_list(best)}", flush=True)
    if old is not None and not dense_only:
        return merge_buckets(old, entry["buckets"])
    for m in family.report_ms:  # each row count against the config the layer would run there (its bucket's)
        kernel_cfg = family.from_list(next((b for b in entry["buckets"] if m <= b[0]), entry["buckets"][-1])[1:])
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        err = rel_error(layers[0], weight, silu_ref, layers[0]._dense, m)
        if not err < 1e-2:
            raise SystemExit(f"{name} M={m}: dequantize + cuBLAS is wrong: rel err {err:.3g}")
        dense_t = time_graph(lambda: [layer._dense(x) for layer in layers])
        kernel_t = time_graph(lambda: [family.run(layer, x, kernel_cfg) for layer in layers])
        cublas = time_graph(lambda: [torch.nn.functional.linear(x, w) for w in dense])
        rows_report[f"{family.prefix}dense_{m}"] = {"dequant_cublas_us": round(dense_t * 1e6, 1),
                                                    "kernel_us": round(kernel_t * 1e6, 1),
                                                    "cublas_bf16_us": round(cublas * 1e6, 1)}
        print(f"{name:8s} M={m:4d}: dequant+cuBLAS {dense_t * 1e3:7.3f} ms  {family.title} {kernel_t * 1e3:7.3f} ms  "
              f"bf16 {cublas * 1e3:7.3f} ms", flush=True)
        if entry["dense_from_m"] is None and m in family.dense_ms and dense_t <= kernel_t:
            entry["dense_from_m"] = m
    entry["dense_from_m"] = entry["dense_from_m"] or family.dense_ms[-1]
    return entry


def merge_buckets(old: dict, tuned: list[list[int]]) -> dict:
    """``old`` (a shape's table entry) with the re-tuned buckets ``[[m_max, *config]]`` in place of those with the
    same ``m_max``; its other buckets and ``dense_from_m`` stay."""
    by_max = {bucket[0]: bucket for bucket in tuned}
    unknown = set(by_max) - {bucket[0] for bucket in old["buckets"]}
    if unknown:
        raise ValueError(f"buckets {sorted(unknown)} are not in the table's entry {old['buckets']}")
    return {**old, "buckets": [by_max.get(bucket[0], bucket) for bucket in old["buckets"]]}


def step_table(report: dict, shapes, family: Family) -> list[dict]:
    """Per row count: the 32-layer sum over the shapes, int4 (the faster path at dense row counts) vs bf16."""
    keys = [shape_key(n, k, g) for _, n, k, g, _, _ in shapes]
    rows = []
    for _, m in family.buckets:
        if any(f"{family.prefix}{m}" not in report[key] for key in keys):  # not tuned (--only-dense)
            continue
        int4 = sum(report[key][f"{family.prefix}{m}"]["us_32_layers"] for key in keys)
        bf16 = sum(report[key][f"{family.prefix}{m}"]["cublas_bf16_us_32_layers"] for key in keys)
        rows.append({"M": m, "int4_ms": round(int4 / 1e3, 3), "bf16_ms": round(bf16 / 1e3, 3),
                     "bf16_over_int4": round(bf16 / int4, 2)})
    for m in family.report_ms:
        if any(f"{family.prefix}dense_{m}" not in report[key] for key in keys):  # not compared (--only-rows)
            continue
        cells = [report[key][f"{family.prefix}dense_{m}"] for key in keys]
        best = sum(min(c["dequant_cublas_us"], c["kernel_us"]) for c in cells)
        bf16 = sum(c["cublas_bf16_us"] for c in cells)
        rows.append({"M": m, "int4_ms": round(best / 1e3, 3), "bf16_ms": round(bf16 / 1e3, 3),
                     "bf16_over_int4": round(bf16 / best, 2)})
    return rows


def ir_shapes(ir_dir: Path) -> list:
    """The int4 layer shapes of a W4A16 build's IR checkpoint, or of the IR folder given
    (``int4_install.int4_layer_shapes``)."""
    from llmc.checkpoint.io import read_config
    from llmc.checkpoint.safetensors_header import tensor_headers
    from llmc.engine.torch.int4_install import int4_layer_shapes
    from llmc.errors import LlmcError

    if (ir_dir / "checkpoint" / "config.json").is_file():  # an llmc build: its IR
        ir_dir = ir_dir / "checkpoint"
    try:
        group = (read_config(ir_dir).get("quantization") or {}).get("group_size")
        shapes = int4_layer_shapes(tensor_headers(ir_dir), int(group)) if group else []
    except LlmcError as exc:
        raise SystemExit(f"--shapes-of {ir_dir}: {exc}") from exc
    if not shapes:
        raise SystemExit(f"--shapes-of {ir_dir}: no W4A16 layer of whole 16 x 64 tiles (give an AWQ build, or its "
                         "W4A16_AWQ IR folder of config.json and rank*.safetensors)")
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=Path, required=True, help="config table to merge the results into")
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--model", choices=["llama3.1-8b", "smollm2", "both"], default="both")
    ap.add_argument("--shapes-of", type=Path, metavar="BUILD_OR_IR",
                    help="tune the int4 layer shapes of this W4A16 build (or its IR checkpoint folder: config.json "
                         "+ rank*.safetensors) instead of --model's; with LLMC_INT4_CONFIGS=<--configs> the engine "
                         "runs them")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--kernels", choices=["triton", "mma"], default="mma",
                    help="which kernel family to tune (mma: llmc's CUDA library; triton: the fallback)")
    ap.add_argument("--only-rows", default="",
                    help="mma only: re-tune just the buckets tuned at these row counts (e.g. 1,8,16) of shapes "
                         "already in the table, keeping their other buckets and dense_from_m")
    ap.add_argument("--only-wgmma", action="store_true",
                    help="mma with --only-rows: try only the warpgroup kernel's configs (split-K included) against "
                         "each bucket's config in the table")
    ap.add_argument("--only-dense", action="store_true",
                    help="mma: keep every tuned bucket of the shapes in the table, choose only dense_from_m again "
                         "(each row count against the config the layer runs there)")
    ap.add_argument("--only-shapes", default="",
                    help="tune just these shapes of the model (names: qkv, o, fc_gate, down)")
    args = ap.parse_args()
    only = {int(v) for v in args.only_rows.split(",") if v}
    if only and args.kernels != "mma":
        raise SystemExit("--only-rows re-tunes mma buckets: use it with --kernels mma")
    if args.only_dense and (only or args.kernels != "mma"):
        raise SystemExit("--only-dense re-chooses the mma dense_from_m alone: not with --only-rows or --kernels triton")
    if args.only_wgmma and not (only and SM90):
        raise SystemExit("--only-wgmma narrows an --only-rows re-tune on an sm_90 GPU (the warpgroup kernel's)")
    device_name = torch.cuda.get_device_name()
    shapes = ir_shapes(args.shapes_of) if args.shapes_of else {"llama3.1-8b": LLAMA8B, "smollm2": SMOLLM2,
                                                                 "both": LLAMA8B + SMOLLM2}[args.model]
    names = {v for v in args.only_shapes.split(",") if v}
    if names - {spec[0] for spec in shapes}:
        raise SystemExit(f"--only-shapes {sorted(names - {spec[0] for spec in shapes})}: the shapes are "
                         f"{sorted({spec[0] for spec in shapes})}")
    shapes = [spec for spec in shapes if not names or spec[0] in names]
    report = {"device": device_name, "torch": torch.__version__, "shapes": {}, "kernels": args.kernels}
    table = json.loads(args.configs.read_text()) if args.configs.exists() else {"version": TABLE_VERSION,
                                                                                "devices": {}}
    tuned = table["devices"].setdefault(device_name, {})
    gpu = torch.cuda.get_device_properties()  # what int4_configs.config_devices matches an untuned GPU by
    table.setdefault("gpus", {})[device_name] = {"capability": f"{gpu.major}.{gpu.minor}",
                                                 "multiprocessors": gpu.multi_processor_count}
    if args.kernels == "mma":  # stored under each shape's "mma" key, next to the Triton fallback's entry
        upgrade_table(table)  # an older kernel's mma configs: none of them exists any more
        family, title = MMA, "decode-step linears (mma), 32 layers"
        if only:
            unknown = only - {m for _, m in MMA_BUCKETS}
            if unknown:
                raise SystemExit(f"--only-rows {sorted(unknown)}: the mma buckets are tuned at "
                                 f"{[m for _, m in MMA_BUCKETS]}")
            family = dataclasses.replace(MMA, buckets=[b for b in MMA_BUCKETS if b[1] in only])
            if args.only_wgmma:
                family = dataclasses.replace(family, candidates=lambda m, quick: [c for c in mma_configs()
                                                                                  if is_wgmma(c)])
        missing = [shape_key(n, k, g) for _, n, k, g, _, _ in shapes
                   if "mma" not in tuned.get(shape_key(n, k, g), {})]
        if (only or args.only_dense) and missing:  # checked before any tuning: nothing is spent in vain
            raise SystemExit(f"--only-rows / --only-dense: {', '.join(missing)} have no mma entry in {args.configs} "
                             f"yet; tune them whole first")
        for spec in shapes:
            entry = tuned.setdefault(shape_key(spec[1], spec[2], spec[3]), {})
            entry["mma"] = tune_family(spec, family, *mma_layers(spec), report["shapes"],
                                       old=entry["mma"] if only or args.only_dense else None,
                                       dense_only=args.only_dense)
            torch.cuda.empty_cache()  # the shape's 32 weight copies are garbage now
    else:
        family, title = TRITON, "decode-step linears, 32 layers (SmolLM2 has 30: x30/32 for its own step)"
        quick = {shape_key(n, k, g) for _, n, k, g, _, _ in SMOLLM2}  # checked on a few configs, not tuned hard
        report["compile_failures"] = precompile(shapes, args.workers, quick)
        for spec in shapes:
            key = shape_key(spec[1], spec[2], spec[3])
            tuned.setdefault(key, {}).update(  # keeps the shape's "mma" entry
                tune_family(spec, TRITON, *triton_layers(spec, key in quick), report["shapes"], key in quick))
            torch.cuda.empty_cache()
    args.configs.write_text(json.dumps(table, indent=1) + "\n")
    for label, model_shapes in (("llama3.1-8b", LLAMA8B), ("smollm2", SMOLLM2)):
        if all(shape_key(n, k, g) in report["shapes"] for _, n, k, g, _, _ in model_shapes):
            report[f"step_{label}"] = step_table(report["shapes"], model_shapes, family)
            print(f"\n{label}: {title}")
            for row in report[f"step_{label}"]:
                print(f"  M={row['M']:5d}  int4 {row['int4_ms']:8.3f} ms  bf16 cuBLAS {row['bf16_ms']:8.3f} ms  "
                      f"({row['bf16_over_int4']:.2f}x)")
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

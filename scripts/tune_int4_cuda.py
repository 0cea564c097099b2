#!/usr/bin/env python3
"""Check and tune llmc's W4A16 CUDA kernels on this GPU; write the shipped config table and a timing report (users
tune their builds' shapes with ``llmc tune``, which shares this script's code: ``llmc/engine/torch/int4_tune.py``).

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
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.engine.torch.int4_configs import (TABLE_VERSION, is_wgmma, mma_configs,  # noqa: E402
                                            shape_key, upgrade_table)
from llmc.engine.torch import cuda_ext  # noqa: E402
from llmc.engine.torch.int4_tune import (MMA, MMA_BUCKETS, Family, build_shapes, mma_layers,  # noqa: E402
                                         tune_family)
from llmc.errors import LlmcError  # noqa: E402
from llmc.engine.torch.int4_tune_triton import TRITON, precompile, triton_layers  # noqa: E402

# (name, N columns, K, group, silu_output, prequant in kernel): how the loader builds each layer (qkv and fc + gate
# have their prequant folded into the norms; o and down apply it in the input load; fc + gate, with interleaved
# columns, returns silu(fc) * gate).
LLAMA8B = [("qkv", 6144, 4096, 128, False, False), ("o", 4096, 4096, 128, False, True),
           ("fc_gate", 28672, 4096, 128, True, False), ("down", 4096, 14336, 128, False, True)]
SMOLLM2 = [("qkv", 960, 576, 64, False, False), ("o", 576, 576, 64, False, True),
           ("fc_gate", 3072, 576, 64, True, False), ("down", 576, 1536, 64, False, True)]
SM90 = cuda_ext.warpgroup_kernels()  # the warpgroup kernel's GPUs

STEP = ("qkv", "o", "fc_gate", "down")  # a layer's linears in the order a decode step runs them


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


def ir_shapes(path: Path) -> list:
    """``--shapes-of``: the int4 layer shapes of a W4A16 build or IR folder (``int4_tune.build_shapes``)."""
    try:
        return build_shapes(path)
    except LlmcError as exc:
        raise SystemExit(f"--shapes-of {exc}") from exc


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
        report["compile_failures"] = precompile(shapes, args.workers, quick=frozenset(quick))
        for spec in shapes:
            key = shape_key(spec[1], spec[2], spec[3])
            tuned.setdefault(key, {}).update(  # keeps the shape's "mma" entry
                tune_family(spec, TRITON, *triton_layers(spec, quick=key in quick), report["shapes"], key in quick))
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

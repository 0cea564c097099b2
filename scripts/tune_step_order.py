#!/usr/bin/env python3
"""Choose the decode buckets' int4 configs by a whole step's linears in step order, not shape by shape.

``tune_int4_cuda.py`` times each shape's configs on 32 layers of that shape, so every kernel follows a kernel of its
own shape. In a decode step each follows one of another shape (qkv, o, fc + gate, down, then the next layer's qkv),
and how far a kernel overlaps its neighbour depends on both: on the H200 tables that won shape by shape lost in
step order (docs/GPU_INT4_LOG.md, 2026-12-04 14:44 and 14:50). This script takes a tuner report (``--report``: its
``tried_us`` per shape and row count), keeps the ``--top`` fastest correct configs of each shape plus the table's
own, and for each row count of ``--rows`` runs a coordinate descent over the shapes: every candidate of one shape
with the others fixed, timed as the 128 int4 linears of a step in one CUDA graph (``bench_linears.py
--step-order``'s measure); a change is kept only when it beats the incumbent, timed again in the same round, by
``--min-gain``. The chosen configs go into ``--configs``' buckets of those row counts; ``--out`` keeps every timing.

    python scripts/tune_int4_cuda.py --model llama3.1-8b --only-rows 1,8,16 --configs /tmp/t.json --report r.json
    python scripts/tune_step_order.py --report r.json --configs llmc/engine/torch/int4_cuda_configs.json \\
        --rows 1,8,16 --out step_order.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.engine.torch.int4_tune import descend, top_candidates  # noqa: E402

def bucket_configs(table: dict, device: str, keys: dict[str, str], m_max: int) -> dict[str, tuple]:
    """Each shape's mma config of the bucket ending at ``m_max`` in the tuned table (``keys``: shape -> table key)."""
    entries = table["devices"][device]
    return {name: tuple(next(b[1:] for b in entries[key]["mma"]["buckets"] if b[0] == m_max))
            for name, key in keys.items()}


def set_bucket(table: dict, device: str, keys: dict[str, str], m_max: int, configs: dict[str, tuple]) -> None:
    """Write ``configs`` (shape -> config) into the bucket ending at ``m_max`` of each shape's mma entry."""
    for name, key in keys.items():
        buckets = table["devices"][device][key]["mma"]["buckets"]
        index = next(i for i, b in enumerate(buckets) if b[0] == m_max)
        buckets[index] = [m_max, *configs[name]]


def missing_inputs(report: dict, table: dict, device: str, keys: dict[str, str], rows: list[int],
                   buckets: list[tuple[int, int]]) -> list[str]:
    """What the report (timings per shape and row count) or the table (each shape's mma bucket of those rows on
    ``device``) lacks for ``rows``; ``buckets``: the mma buckets as ``(m_max, tuned at)``."""
    tuned_at = {m for _, m in buckets}
    missing = [f"row count {m} is not a tuned mma bucket ({sorted(tuned_at)})" for m in rows if m not in tuned_at]
    for m in (m for m in rows if m in tuned_at):
        m_max = next(b for b, at in buckets if at == m)
        for name, key in keys.items():
            if "tried_us" not in report.get("shapes", {}).get(key, {}).get(f"mma_{m}", {}):
                missing.append(f"the report has no timings of {name} ({key}) at {m} rows")
            entry = table.get("devices", {}).get(device, {}).get(key, {}).get("mma", {})
            if not any(b[0] == m_max for b in entry.get("buckets", [])):
                missing.append(f"the table has no {device} mma bucket of {name} ({key}) up to {m_max} rows")
    return missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", type=Path, required=True, help="a tune_int4_cuda.py report of these row counts")
    ap.add_argument("--configs", type=Path, required=True, help="the config table to start from and write")
    ap.add_argument("--rows", default="1,8,16", help="the mma buckets' tuned row counts to choose again")
    ap.add_argument("--top", type=int, default=4, help="candidates per shape: the report's fastest")
    ap.add_argument("--min-gain", type=float, default=0.003, help="relative gain a change must bring")
    ap.add_argument("--out", type=Path, help="write every timing here")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("tune_step_order.py times CUDA kernels: run it on a machine with an NVIDIA GPU")
    from llmc.engine.torch.int4_configs import shape_key
    from llmc.engine.torch.int4_tune import MMA, MMA_BUCKETS, step_chain, step_inputs, time_graph

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tune_int4_cuda import LLAMA8B, STEP

    device = torch.cuda.get_device_name()
    report = json.loads(args.report.read_text())
    table = json.loads(args.configs.read_text())
    keys = {spec[0]: shape_key(spec[1], spec[2], spec[3]) for spec in LLAMA8B}
    rows = [int(v) for v in args.rows.split(",") if v]
    missing = missing_inputs(report, table, device, keys, rows, MMA_BUCKETS)
    if missing:  # checked before any layer is made
        raise SystemExit("; ".join(missing) + f": run tune_int4_cuda.py --only-rows {args.rows} on this GPU first "
                         f"(its --report is this script's --report)")
    chain = step_chain(LLAMA8B)
    result = {"device": device, "rows": {}}
    for m in rows:
        m_max = next(b for b, tuned_at in MMA_BUCKETS if tuned_at == m)
        start = bucket_configs(table, device, keys, m_max)
        candidates = {name: top_candidates(report["shapes"][keys[name]][f"mma_{m}"]["tried_us"], list(start[name]),
                                           args.top) for name in STEP}
        xs = step_inputs(LLAMA8B, m)

        def seconds_of(configs: dict[str, tuple]) -> float:
            return time_graph(lambda: [MMA.run(layer, xs[layer.in_features], configs[name]) for name, layer in chain])

        before = seconds_of(start)
        chosen, log = descend(start, candidates, seconds_of, min_gain=args.min_gain)
        after = seconds_of(chosen)
        set_bucket(table, device, keys, m_max, chosen)
        result["rows"][m] = {"before_ms": round(before * 1e3, 3), "after_ms": round(after * 1e3, 3),
                             "start": {k: list(v) for k, v in start.items()},
                             "chosen": {k: list(v) for k, v in chosen.items()}, "rounds": log}
        print(f"M={m:3d}: step order {before * 1e3:.3f} -> {after * 1e3:.3f} ms  "
              f"{ {k: list(v) for k, v in chosen.items()} }", flush=True)
    args.configs.write_text(json.dumps(table, indent=1) + "\n")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Ratios of two ``llmc bench --json`` reports of the same run (e.g. an int4 build over its 16-bit twin).

    python scripts/bench_compare.py BENCH_A.json BENCH_B.json

Prints one JSON object: per concurrency level, A / B for TGS and the TTFT / ITL / end-to-end p50 (TGS > 1 and
latencies < 1 favour A), ITL p95 / p50 of each (how even the steps are while prompts arrive), each report's weight
bytes on the device, and whether the two ran the same workload (prompt lengths, seed, sampling) with no
prefix-cache hits. Exit status 1 when the workloads differ or either report had cache hits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.bench.report import ratios  # noqa: E402


def _itl_spread(level: dict) -> float | None:
    itl = level["itl_s"]
    return itl["p95"] / itl["p50"] if itl.get("p95") and itl.get("p50") else None


def compare(a: dict, b: dict) -> dict:
    same_workload = (a["workload"] == b["workload"] and a["sampling"] == b["sampling"]
                     and a["prompt_lengths"] == b["prompt_lengths"])
    hits = {name: sum((lv.get("prefix_cache") or {}).get("hit_tokens") or 0 for lv in r["levels"])
            for name, r in (("a", a), ("b", b))}
    rows = ratios(a["levels"], b["levels"])
    spreads = {lv["concurrency"]: _itl_spread(lv) for lv in a["levels"]}
    spreads_b = {lv["concurrency"]: _itl_spread(lv) for lv in b["levels"]}
    for row in rows:
        row["itl_p95_over_p50"] = {"a": spreads.get(row["concurrency"]), "b": spreads_b.get(row["concurrency"])}
    return {"a": a.get("engine_dir"), "b": b.get("engine_dir"), "same_workload": same_workload,
            "prefix_cache_hit_tokens": hits, "weight_bytes_on_device": {"a": a.get("weight_bytes_on_device"),
                                                                       "b": b.get("weight_bytes_on_device")},
            "levels": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args()
    result = compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()))
    print(json.dumps(result, indent=1))
    return 0 if result["same_workload"] and not any(result["prefix_cache_hit_tokens"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

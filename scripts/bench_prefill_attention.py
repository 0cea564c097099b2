#!/usr/bin/env python3
"""Time the attention of prompt chunks that continue a cached context, one layer, on a CUDA GPU: llmc's paged
prefill kernel (``llmc.engine.torch.triton_prefill``) against the gather + SDPA path it replaced, as the engine
calls them (eager launches).

Shape: Llama-3.1-8B's attention (32 query / 8 kv heads of 128), bf16, 32-token cache blocks handed out in a
random order, random keys, values and queries. Each case is a step's chunks, ``NEW@CACHED`` (new tokens after
that many cached ones), ``+`` between chunks::

    python scripts/bench_prefill_attention.py --cases 960@1024,256@1500+256@1500+256@1500+256@1500 \\
        --configs 128x128x8x2,64x64x4x2 --json out/prefill_attention.json

Prints, per case, the reference's time, each kernel config's (rows x keys per iteration x warps x stages) time in
us, its TFLOP/s (causal FLOPs: 4 x new x (cached + (new + 1) / 2) x head size x query heads) and the largest
difference from the reference's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.engine.torch.attention import (  # noqa: E402
    _gather_context, _prefill_attention, build_attention_metadata, planless_sdpa,
)
from llmc.engine.torch.triton_prefill import BLOCK_N, ROWS, STAGES, WARPS, paged_prefill_attention  # noqa: E402
from llmc.engine.types import ScheduledSequence  # noqa: E402
from llmc.request.params import SamplingParams  # noqa: E402

HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 32


def parse_case(text: str) -> list[tuple[int, int]]:
    """``"960@1024+488@600"`` -> [(960, 1024), (488, 600)]: (new tokens, cached before them) per chunk."""
    return [(int(new), int(cached)) for new, cached in (part.split("@") for part in text.split("+"))]


def make_step(work: list[tuple[int, int]], dtype: torch.dtype):
    """Random q and cache for a step of ``work`` chunks, blocks in a random order; returns q, caches, metadata."""
    total = sum(-(-(n + c) // BLOCK) for n, c in work) + 1
    free = torch.randperm(total).tolist()
    seqs = []
    for i, (n, c) in enumerate(work):
        blocks = tuple(free.pop() for _ in range(-(-(n + c) // BLOCK)))
        seqs.append(ScheduledSequence(f"s{i}", tuple(range(n)), c, blocks, True, SamplingParams(temperature=0.0)))
    meta = build_attention_metadata(seqs, BLOCK, "cuda")
    k_cache = torch.randn(total, BLOCK, KV_HEADS, HEAD, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(meta.num_tokens, HEADS, HEAD, device="cuda", dtype=dtype)
    return q, k_cache, v_cache, meta


def time_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def bench_case(work: list[tuple[int, int]], configs: list[tuple[int, int, int, int]]) -> dict:
    q, k_cache, v_cache, meta = make_step(work, torch.bfloat16)
    scale = HEAD**-0.5
    chunks = [(i, meta.query_starts[i], meta.query_lens[i], meta.num_computed[i]) for i in meta.prefill_seqs]

    def reference() -> torch.Tensor:
        out = torch.empty_like(q)
        with planless_sdpa():
            for i, start, n, cached in chunks:
                k_ctx, v_ctx = _gather_context(k_cache, v_cache, meta, i)
                out[start:start + n] = _prefill_attention(q[start:start + n], k_ctx, v_ctx, cached, scale)
        return out

    want = reference().float()
    flop = sum(4 * n * (c + (n + 1) / 2) * HEAD * HEADS for _, _, n, c in chunks)
    result = {"gather_sdpa_us": round(time_us(reference), 1), "gflop": round(flop / 1e9, 2), "kernel": {}}
    for config in configs:
        out = torch.zeros_like(q)
        us = time_us(lambda: paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, chunks, scale, out,
                                                     *config))
        result["kernel"]["x".join(map(str, config))] = {
            "us": round(us, 1), "tflops": round(flop / us / 1e6, 1),
            "max_diff": round((out.float() - want).abs().max().item(), 4)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="960@1024,256@1500+256@1500+256@1500+256@1500,512@1536+488@600,"
                        "2048@2048", help="comma-separated steps of NEW@CACHED chunks joined by +")
    parser.add_argument("--configs", default=f"{ROWS}x{BLOCK_N}x{WARPS}x{STAGES}",
                        help="comma-separated ROWSxKEYSxWARPSxSTAGES kernel configs (default: the shipped one)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (the kernel is Triton on CUDA)")
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    results = {}
    for case in args.cases.split(","):
        results[case] = bench_case(parse_case(case), configs)
        print(case, json.dumps(results[case]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

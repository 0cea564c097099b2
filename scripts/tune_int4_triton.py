"""The Triton fallback's part of ``tune_int4_cuda.py --kernels triton``: its candidate configs, random layers in
its layout, and the compiles done up front in worker processes (Triton compiles per config). Run alone, it prints
the candidate configs of each row bucket (``[block_m, block_n, unroll, warps, stages, split_k]``):

    python scripts/tune_int4_triton.py [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4  # noqa: E402
from llmc.engine.torch.int4_configs import KernelConfig, shape_key  # noqa: E402
from llmc.engine.torch.int4_cuda import Int4CudaLinear, Scratch  # noqa: E402
from llmc.engine.torch.int4_layout import pack_for_cuda  # noqa: E402
from llmc.engine.torch.int4_tune import LAYERS  # noqa: E402

BUCKETS = [(1, 1), (16, 16), (32, 32), (64, 64), (128, 128), (256, 256)]  # (bucket's largest M, M tuned at)
DENSE_MS = (128, 256, 512, 1024, 2048)


def candidates(m: int, quick: bool = False) -> list[KernelConfig]:
    """The configs tried for row count ``m`` (``quick``: a few, for shapes that are only checked)."""
    out = []
    if m <= 16:
        for bn, warps in ((32, 2), (64, 2), (64, 4), (128, 4)):
            for unroll in (1, 2):
                for split in (1, 2, 4, 8, 16):
                    out.append(KernelConfig(16, bn, unroll, warps, 3, split))
    elif m <= 64:
        bm = 32 if m <= 32 else 64
        for bn in (64, 128):
            for split in (1, 2, 4, 8):
                out.append(KernelConfig(bm, bn, 1, 4, 3, split))
    else:
        for bm, bn, warps in ((64, 128, 4), (128, 128, 8), (64, 256, 8)):
            for split in (1, 2, 4):
                out.append(KernelConfig(bm, bn, 1, warps, 3, split))
    return out[::5] if quick else out


def make_layer(n: int, k: int, group: int, silu: bool, prequant: bool, device: str, seed: int,
               scratch: Scratch | None = None):
    """A random int4 layer and its IR tensors (packed, scales, prequant), made on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8, device=device)
    scales = (torch.rand(n, k // group, generator=gen, device=device) * 0.01 + 0.002).to(torch.bfloat16)
    pq = (torch.rand(k, generator=gen, device=device) + 0.5).to(torch.bfloat16) if prequant else None
    packed = pack_int4(q)
    words, scales_t = pack_for_cuda(packed, scales, group)
    scratch = scratch or Scratch(torch.bfloat16, torch.device(device))
    layer = Int4CudaLinear(words, scales_t, pq, k, group, scratch, silu_output=silu)
    return layer, packed, scales, pq


def _compile_worker(args) -> str:
    """Fill Triton's on-disk cache with one config (a worker process: compiles do not share the parent's GIL)."""
    (n, k, group, silu, prequant), config, rows = args
    try:
        scratch = Scratch(torch.bfloat16, torch.device("cuda"))
        scratch.reserve(partials=config.workspace(rows, n), counters=config.grid(rows, n)[0] * config.grid(rows, n)[1])
        layer, *_ = make_layer(n, k, group, silu, prequant, "cuda", 0, scratch)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        layer.matmul(x, config)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # noqa: BLE001 - reported by the parent, which skips the config
        return f"{type(exc).__name__}: {exc}"


def precompile(shapes, workers: int, quick: set[str]) -> dict:
    """Compile every (shape, config) once in worker processes (the row count is not specialized)."""
    jobs = []
    for name, n, k, group, silu, prequant in shapes:
        configs = {c: m for _, m in BUCKETS for c in candidates(m, shape_key(n, k, group) in quick)}
        jobs += [((n, k, group, silu, prequant), config, m) for config, m in configs.items()]
    start = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = pool.map(_compile_worker, jobs, chunksize=1)
    failed = {f"{j[0]}/{j[1]}": e for j, e in zip(jobs, errors) if e}
    print(f"compiled {len(jobs)} (shape, config) pairs in {time.perf_counter() - start:.1f} s with {workers} "
          f"workers; {len(failed)} failed", flush=True)
    return failed


def triton_layers(spec, quick: bool) -> tuple[list, torch.Tensor]:
    """32 random layers of the Triton kernels (their scratch sized for every config tried) and the float32
    reference weight ``[N, K]`` of the first."""
    _, n, k, group, silu, prequant = spec
    scratch = Scratch(torch.bfloat16, torch.device("cuda"))
    tried = [(m, c) for _, m in BUCKETS for c in candidates(m, quick)] + [
        (m, c) for m in DENSE_MS for c in candidates(BUCKETS[-1][1], quick)]  # the dense comparison's kernel
    scratch.reserve(partials=max(c.workspace(m, n) for m, c in tried),
                    counters=max(c.grid(m, n)[0] * c.grid(m, n)[1] for m, c in tried))
    copies = [make_layer(n, k, group, silu, prequant, "cuda", seed, scratch) for seed in range(LAYERS)]
    _, packed, scales, pq = copies[0]
    return [c[0] for c in copies], dequantize_w4a16(packed, scales, pq if pq is not None else
                                                    torch.ones(k, device="cuda"), group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the short list tried for shapes that are only checked")
    args = ap.parse_args()
    for _, m in BUCKETS:
        print(f"M={m}: " + " ".join(str(c.to_list()) for c in candidates(m, args.quick)))


if __name__ == "__main__":
    main()

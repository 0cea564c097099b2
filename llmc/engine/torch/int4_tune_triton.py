"""Tuning the Triton fallback's W4A16 kernels (``int4_triton.w4a16_matmul``) on the GPU this runs on: the kernels
an int4 engine runs where llmc's CUDA library cannot (no nvcc on the machine, a GPU older than sm_80, a failed build,
``LLMC_CUDA_INT4=triton``). ``llmc tune`` runs it there (:func:`tune_build_triton`), ``scripts/tune_int4_cuda.py
--kernels triton`` for the shipped table. The method is :mod:`llmc.engine.torch.int4_tune`'s (every candidate checked
against a float32 product, timed over distinct weight copies in one CUDA graph, ``dense_from_m`` against dequantize +
cuBLAS, the configs the layers ran before timed beside the others); Triton compiles each config once, so they are
compiled up front, in worker processes (:func:`precompile`). The entries are a shape's ``buckets`` and
``dense_from_m`` (the CUDA library's stay under its ``mma`` key).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections.abc import Callable

import torch

from llmc.checkpoint.int4 import dequantize_w4a16
from llmc.engine.torch.int4_configs import TABLE_VERSION, KernelConfig, shape_key
from llmc.engine.torch.int4_cuda import Scratch
from llmc.engine.torch.int4_tune import LAYERS, Family, Spec, gpu_record, make_mma_layer, tune_shapes

BUCKETS = [(1, 1), (16, 16), (32, 32), (64, 64), (128, 128), (256, 256)]  # (bucket's largest M, M tuned at)
DENSE_MS = (128, 256, 512, 1024, 2048)


def candidates(m: int, quick: bool = False) -> list[KernelConfig]:
    """The configs tried for row count ``m`` (``quick``: every fifth, for shapes that are only checked)."""
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


TRITON = Family("triton int4", "triton_", BUCKETS, DENSE_MS, DENSE_MS, candidates,
                lambda layer, x, cfg: layer.matmul(x, cfg), lambda cfg: cfg.to_list(),
                lambda values: KernelConfig(*values),
                lambda ref: torch.nn.functional.silu(ref[:, : ref.shape[1] // 2]) * ref[:, ref.shape[1] // 2:],
                lambda layer, m: layer.config_for(m))


def tried_configs(n: int, family: Family = TRITON, quick: bool = False) -> list[tuple[int, KernelConfig]]:
    """Every ``(rows, config)`` the tuning of a shape of ``n`` columns launches: each bucket's candidates, and the
    last bucket's at the dense comparison's row counts (what the layer would run there)."""
    last = family.buckets[-1][1]
    return ([(m, c) for _, m in family.buckets for c in family.candidates(m, quick)]
            + [(m, c) for m in family.report_ms for c in family.candidates(last, quick)])


def triton_layers(spec: Spec, copies: int = LAYERS, family: Family = TRITON,
                  quick: bool = False) -> tuple[list, torch.Tensor]:
    """``copies`` random layers of the Triton kernels (their split-K buffers sized for every config tried) and the
    float32 reference weight ``[N, K]`` of the first."""
    _, n, k, group, silu, prequant = spec
    scratch = Scratch(torch.bfloat16, torch.device("cuda"))
    tried = tried_configs(n, family, quick)
    scratch.reserve(partials=max(c.workspace(m, n) for m, c in tried),
                    counters=max(c.grid(m, n)[0] * c.grid(m, n)[1] for m, c in tried))
    made = [make_mma_layer(n, k, group, silu, prequant, seed, scratch, backend="triton") for seed in range(copies)]
    scratch.allocate()
    packed, scales, pq = made[0][1]
    return [layer for layer, _ in made], dequantize_w4a16(packed, scales, pq if pq is not None else
                                                          torch.ones(k, device="cuda"), group)


def _compile_worker(job) -> str:
    """Fill Triton's on-disk cache with one config (a worker process: compiles do not share the parent's GIL)."""
    spec, values, rows = job
    try:
        config = KernelConfig(*values)
        family = dataclasses.replace(TRITON, buckets=[(rows, rows)], report_ms=(), candidates=lambda m, q: [config])
        layers, _ = triton_layers(spec, 1, family)
        layers[0].matmul(torch.randn(rows, spec[2], device="cuda", dtype=torch.bfloat16), config)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # noqa: BLE001 - reported by the parent; the tuning then skips the config
        return f"{type(exc).__name__}: {exc}"


def compile_jobs(shapes: list[Spec], family: Family = TRITON, quick: frozenset = frozenset()) -> list[tuple]:
    """One ``(spec, config list, rows)`` per distinct (shape, config) the tuning launches (Triton does not compile
    per row count)."""
    jobs = []
    for spec in dict.fromkeys(shapes):
        first_rows: dict[KernelConfig, int] = {}  # each config at the fewest rows it runs
        for m, config in tried_configs(spec[1], family, shape_key(*spec[1:4]) in quick):
            first_rows.setdefault(config, m)
        jobs += [(spec, config.to_list(), m) for config, m in first_rows.items()]
    return jobs


def default_workers() -> int:
    """Compile processes at a time: the CPUs this process may run on, at most 8 (each holds a CUDA context)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


def precompile(shapes: list[Spec], workers: int, family: Family = TRITON, quick: frozenset = frozenset(),
               log: Callable[[str], None] = print) -> dict:
    """Compile every (shape, config) of the tuning once, ``workers`` processes at a time (1: none here; each config
    then compiles when first tried). ``{job: why}`` of the configs that failed to compile."""
    jobs = compile_jobs(shapes, family, quick)
    if workers <= 1 or not jobs:
        return {}
    start = time.perf_counter()
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        errors = pool.map(_compile_worker, jobs, chunksize=1)
    failed = {f"{job[0][0]} {job[1]}": why for job, why in zip(jobs, errors) if why}
    log(f"compiled {len(jobs)} (shape, config) pairs in {time.perf_counter() - start:.1f} s with {workers} "
        f"processes; {len(failed)} failed")
    return failed


def tune_build_triton(shapes: list[Spec], log: Callable[[str], None] = print, family: Family = TRITON,
                      workers: int | None = None) -> tuple[dict, dict]:
    """``(table, report)``: this GPU's tuned Triton entries for ``shapes`` (``{"buckets", "dense_from_m"}`` per shape
    key, a table of one GPU as ``int4_tune.save_table`` merges it) and every timing."""
    name, gpu = gpu_record()
    report = {"device": name, "torch": torch.__version__, "kernels": "triton", "shapes": {}}
    report["compile_failures"] = precompile(shapes, default_workers() if workers is None else workers, family,
                                            log=log)
    entries = tune_shapes(shapes, family, lambda spec, copies: triton_layers(spec, copies, family), report["shapes"],
                          log)
    return {"version": TABLE_VERSION, "gpus": {name: gpu}, "devices": {name: entries}}, report

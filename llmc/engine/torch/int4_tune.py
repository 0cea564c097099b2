"""Tuning llmc's W4A16 CUDA kernels on the GPU this runs on: for each int4 linear shape and row bucket, every config
the CUDA library launches is checked against a float32 product over the dequantized weight, then timed over
distinct random weight copies (one per layer, as in a decode step, so nothing is served from L2) in one CUDA graph,
median of 20 replays; the fastest correct config is kept, and ``dense_from_m`` is the smallest row count from which
dequantize + cuBLAS beats it. ``llmc tune`` runs this for a build's shapes (:func:`tune_build`);
``scripts/tune_int4_cuda.py`` for the shipped table. The Triton fallback's kernels are tuned the same way
(:mod:`llmc.engine.torch.int4_tune_triton`).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4
from llmc.engine.torch import cuda_ext
from llmc.engine.torch.int4_configs import TABLE_VERSION, is_wgmma, merge_tables, mma_configs, shape_key, user_table
from llmc.engine.torch.int4_cuda import Int4CudaLinear, Scratch
from llmc.errors import EngineError, LlmcError

LAYERS = 32  # weight copies a shape is timed over (fewer where GPU memory is short: timings are scaled to 32)
Spec = tuple[str, int, int, int, bool, bool]  # (name, columns, inputs, group, silu output, input scale in kernel)


def time_graph(fn: Callable[[], object], replays: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph that runs ``fn`` once (fn itself launches every layer copy)."""
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
    current: Callable  # (layer, m) -> the config the layer runs at m rows with the tables it was made under


MMA_BUCKETS = [(1, 1), (8, 8), (16, 16), (32, 32), (64, 64), (128, 128)]
MMA_DENSE_MS = (32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512)

MMA = Family("mma int4", "mma_", MMA_BUCKETS, MMA_DENSE_MS, MMA_DENSE_MS + (2048,),
             lambda m, quick: [c for c in mma_configs() if cuda_ext.warpgroup_kernels() or not is_wgmma(c)],
             lambda layer, x, cfg: layer.mma(x, *cfg), list, tuple,
             lambda ref: torch.nn.functional.silu(ref[:, : ref.shape[1] // 2]) * ref[:, ref.shape[1] // 2:],
             lambda layer, m: layer.mma_config_for(m))


def make_mma_layer(n: int, k: int, group: int, silu: bool, prequant: bool, seed: int, scratch: Scratch,
                   dtype: torch.dtype = torch.bfloat16, backend: str = "mma"):
    """A random int4 layer of the CUDA mma kernels (``backend`` "triton": of the Triton fallback) and its IR tensors
    ``(packed, scales, prequant)`` (fc + gate: the first N/2 rows are fc, the rest gate)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8, device="cuda")
    scales = (torch.rand(n, k // group, generator=gen, device="cuda") * 0.01 + 0.002).to(dtype)
    pq = (torch.rand(k, generator=gen, device="cuda") + 0.5).to(dtype) if prequant else None
    packed = pack_int4(q)
    parts = [(packed[: n // 4], scales[: n // 2]), (packed[n // 4:], scales[n // 2:])] if silu else [(packed, scales)]
    layer = Int4CudaLinear.from_ir(parts, pq, group, scratch, silu_output=silu, backend=backend)
    return layer, (packed, scales, pq)


def layer_copies(n: int, k: int, free_bytes: int | None = None) -> int:
    """Weight copies to time a shape over: 32 where half the GPU's free memory holds them with their bf16 cuBLAS
    baselines (a copy: 2 N K + N K / 2 bytes) besides the shared buffers (split-K's partial sums at 2,048 rows,
    the dequantized weight), else as many as fit, at least 4."""
    free = torch.cuda.mem_get_info()[0] if free_bytes is None else free_bytes
    room = free // 2 - (8 * 2048 * n * 4 + 2 * n * k)
    return max(4, min(LAYERS, int(room // (n * k * 5 // 2))))


def mma_layers(spec: Spec, copies: int = LAYERS, max_rows: int = 2048) -> tuple[list, torch.Tensor]:
    """``copies`` random layers of the CUDA mma kernels (their split-K buffers sized for any config at up to
    ``max_rows`` rows: every row count tried by default) and the float32 reference weight ``[N, K]`` of the first."""
    _, n, k, group, silu, prequant = spec
    scratch = Scratch(torch.bfloat16, torch.device("cuda"))
    made = [make_mma_layer(n, k, group, silu, prequant, seed, scratch) for seed in range(copies)]
    scratch.reserve_splits(((c, max_rows) for c in mma_configs()), n)
    scratch.allocate()
    packed, scales, pq = made[0][1]
    return [lay for lay, _ in made], dequantize_w4a16(packed, scales, pq if pq is not None else
                                                      torch.ones(k, device="cuda"), group)


def tune_family(spec: Spec, family: Family, layers: list, weight: torch.Tensor, report: dict, quick: bool = False,
                old: dict | None = None, dense_only: bool = False, log: Callable[[str], None] = print) -> dict:
    """One shape's table entry ``{"buckets": [[m_max, *config]], "dense_from_m": m}``: the fastest correct config
    per row bucket, and the smallest row count of ``family.dense_ms`` from which dequantize + cuBLAS (checked
    too) beats the largest bucket's config. Every timing goes into ``report`` (scaled to 32 layer copies), with
    ``"before"``: the config the layers ran at each bucket's row count before (they were made under the tables
    then in force: a GPU's own, borrowed or the heuristics), which competes too. With ``old`` (the shape's entry in
    the table), only the buckets that hold ``family.buckets``' row counts are tuned: the others and
    ``dense_from_m`` stay as they were; with ``dense_only`` too, no bucket is tuned and only ``dense_from_m`` is
    chosen again, against ``old``'s buckets."""
    name, n, k, group, silu, _ = spec
    silu_ref = family.silu_ref if silu else None
    scale = LAYERS / len(layers)
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in layers]
    entry = {"buckets": [], "dense_from_m": None}
    rows_report = report.setdefault(shape_key(n, k, group), {"name": name})
    if dense_only:
        entry["buckets"] = [list(bucket) for bucket in old["buckets"]]
    for m_max, m in [] if dense_only else family.buckets:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cublas = time_graph(lambda: [torch.nn.functional.linear(x, w) for w in dense]) * scale
        configs = list(family.candidates(m, quick))
        table = next((family.from_list(b[1:]) for b in (old or {}).get("buckets", []) if b[0] == m_max), None)
        before = family.current(layers[0], m)
        configs += [c for c in dict.fromkeys((table, before)) if c is not None and c not in configs]
        best, best_t, tried = fastest(
            configs,
            lambda cfg: rel_error(layers[0], weight, silu_ref, lambda inp: family.run(layers[0], inp, cfg), m),
            lambda cfg: time_graph(lambda: [family.run(layer, x, cfg) for layer in layers]) * scale,
            lambda cfg: str(family.to_list(cfg)))
        if best is None:
            raise EngineError(f"{name} M={m}: no {family.title} config is correct on this GPU: {tried}")
        entry["buckets"].append([m_max, *family.to_list(best)])
        rows_report[f"{family.prefix}{m}"] = {
            "best": family.to_list(best), "us_32_layers": round(best_t * 1e6, 1),
            "cublas_bf16_us_32_layers": round(cublas * 1e6, 1), "tried_us": tried,
            "before": {"config": family.to_list(before), "us_32_layers": tried[str(family.to_list(before))]}}
        log(f"{name:8s} M={m:4d}: {family.title} {best_t * 1e3:7.3f} ms  bf16 cuBLAS {cublas * 1e3:7.3f} ms  "
            f"({cublas / best_t:.2f}x)  best {family.to_list(best)}")
    if old is not None and not dense_only:
        return merge_buckets(old, entry["buckets"])
    for m in family.report_ms:  # each row count against the config the layer would run there (its bucket's)
        kernel_cfg = family.from_list(next((b for b in entry["buckets"] if m <= b[0]), entry["buckets"][-1])[1:])
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        err = rel_error(layers[0], weight, silu_ref, layers[0]._dense, m)
        if not err < 1e-2:
            raise EngineError(f"{name} M={m}: dequantize + cuBLAS is wrong on this GPU: rel err {err:.3g}")
        dense_t = time_graph(lambda: [layer._dense(x) for layer in layers]) * scale
        kernel_t = time_graph(lambda: [family.run(layer, x, kernel_cfg) for layer in layers]) * scale
        cublas = time_graph(lambda: [torch.nn.functional.linear(x, w) for w in dense]) * scale
        rows_report[f"{family.prefix}dense_{m}"] = {"dequant_cublas_us": round(dense_t * 1e6, 1),
                                                    "kernel_us": round(kernel_t * 1e6, 1),
                                                    "cublas_bf16_us": round(cublas * 1e6, 1)}
        log(f"{name:8s} M={m:4d}: dequant+cuBLAS {dense_t * 1e3:7.3f} ms  {family.title} {kernel_t * 1e3:7.3f} ms  "
            f"bf16 {cublas * 1e3:7.3f} ms")
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


def build_shapes(path: Path) -> list[Spec]:
    """The int4 layer shapes of a W4A16 build's IR checkpoint, or of the IR folder given
    (``int4_install.int4_layer_shapes``); EngineError naming the fix where there are none."""
    from llmc.checkpoint.io import read_config
    from llmc.checkpoint.safetensors_header import tensor_headers
    from llmc.engine.torch.int4_install import int4_layer_shapes

    ir_dir = path / "checkpoint" if (path / "checkpoint" / "config.json").is_file() else path  # a build: its IR
    try:
        group = (read_config(ir_dir).get("quantization") or {}).get("group_size")
        shapes = int4_layer_shapes(tensor_headers(ir_dir), int(group)) if group else []
    except LlmcError as exc:
        raise EngineError(f"{path}: {exc}") from exc
    if not shapes:
        raise EngineError(f"{path}: no W4A16 layer of whole 16 x 64 tiles to tune. Fix: give an AWQ int4 build, or "
                          "its W4A16_AWQ IR folder (config.json + rank*.safetensors)")
    return shapes


STEP_ROWS = (1, 8, 16, 32, 64)  # the decode buckets chosen again in step order


def step_chain(shapes: list[Spec], copies: int = LAYERS) -> list[tuple[str, Int4CudaLinear]]:
    """A decode step's int4 linears: ``copies`` random layers of each shape (in the order a layer runs them: qkv, o,
    fc + gate, down), layer by layer, each with its shape's name; split-K room up to 128 rows."""
    made = {spec[0]: mma_layers(spec, copies, max_rows=128)[0] for spec in shapes}
    return [(spec[0], made[spec[0]][i]) for i in range(copies) for spec in shapes]


def step_inputs(shapes: list[Spec], m: int) -> dict[int, torch.Tensor]:
    """Random ``[m, K]`` activations for each input width K of ``shapes``."""
    return {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in {spec[2] for spec in shapes}}


def top_candidates(tried: dict, current: list[int], top: int) -> list[tuple[int, ...]]:
    """The ``top`` fastest timed configs of a report bucket (``tried_us``: ``"[mt, nt, warps, stages]"`` -> us, or
    why a config was not timed), then the table's ``current`` config if it is not among them; fastest first."""
    timed = sorted((us, tuple(json.loads(label))) for label, us in tried.items() if isinstance(us, (int, float)))
    chosen = [config for _, config in timed[:top]]
    if tuple(current) not in chosen:
        chosen.append(tuple(current))
    return chosen


def descend(start: dict[str, tuple], candidates: dict[str, list[tuple]], seconds_of: Callable[[dict], float],
            passes: int = 2, min_gain: float = 0.003) -> tuple[dict[str, tuple], list[dict]]:
    """Coordinate descent from ``start`` (shape -> config): per pass and shape, every candidate with the other shapes'
    configs fixed; the fastest replaces the incumbent when faster than it by more than ``min_gain`` (relative; the
    incumbent is timed again in each round, so a slow first timing is not kept by luck). Stops after a pass without
    a change. Returns the configs and every round's timings."""
    configs, rounds = dict(start), []
    for _ in range(passes):
        changed = False
        for shape in candidates:
            times = {}
            for config in dict.fromkeys([configs[shape], *candidates[shape]]):
                times[config] = seconds_of({**configs, shape: config})
            best = min(times, key=times.get)
            keep = best != configs[shape] and times[best] < times[configs[shape]] * (1 - min_gain)
            rounds.append({"shape": shape, "incumbent": list(configs[shape]),
                           "chosen": list(best if keep else configs[shape]),
                           "us": {str(list(c)): round(t * 1e6, 1) for c, t in times.items()}})
            if keep:
                configs[shape], changed = best, True
        if not changed:
            break
    return configs, rounds


def step_order(shapes: list[Spec], entries: dict, report: dict, rows: tuple[int, ...] = STEP_ROWS, top: int = 4,
               log: Callable[[str], None] = print) -> dict:
    """Choose the decode buckets of ``entries`` (shape key -> ``{"mma": entry}``, as :func:`tune_family` made them
    from ``report``'s timings) again by a whole step's linears in step order: in a step each kernel follows one of
    another shape, and how far it overlaps its neighbour depends on both (per-shape winners lost in step order on
    the H200: docs/GPU_INT4_LOG.md, 2026-12-04). Per row count, a coordinate descent (:func:`descend`) from the faster
    of the per-shape winners and the configs the layers ran before, over each shape's ``top`` fastest configs and
    its earlier one; ``entries`` is changed in place. Returns ``{m: {"before_ms", "per_shape_ms", "chosen_ms"}}``."""
    keys = {spec[0]: shape_key(*spec[1:4]) for spec in shapes}
    copies = min(layer_copies(spec[1], spec[2]) for spec in shapes)
    chain = step_chain(shapes, copies)
    first = {name: layer for name, layer in reversed(chain)}
    out = {}
    for m in rows:
        cells = {name: report[key].get(f"mma_{m}") for name, key in keys.items()}
        if not all(cells.values()):  # a bucket not tuned at m rows
            continue
        xs = step_inputs(shapes, m)

        def seconds_of(configs: dict[str, tuple]) -> float:
            return time_graph(lambda: [layer.mma(xs[layer.in_features], *configs[name]) for name, layer in chain])

        before = {name: first[name].mma_config_for(m) for name in keys}
        tuned = {name: tuple(cells[name]["best"]) for name in keys}
        times = {"before_ms": seconds_of(before), "per_shape_ms": seconds_of(tuned)}
        start = tuned if times["per_shape_ms"] <= times["before_ms"] else before
        candidates = {name: list(dict.fromkeys(top_candidates(cells[name]["tried_us"], list(start[name]), top)
                                               + [before[name]])) for name in keys}
        chosen, _ = descend(start, candidates, seconds_of)
        times["chosen_ms"] = seconds_of(chosen)
        for name, key in keys.items():
            buckets = entries[key]["mma"]["buckets"]
            buckets[next(i for i, b in enumerate(buckets) if b[0] >= m)][1:] = list(chosen[name])
        out[m] = {label: round(t * 1e3 * LAYERS / copies, 3) for label, t in times.items()}
        out[m]["chosen"] = {name: list(c) for name, c in chosen.items()}
        log(f"M={m:4d} in step order: before {out[m]['before_ms']:.3f} ms, per-shape winners "
            f"{out[m]['per_shape_ms']:.3f} ms, chosen {out[m]['chosen_ms']:.3f} ms")
    chain.clear()  # the weight copies are garbage now
    torch.cuda.empty_cache()
    return out


def gpu_record() -> tuple[str, dict]:
    """This GPU's name and what ``int4_configs.config_devices`` matches an untuned GPU by."""
    props = torch.cuda.get_device_properties()
    return props.name, {"capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count}


def tune_shapes(shapes: list[Spec], family: Family, make_layers: Callable[[Spec, int], tuple], report: dict,
                log: Callable[[str], None] = print) -> dict[str, dict]:
    """``{shape key: entry}``: :func:`tune_family` of each distinct shape, over as many weight copies
    ``make_layers(spec, copies)`` (layers, float32 weight) as the GPU's memory holds (:func:`layer_copies`)."""
    entries = {}
    for spec in dict.fromkeys(shapes):
        layers, weight = make_layers(spec, layer_copies(spec[1], spec[2]))
        log(f"{spec[0]} ({spec[1]} x {spec[2]}, group {spec[3]}): timing over {len(layers)} weight copies")
        entries[shape_key(*spec[1:4])] = tune_family(spec, family, layers, weight, report, log=log)
        del layers, weight
        torch.cuda.empty_cache()  # the shape's weight copies are garbage now
    return entries


def tune_build(shapes: list[Spec], log: Callable[[str], None] = print, family: Family = MMA,
               step_rows: tuple[int, ...] = STEP_ROWS) -> tuple[dict, dict]:
    """``(table, report)``: this GPU's tuned CUDA-library entries for ``shapes`` (a table of one GPU, as
    :func:`save_table` merges it) and every timing (``family``: MMA's row buckets and configs, or fewer), the
    decode buckets of ``step_rows`` chosen again in step order (:func:`step_order`)."""
    name, gpu = gpu_record()
    report = {"device": name, "torch": torch.__version__, "shapes": {}}
    entries = {key: {"mma": entry} for key, entry in tune_shapes(shapes, family, mma_layers, report["shapes"],
                                                                 log).items()}
    if step_rows:
        log(f"the decode buckets again, {len(shapes)} linears a layer in step order, 32 layers:")
        report["step_order"] = step_order(list(dict.fromkeys(shapes)), entries, report["shapes"], step_rows, log=log)
    return {"version": TABLE_VERSION, "gpus": {name: gpu}, "devices": {name: entries}}, report


def save_table(path: Path, tuned: dict) -> dict:
    """Merge ``tuned`` over the table at ``path`` (other GPUs and shapes stay) and write it whole: a temp file in
    the same folder, then a rename, so a reader never sees half a table. The merged table."""
    old = user_table(path, f"{path} (the table to merge into)") if path.exists() else {}
    merged = merge_tables(old, tuned)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(merged, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return merged

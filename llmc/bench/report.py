"""The benchmark report: one JSON document per run, and its table printout.

Per concurrency level: TTFT P50/P95/P99 overall and by prompt-length bucket (<=128, 129-512, >512), ITL
P50/P95/P99 and its mean per token index, end-to-end latency, TGS (generated tokens / wall time) with its
four conditions (prompt-length distribution, sampling parameters, concurrency, memory used) and requests/s.
A baseline measured in the same run gets the same figures, and ``ratios`` divides llmc's by the baseline's.
With ``--repeat N`` each level is measured N times: TGS is the median repetition's, latencies pool all requests.
Every level also counts the prompt tokens served from llmc's prefix cache, and :func:`prefix_caching_caption`
says in one line whether reuse was on (and, with a baseline that recomputes every prompt, that the ratios
are then not like for like): the printout and every plot carry it.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections import Counter
from typing import Any, Sequence

from llmc.bench.bounds import check, level_bound, peaks_for
from llmc.bench.records import LevelResult
from llmc.bench.plan import BenchPlan
from llmc.bench.workload import BenchPrompt, prompt_length_summary
from llmc.request.metrics import TTFT_BUCKETS, percentiles, ttft_bucket

SCHEMA = "llmc-bench/1"
OSL_ENFORCEMENT = "ignore_eos=True + max_new_tokens (baseline: min_new_tokens = max_new_tokens)"


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    return {"count": len(values), "mean": sum(values) / len(values) if values else None, **percentiles(values)}


def itl_by_token_index(level: LevelResult) -> list[float]:
    """Mean inter-token gap per output index: entry i is the mean gap between tokens i and i + 1."""
    sums: list[float] = []
    counts: list[int] = []
    for record in level.records:
        for i, gap in enumerate(record.itls):
            if i == len(sums):
                sums.append(0.0)
                counts.append(0)
            sums[i] += gap
            counts[i] += 1
    return [s / c for s, c in zip(sums, counts)]


def _tgs(level: LevelResult) -> float | None:
    generated = sum(r.generated_tokens for r in level.records)
    return generated / level.wall_s if level.wall_s > 0 else None


def median_repetition(reps: Sequence[LevelResult]) -> LevelResult:
    """The repetition whose TGS a level reports: the lower median (an even count never averages two runs)."""
    by_tgs = sorted(reps, key=lambda lv: _tgs(lv) or 0.0)
    return by_tgs[(len(by_tgs) - 1) // 2]


def summarize_level(level: LevelResult | Sequence[LevelResult], prompts: Sequence[BenchPrompt],
                    sampling: dict[str, Any]) -> dict[str, Any]:
    """The report entry of one level: latency percentiles, throughput and the TGS conditions.

    ``level`` may be several repetitions of the level: latencies pool their requests, TGS is the median
    repetition's (each repetition's is in ``repetitions``), memory and step figures are that repetition's, and
    ``wall_s`` / ``requests_per_s`` cover all of them."""
    reps = [level] if isinstance(level, LevelResult) else list(level)
    median = median_repetition(reps)
    records = [r for lv in reps for r in lv.records]
    ttfts = [r.ttft for r in records if r.ttft is not None]
    by_bucket = {b: _stats([r.ttft for r in records if r.ttft is not None and ttft_bucket(r.prompt_tokens) == b])
                 for b in TTFT_BUCKETS}
    generated = sum(r.generated_tokens for r in records)
    wall = sum(lv.wall_s for lv in reps)
    tgs = _tgs(median)
    cache = prefix_cache_summary(reps)
    return {
        "concurrency": median.concurrency,
        "num_requests": len(records),
        "wall_s": wall,
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "generated_tokens": generated,
        "tgs": tgs,
        "tgs_per_request": tgs / median.concurrency if tgs is not None else None,
        "requests_per_s": len(records) / wall if wall > 0 else None,
        "repetitions": [{"wall_s": lv.wall_s, "generated_tokens": sum(r.generated_tokens for r in lv.records),
                         "tgs": _tgs(lv), "prefix_cache_hit_tokens": lv.prefix_cache.get("hit_tokens")}
                        for lv in reps],
        "prefix_cache": cache,
        "ttft_s": _stats(ttfts),
        "ttft_by_bucket_s": by_bucket,
        "itl_s": _stats([gap for r in records for gap in r.itls]),
        "itl_by_token_index_s": itl_by_token_index(LevelResult(median.concurrency, tuple(records), wall)),
        "e2e_s": _stats([r.e2e for r in records]),
        "finish_reasons": _count(r.finish_reason for r in records),
        "ttft_vs_prompt_tokens": [[r.prompt_tokens, r.ttft] for r in records if r.ttft is not None],
        "memory": median.memory,
        "steps": median.steps,
        "conditions": {
            "prompt_length_distribution": prompt_length_summary(list(prompts)),
            "sampling": sampling,
            "concurrency": median.concurrency,
            "memory": median.memory,
        },
    }


def prefix_cache_summary(reps: Sequence[LevelResult]) -> dict[str, Any] | None:
    """Prompt tokens served from the prefix cache over all repetitions of a level: ``hit_tokens``,
    ``queried_tokens`` (None for a driver that does no lookups) and ``hit_rate`` (hits / lookups); None when
    the driver cannot see the cache (a server)."""
    if not reps or any("hit_tokens" not in lv.prefix_cache for lv in reps):
        return None
    hits = sum(lv.prefix_cache["hit_tokens"] for lv in reps)
    queried = sum(lv.prefix_cache.get("queried_tokens", 0) for lv in reps) if all(
        "queried_tokens" in lv.prefix_cache for lv in reps) else None
    return {"hit_tokens": hits, "queried_tokens": queried, "hit_rate": hits / queried if queried else None}


def prefix_caching_caption(report: dict[str, Any]) -> str:
    """One line on prefix reuse in this run: whether llmc reused cached prompt prefixes, why, how many prompt
    tokens that served, and whether the baseline comparison is like for like."""
    setting = report.get("prefix_caching") or {}
    if setting.get("llmc") is None:
        return f"prefix caching: {setting.get('why', 'unknown')}"
    hits = sum((lv.get("prefix_cache") or {}).get("hit_tokens") or 0 for lv in report["levels"])
    if not setting["llmc"]:
        return f"prefix caching off ({setting.get('why')})"
    text = f"prefix caching ON ({setting.get('why')}): {hits} prompt tokens served from cached blocks"
    if report.get("baseline"):
        text += "; the baseline recomputes every prompt, so the ratios are not like for like"
    return text


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out


def ratios(llmc: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency level present in both: llmc / baseline for TGS, and the latency ratios (< 1 is better
    for latencies, > 1 is better for TGS), each next to the two measured figures it divides."""
    base = {b["concurrency"]: b for b in baseline}
    out = []
    for level in llmc:
        other = base.get(level["concurrency"])
        if other is None:
            continue
        entry: dict[str, Any] = {"concurrency": level["concurrency"]}
        for name, a, b in (("tgs", level["tgs"], other["tgs"]),
                           ("ttft_p50", level["ttft_s"]["p50"], other["ttft_s"]["p50"]),
                           ("itl_p50", level["itl_s"]["p50"], other["itl_s"]["p50"]),
                           ("e2e_p50", level["e2e_s"]["p50"], other["e2e_s"]["p50"])):
            entry[name] = {"llmc": a, "baseline": b, "ratio": a / b if a is not None and b else None}
        out.append(entry)
    return out


def scaling(levels: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """TGS of every level relative to the lowest concurrency level of the same run."""
    if not levels:
        return []
    first = min(levels, key=lambda lv: lv["concurrency"])
    return [{"concurrency": lv["concurrency"], "tgs": lv["tgs"], "reference_concurrency": first["concurrency"],
             "reference_tgs": first["tgs"],
             "ratio": lv["tgs"] / first["tgs"] if lv["tgs"] is not None and first["tgs"] else None}
            for lv in levels]


def host_info() -> dict[str, Any]:
    """Where the run happened: CPU count, load average, torch threads, versions."""
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "torch": torch.__version__,
                            "torch_threads": torch.get_num_threads()}
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        info["load_average"] = None
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def build_report(run: dict[str, Any], levels: Sequence[LevelResult], plan: BenchPlan,
                 sampling: dict[str, Any], baseline: Sequence[LevelResult] | None = None,
                 baseline_info: dict[str, Any] | None = None, host_start: dict[str, Any] | None = None,
                 ) -> dict[str, Any]:
    """The whole report. ``run`` describes the target (mode, engine_dir or url/protocol, device, workload);
    ``host_start`` is ``host_info()`` taken before measuring (its load average is kept as ``load_average_start``)."""
    summaries = [summarize_level(reps, plan.prompts_of(c), sampling) for c, reps in _by_level(levels)]
    measured = [p for _, prompts in plan.levels for p in prompts]
    host = host_info()
    if host_start is not None:
        host["load_average_start"] = host_start.get("load_average")
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **run,
        "host": host,
        "sampling": sampling,
        "osl_enforcement": OSL_ENFORCEMENT,
        "warmup_requests": len(plan.warmup),
        "repeat": plan.repeat,
        "prompt_lengths": prompt_length_summary(measured),
        "levels": summaries,
        "scaling": scaling(summaries),
        "baseline": None,
        "ratios": [],
    }
    add_bounds(summaries, levels, run, host)
    if baseline is not None:
        base = [summarize_level(reps, plan.prompts_of(c), sampling) for c, reps in _by_level(baseline)]
        report["baseline"] = {**(baseline_info or {}), "levels": base, "scaling": scaling(base)}
        report["ratios"] = ratios(summaries, base)
    return report


def add_bounds(summaries: list[dict[str, Any]], levels: Sequence[LevelResult], run: dict[str, Any],
               host: dict[str, Any]) -> None:
    """Each level's hardware bounds (:mod:`llmc.bench.bounds`), from its median repetition, as ``bound`` with
    ``problems`` (figures the GPU cannot produce), where the run's GPU has known peaks and the run says the
    model's shape, weights on the device and KV bytes per token."""
    peaks = peaks_for(run.get("device"), host.get("cuda_device"))
    shape, weights, kv = run.get("model_shape"), run.get("weight_bytes_on_device"), run.get("kv_bytes_per_token")
    if peaks is None or not (shape and weights and kv):
        return
    for summary, (_, reps) in zip(summaries, _by_level(levels)):
        rep = median_repetition(reps)
        bound = level_bound([(r.prompt_tokens, r.generated_tokens) for r in rep.records], rep.concurrency,
                            rep.prefix_cache.get("hit_tokens") or 0, shape, weights, kv, peaks,
                            run.get("weight_bytes_on_host"))
        summary["bound"] = {**bound, "problems": check(summary, bound)}


def _by_level(levels: Sequence[LevelResult]) -> list[tuple[int, list[LevelResult]]]:
    """Measurements grouped by concurrency (the repetitions of each level), in first-run order."""
    groups: dict[int, list[LevelResult]] = {}
    for lv in levels:
        groups.setdefault(lv.concurrency, []).append(lv)
    return list(groups.items())


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _hits(cache: dict[str, Any] | None) -> str:
    """``hit tokens (hit rate)`` of a level, or "-" when the cache is not visible."""
    if cache is None:
        return "-"
    rate = cache.get("hit_rate")
    return f"{cache['hit_tokens']}" + ("" if rate is None else f" ({rate:.0%})")


def level_table(title: str, levels: Sequence[dict[str, Any]]) -> Any:
    """A rich Table of the levels of one system (llmc or the baseline); times in milliseconds."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("conc", "reqs", "TGS tok/s", "req/s", "TTFT p50/p95/p99 ms", "TTFT p50 by bucket ms",
                   "ITL p50/p95/p99 ms", "e2e p50 ms", "prefix hits", "memory"):
        table.add_column(column, justify="right" if column != "memory" else "left")
    for lv in levels:
        t, i = lv["ttft_s"], lv["itl_s"]
        buckets = " ".join(f"{b}:{_ms(s['p50'])}" for b, s in lv["ttft_by_bucket_s"].items() if s["count"])
        mem = lv["memory"]
        mem_text = f"rss {_num(mem.get('rss_peak_mb'), '{:.0f}')} MB"
        if "kv_blocks_used_peak" in mem:
            mem_text += f", kv {mem['kv_blocks_used_peak']}/{mem['kv_blocks_total']} blk"
        if "cuda_max_allocated_mb" in mem:
            mem_text += f", cuda {mem['cuda_max_allocated_mb']:.0f} MB"
        tgs = _num(lv["tgs"])
        if len(lv.get("repetitions", ())) > 1:  # the median, then every repetition's
            tgs += " (" + "/".join(_num(r["tgs"], "{:.0f}") for r in lv["repetitions"]) + ")"
        table.add_row(str(lv["concurrency"]), str(lv["num_requests"]), tgs, _num(lv["requests_per_s"], "{:.2f}"),
                      f"{_ms(t['p50'])}/{_ms(t['p95'])}/{_ms(t['p99'])}", buckets or "-",
                      f"{_ms(i['p50'])}/{_ms(i['p95'])}/{_ms(i['p99'])}", _ms(lv["e2e_s"]["p50"]),
                      _hits(lv.get("prefix_cache")), mem_text)
    return table


def steps_line(kinds: dict[str, dict[str, Any]]) -> str:
    """``decode 508 x 4.4 ms (p50 2.4, 16 decodes), mixed 262 x 47.3 ms (p50 48.6, 32 decodes, 985 prompt
    tokens), ...``: per kind, the count, mean and p50 duration and the mean tokens."""
    parts = []
    for kind, k in kinds.items():
        text = f"{kind} {k['count']} x {_ms(k['mean_s'])} ms (p50 {_ms(k['p50_s'])}"
        if kind != "prompt":
            text += f", {k['mean_decode_tokens']:.0f} decodes"
        if kind != "decode":
            text += f", {k['mean_prompt_tokens']:.0f} prompt tokens"
        parts.append(text + ")")
    return ", ".join(parts)


def bound_line(level: dict[str, Any]) -> str:
    """One level's hardware bounds in words, and in capitals what its figures break."""
    b, conc = level["bound"], level["concurrency"]
    if not b.get("tgs_max"):
        return f"bound at concurrency {conc}: none (nothing computed or moved)"
    share = 100 * (level["tgs"] or 0) / b["tgs_max"]
    line = (f"bound at concurrency {conc}: TGS <= {_num(b['tgs_max'])} tok/s (prefill then decode: "
            f"{_num(b['tgs_max_prefill_then_decode'])}), measured {share:.0f} % of it")
    if b.get("ttft_p50_min_s"):
        line += f"; TTFT p50 >= {_ms(b['ttft_p50_min_s'])} ms"
    for problem in b.get("problems", []):
        line += f"\nIMPOSSIBLE on this GPU: {problem}: a measuring error (prefix-cache hits, identical prompts, a clock)"
    return line


def own_configs(source: str, gpu: str | None) -> bool:
    """Whether a layer's config source (``Int4CudaLinear.configs_from``) is this GPU's own tuning of the shape itself:
    shipped, or from a table read over it (llmc tune's, LLMC_INT4_CONFIGS'), of the CUDA library or Triton."""
    source = source.removeprefix("Triton: ")
    return gpu is not None and (source == gpu or source.startswith(f"{gpu} ("))


def print_report(report: dict[str, Any], console: Any = None) -> None:
    """Print the report as tables: llmc's levels, the baseline's, the ratios and the scaling."""
    from rich.table import Table

    from llmc.console import table_console

    console = console or table_console()
    target = report.get("url") or report.get("engine_dir")
    pl = report["prompt_lengths"]["prompt_tokens"]
    console.print(f"[bold]llmc bench[/bold] {report['mode']} {target}  device={report.get('device')}  "
                  f"load avg={report['host'].get('load_average_start')} -> {report['host'].get('load_average')}")
    console.print(f"prompts: {report['prompt_lengths']['count']} (tokens min {pl['min']} mean {_num(pl['mean'])} max "
                  f"{pl['max']}), sampling: temperature={report['sampling'].get('temperature')}, "
                  f"OSL enforced by {report['osl_enforcement']}")
    caption = prefix_caching_caption(report)
    reuse = (report.get("prefix_caching") or {}).get("llmc")
    console.print(f"[bold yellow]{caption}[/bold yellow]" if reuse else caption, highlight=False)
    weights = report.get("weight_bytes_on_device")
    if weights:
        parts = ", ".join(f"{dtype} {n / 1e9:.2f} GB" for dtype, n in sorted(weights.items()))
        console.print(f"weights on the device: {sum(weights.values()) / 1e9:.2f} GB "
                      f"({sum(weights.values()) / 2**30:.2f} GiB; {parts})", highlight=False)
    on_host = report.get("weight_bytes_on_host")
    if on_host:
        console.print(f"weights in page-locked host memory (the input embedding, a row per token): "
                      f"{sum(on_host.values()) / 1e9:.2f} GB", highlight=False)
    kv_dtype, per_token = report.get("kv_cache_dtype"), report.get("kv_bytes_per_token")
    if kv_dtype:  # an fp8 cache halves the KV bytes a step reads: part of a figure's conditions
        console.print(f"KV cache: {kv_dtype}" + (f", {per_token:,} bytes a token" if per_token else "")
                      + (f" ({report['kv_cache_fallback']})" if report.get("kv_cache_fallback") else ""),
                      highlight=False)
    configs = report.get("int4_kernel_configs")
    if configs:  # whose tuned configs the int4 CUDA layers run: a borrowed table or the heuristics explain a figure
        shapes = Counter(configs.values())
        gpu = (report.get("host") or {}).get("cuda_device")
        hint = "" if all(own_configs(source, gpu) for source in shapes) else (
            f"; `llmc tune {report.get('engine_dir') or 'BUILD'}` tunes them here")
        console.print("int4 kernel configs: " + "; ".join(f"{source} ({shapes[source]} shapes)"
                                                          for source in sorted(shapes)) + hint, highlight=False)
    why_random = (report.get("workload") or {}).get("why")
    if why_random:
        console.print(f"synthetic prompts of random token ids: {why_random}", highlight=False)
    if report.get("repeat", 1) > 1:
        console.print(f"every level measured {report['repeat']} times, interleaved: TGS is the median repetition's "
                      "(each repetition's in brackets); latencies pool all requests")
    console.print(level_table("llmc", report["levels"]))
    for lv in report["levels"]:
        if lv.get("bound"):
            console.print(bound_line(lv), highlight=False)
    for lv in report["levels"]:
        kinds = (lv.get("steps") or {}).get("by_kind")
        if kinds:
            console.print(f"engine steps at concurrency {lv['concurrency']}: " + steps_line(kinds), highlight=False)
    if report.get("baseline"):
        console.print(level_table(f"baseline: {report['baseline'].get('name')}", report["baseline"]["levels"]))
        ratio_table = Table(title="llmc / baseline (same run)")
        for column in ("conc", "TGS llmc", "TGS base", "TGS ratio", "TTFT p50 ratio", "ITL p50 ratio"):
            ratio_table.add_column(column, justify="right")
        for r in report["ratios"]:
            ratio_table.add_row(str(r["concurrency"]), _num(r["tgs"]["llmc"]), _num(r["tgs"]["baseline"]),
                                _num(r["tgs"]["ratio"], "{:.2f}x"), _num(r["ttft_p50"]["ratio"], "{:.2f}x"),
                                _num(r["itl_p50"]["ratio"], "{:.2f}x"))
        console.print(ratio_table)
    scale = " ".join(f"c{s['concurrency']}:{_num(s['ratio'], '{:.2f}x')}" for s in report["scaling"])
    console.print(f"TGS scaling vs concurrency {report['scaling'][0]['reference_concurrency'] if report['scaling'] else '-'}: {scale}")

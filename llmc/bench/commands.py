"""``llmc bench``: TTFT / ITL / TGS of an engine, offline (in-process) or through a server (``--url``).

Every request's output length is enforced (``ignore_eos=True`` + ``max_new_tokens``) so runs compare; warm-up
requests run first and are not measured; ``--baseline hf`` measures transformers ``generate`` on the same
model and prompts in the same run and reports llmc / baseline ratios. transformers recomputes every prompt,
so with a baseline llmc's prefix reuse is off unless ``--prefix-caching on`` asks for it (see
:func:`prefix_caching_override`); every level reports the prompt tokens served from cached blocks.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click

from llmc.errors import RequestError
from llmc.runtime.scheduler.speculate import MAX_DRAFT_TOKENS


@dataclass(frozen=True)
class BenchOptions:
    """Parsed command-line options (see ``llmc bench --help``)."""

    engine_dir: Path | None
    url: str | None
    protocol: str
    model: str | None
    tokenizer: Path | None
    isl: int
    osl: int
    isl_dist: str
    osl_dist: str
    spread: float
    num_prompts: int | None
    prompts: Path | None
    concurrency: tuple[int, ...]
    sampling: dict[str, Any]
    baseline: str | None
    baseline_model: Path | None
    device: str
    warmup: int
    json_out: Path | None
    plots: Path | None
    seed: int
    threads: int | None = None
    repeat: int = 1
    prefix_caching: str = "auto"
    mixed_step_tokens: int | None = None  # None: the build's serving.mixed_step_tokens
    step_log: Path | None = None  # keep the engine's per-step records (JSON lines) here
    speculative_tokens: int | None = None  # None: the build's serving.speculative_tokens


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> ``(1, 4, 16)``; every level must be a positive integer."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise RequestError("concurrency", f"{text!r} is not a comma-separated list of integers; pass e.g. 1,4,16") from None
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise RequestError("concurrency", f"levels must be distinct integers >= 1, got {text!r}")
    return levels


PREFIX_CACHING_MODES = ("auto", "on", "off")


def prefix_caching_override(mode: str, baseline: str | None) -> tuple[bool | None, str]:
    """``--prefix-caching MODE`` -> (the engine's override, None = the build's ``serving.enable_kv_cache_reuse``;
    why, for the report). ``auto`` turns reuse off when a baseline that cannot reuse a prefix is measured."""
    if mode not in PREFIX_CACHING_MODES:
        raise RequestError("prefix_caching", f"unknown mode {mode!r}; use one of {', '.join(PREFIX_CACHING_MODES)}")
    if mode != "auto":
        return mode == "on", f"--prefix-caching {mode}"
    if baseline is not None:
        return False, f"auto: the {baseline} baseline cannot reuse a prefix; --prefix-caching on to measure reuse"
    return None, "auto: the build's serving.enable_kv_cache_reuse"


def load_plan(opts: BenchOptions, tokenizer: Any, add_special_tokens: bool,
              eos_token_ids: tuple[int, ...] = ()) -> tuple[Any, Any]:
    """The workload the options describe (a prompts file, or synthetic ISL/OSL distributions; random-id prompts
    never contain ``eos_token_ids``) and its split into warm-up prompts and one disjoint slice per level."""
    from llmc.bench.plan import level_sizes, plan_levels
    from llmc.bench.workload import LengthDist, file_workload, synthetic_workload

    if opts.prompts is not None:
        workload = file_workload(opts.prompts, tokenizer, opts.osl, None, opts.seed, add_special_tokens)
        per_level = opts.num_prompts or len(workload.prompts)
    else:
        per_level = opts.num_prompts or max(8, 2 * max(opts.concurrency))
        total = opts.warmup + opts.repeat * sum(level_sizes(opts.concurrency, per_level))
        workload = synthetic_workload(tokenizer, LengthDist(opts.isl_dist, opts.isl, opts.spread),
                                      LengthDist(opts.osl_dist, opts.osl, opts.spread), total, opts.seed,
                                      add_special_tokens, exclude_ids=tuple(eos_token_ids))
    return workload, plan_levels(workload, opts.concurrency, per_level, opts.warmup, opts.repeat)


def _progress(prefix: str = "") -> Callable[..., None]:
    """A one-line progress note on stderr after each measured level: ``note(label, level)``."""

    def note(label: str, level: Any) -> None:
        tokens = sum(r.generated_tokens for r in level.records)
        click.echo(f"{prefix}{label}: concurrency {level.concurrency}: {len(level.records)} requests, {tokens} "
                   f"tokens in {level.wall_s:.1f} s ({tokens / level.wall_s:.1f} tok/s)", err=True)

    return note


def run_offline_bench(opts: BenchOptions, params: Any) -> tuple[dict[str, Any], list, Any, list | None]:
    """Load the engine (and the baseline), measure every level of the plan, llmc then the baseline at each
    level; returns (run info, llmc levels, plan, baseline levels or None)."""
    from llmc.bench.offline import run_offline
    from llmc.runtime.api import Engine

    baseline = None
    override, why = prefix_caching_override(opts.prefix_caching, opts.baseline)
    with tempfile.TemporaryDirectory(prefix="llmc-bench-") as tmp:
        step_log = Path(tmp) / "steps.jsonl"
        engine = Engine.from_dir(opts.engine_dir, device=opts.device, metrics_log=step_log, prefix_caching=override,
                                 mixed_step_tokens=opts.mixed_step_tokens, speculative_tokens=opts.speculative_tokens)
        try:
            workload, plan = load_plan(opts, engine.tokenizer, engine.recipe.model.add_special_tokens,
                                       engine.eos_token_ids)
            if opts.baseline == "hf":
                baseline = load_baseline(opts, str(engine.runner.device))
            levels, base_levels = run_offline(engine, plan, params, step_log, _progress(), baseline)
            drafts = engine.stats()  # warm-up included: its requests are greedy too
        finally:
            engine.shutdown()
        if opts.step_log is not None:
            keep_step_log(step_log, opts.step_log)
    run = {"mode": "offline", "engine_dir": str(opts.engine_dir), "device": str(engine.runner.device),
           "workload": workload.description,
           "engine": {"name": engine.recipe.name, "dtype": engine.recipe.model.dtype,
                      "max_batch_size": engine.recipe.engine.max_batch_size,
                      "max_num_tokens": engine.recipe.engine.max_num_tokens,
                      "tokens_per_block": engine.runner.block_size, "kv_blocks": engine.runner.num_blocks,
                      "quantization": engine.recipe.quantization.method,
                      "mixed_step_tokens": engine.scheduler.max_mixed_tokens or 0,
                      "mixed_step_tokens_from": "the build's recipe" if opts.mixed_step_tokens is None
                      else "--mixed-step-tokens",
                      # token counts whose steps replay CUDA graphs in pieces (llmc.engine.torch.piece_graphs)
                      "piece_graph_buckets": getattr(getattr(engine.runner, "pieces", None), "buckets", []),
                      # prompt-lookup draft tokens per step (0: off) and those the model accepted over the run
                      "speculative_tokens": getattr(engine.scheduler.speculator, "num_draft", 0),
                      "draft_tokens": drafts["draft_tokens"], "accepted_draft_tokens": drafts["accepted_draft_tokens"],
                      "prefix_caching": engine.block_manager.enable_prefix_caching},
           # The weights as the engine holds them on its device (int4 layers packed on CUDA), by dtype.
           "weight_bytes_on_device": getattr(engine.runner, "weight_bytes", None),
           # Weights the engine reads from host memory (an input embedding in page-locked memory on CUDA), by dtype.
           "weight_bytes_on_host": getattr(engine.runner, "host_weight_bytes", None) or {},
           # Whose tuned kernel configs each int4 CUDA layer shape runs (a GPU's, borrowed, or the heuristics).
           "int4_kernel_configs": getattr(engine.runner, "int4_config_sources", None) or {},
           # What the levels' hardware bounds need (llmc.bench.bounds); absent for engines that do not say.
           "model_shape": _model_shape(engine.runner),
           "kv_bytes_per_token": getattr(engine.runner, "kv_bytes_per_token", None),
           # The KV cache's dtype here, and why a recipe's fp8 runs 16-bit (None: it does not).
           "kv_cache_dtype": str(getattr(engine.runner, "kv_dtype", "")).removeprefix("torch.") or None,
           "kv_cache_fallback": getattr(engine.runner, "kv_fallback", None),
           "prefix_caching": {"mode": opts.prefix_caching, "llmc": engine.block_manager.enable_prefix_caching,
                              "baseline": False if baseline else None, "why": why},
           "order": "at each level llmc first, then the baseline, same prompts" if baseline else "llmc only",
           "rss_note": "process RSS; with --baseline both models are loaded in the one process"}
    if baseline is not None:
        run["baseline_info"] = baseline.describe()
    return run, levels, plan, base_levels


def _model_shape(runner: Any) -> dict[str, Any] | None:
    from llmc.bench.bounds import shape_of

    config = getattr(getattr(runner, "model", None), "config", None)
    try:
        return shape_of(config) if config is not None else None
    except AttributeError:  # a runner whose model config lacks a figure: no bounds
        return None


def check_step_log(path: Path | None) -> None:
    """``--step-log`` names a new file: llmc never appends to or overwrites one (checked before measuring and
    again before the copy)."""
    if path is not None and path.exists():
        raise RequestError("step_log", f"{path} exists; pass a new file name (llmc does not overwrite or append to "
                                       "an earlier run's log)")


def keep_step_log(source: Path, dest: Path) -> None:
    """Copy the run's metrics log (the engine created it when it started) to ``dest`` whole (a temporary name in
    its folder, then a rename), so an interrupted copy never leaves a half-written log."""
    import os
    import shutil

    dest.parent.mkdir(parents=True, exist_ok=True)
    check_step_log(dest)
    partial = dest.with_name(f".{dest.name}.partial")
    try:
        shutil.copyfile(source, partial)
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)


def load_baseline(opts: BenchOptions, device: str) -> Any:
    """transformers on the build's source model (or --baseline-model), on the engine's device."""
    from llmc.bench.baseline import HFBaseline, resolve_hf_dir

    hf_dir = opts.baseline_model or resolve_hf_dir(opts.engine_dir)
    return HFBaseline(hf_dir, device=device, dtype=_baseline_dtype(opts, device))


def _baseline_dtype(opts: BenchOptions, device: str) -> Any:
    """float32 on CPU (what the portable engine computes in); the recipe's dtype on a GPU."""
    if device == "cpu" or opts.engine_dir is None:
        return None
    from llmc.checkpoint.convert import torch_dtype
    from llmc.manifest import read_manifest

    return torch_dtype(read_manifest(opts.engine_dir).dtype)


def run_server_bench(opts: BenchOptions, params: Any) -> tuple[dict[str, Any], list, Any]:
    """Measure a running server over ``opts.protocol``; the tokenizer comes from ENGINE_DIR or --tokenizer."""
    from llmc.bench.client import make_client, run_client
    from llmc.tokenizer import load_tokenizer

    add_special, model, eos_ids = False, opts.model, ()
    if opts.tokenizer is not None:
        tokenizer = load_tokenizer(opts.tokenizer)
    elif opts.engine_dir is not None:
        from llmc.manifest import read_manifest

        manifest = read_manifest(opts.engine_dir)
        recipe = manifest.recipe_obj()
        tokenizer = load_tokenizer(opts.engine_dir / "tokenizer")
        add_special, eos_ids = recipe.model.add_special_tokens, tuple(manifest.eos_token_ids)
        model = model or recipe.serving.model_name or recipe.name
    else:
        raise RequestError("tokenizer", "--url needs ENGINE_DIR or --tokenizer DIR to measure prompt lengths")
    if model is None:
        raise RequestError("model", "pass --model NAME (the served model's name)")
    workload, plan = load_plan(opts, tokenizer, add_special, eos_ids)
    client = make_client(opts.protocol, opts.url, model, params)
    try:
        levels = run_client(client, plan, on_level=lambda level: _progress()(f"{opts.protocol} client", level))
    finally:
        client.close()
    run = {"mode": "server", "url": opts.url, "protocol": opts.protocol, "model": model, "device": "server",
           "engine_dir": str(opts.engine_dir) if opts.engine_dir else None, "workload": workload.description,
           "ttft_from": "request send (connection already open)",
           "prefix_caching": {"mode": "auto", "llmc": None, "baseline": None,
                              "why": "the server's build decides (serving.enable_kv_cache_reuse); its hits are not "
                                     "visible to the client"},
           "token_count": "server-reported usage when present, else one per streamed chunk with output"}
    return run, levels, plan


def execute(opts: BenchOptions) -> dict[str, Any]:
    """Run the whole benchmark the options describe and return the report (also written / plotted)."""
    from llmc.bench.report import build_report, host_info, print_report
    from llmc.request.params import SamplingParams

    params = SamplingParams.from_dict(opts.sampling)
    if opts.threads is not None:
        import torch

        from llmc.runtime.compute import run_compute

        torch.set_num_threads(opts.threads)  # llmc and the baseline share the process, hence the setting
        run_compute(torch.set_num_threads, opts.threads)  # and the thread that runs both models
    host_start = host_info()
    baseline, baseline_info = None, None
    if opts.url is not None:
        run, levels, plan = run_server_bench(opts, params)
    else:
        if opts.engine_dir is None:
            raise RequestError("engine_dir", "pass ENGINE_DIR (a build folder) or --url URL")
        run, levels, plan, baseline = run_offline_bench(opts, params)
        baseline_info = run.pop("baseline_info", None)
    sampling = {**params.to_dict(), "ignore_eos": True, "max_new_tokens": "per prompt (OSL)"}
    report = build_report(run, levels, plan, sampling, baseline, baseline_info, host_start)
    print_report(report)
    if opts.json_out is not None:
        opts.json_out.parent.mkdir(parents=True, exist_ok=True)
        opts.json_out.write_text(json.dumps(report, indent=1))
    if opts.plots is not None:
        from llmc.bench.plots import write_plots

        write_plots(report, opts.plots)
    return report


@click.command("bench")
@click.argument("engine_dir", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--url", help="Benchmark a running server instead (e.g. http://127.0.0.1:8000, or HOST:PORT for grpc).")
@click.option("--protocol", type=click.Choice(["http", "grpc", "openai"]), default="http", show_default=True,
              help="http: KServe generate_stream (SSE); grpc: Triton ModelStreamInfer; openai: /v1/completions.")
@click.option("--model", help="Served model name (default: the build's serving.model_name or recipe name).")
@click.option("--tokenizer", type=click.Path(file_okay=False, path_type=Path), help="Tokenizer folder for --url without ENGINE_DIR.")
@click.option("--isl", default=128, show_default=True, help="Mean input (prompt) length in tokens.")
@click.option("--osl", default=64, show_default=True, help="Mean output length in tokens (enforced with ignore_eos).")
@click.option("--isl-dist", type=click.Choice(["fixed", "uniform", "normal"]), default="fixed", show_default=True)
@click.option("--osl-dist", type=click.Choice(["fixed", "uniform", "normal"]), default="fixed", show_default=True)
@click.option("--spread", default=0.5, show_default=True, help="Relative half-width of uniform/normal lengths.")
@click.option("--num-prompts", type=int, help="Requests per level [default: max(8, 2 x the largest concurrency)].")
@click.option("--prompts", type=click.Path(dir_okay=False, path_type=Path), help=".txt (a prompt per line) or .jsonl file.")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Comma-separated concurrency levels.")
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--sampling-seed", type=int, help="Per-request sampling seed (temperature > 0).")
@click.option("--baseline", type=click.Choice(["hf"]), help="Also measure transformers generate in the same run.")
@click.option("--baseline-model", type=click.Path(file_okay=False, path_type=Path), help="HF folder for the baseline.")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda (offline mode).")
@click.option("--warmup", default=1, show_default=True, help="Warm-up requests before measuring (not counted).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the JSON report here.")
@click.option("--plots", type=click.Path(file_okay=False, path_type=Path), help="Write PNG plots into this folder.")
@click.option("--seed", default=0, show_default=True, help="Workload seed (prompt lengths and texts).")
@click.option("--threads", type=click.IntRange(1), help="torch CPU threads for the engine and the baseline.")
@click.option("--prefix-caching", type=click.Choice(PREFIX_CACHING_MODES), default="auto", show_default=True,
              help="llmc's KV-cache prefix reuse while measuring (offline). auto: off with --baseline (transformers "
                   "recomputes every prompt, so reuse would flatter the ratios), else the build's "
                   "serving.enable_kv_cache_reuse; on / off: force it (on with --baseline is flagged in the report "
                   "and the plots). Each level reports the prompt tokens served from cached blocks. Synthetic "
                   "prompts never share a prefix, so reuse only matters for --prompts files.")
@click.option("--mixed-step-tokens", type=click.IntRange(0), default=None,
              help="Offline: the token budget of a step that carries decodes (prefill chunks ride along up to it), "
                   "instead of the build's serving.mixed_step_tokens; 0 = no budget (engine.max_num_tokens). Smaller "
                   "budgets cut ITL tails behind long prompts and cost TTFT. Reported per run.")
@click.option("--speculative-tokens", type=click.IntRange(0, MAX_DRAFT_TOKENS), default=None,
              help="Offline: draft tokens per step by prompt lookup (an output format's requests draft what it "
                   "allows), instead of the build's serving.speculative_tokens; 0 = off. The report counts the "
                   "drafts and those accepted.")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True,
              help="Measure every level this many times (levels interleaved, fresh prompts each time while the "
                   "workload lasts); TGS is the median repetition's, latencies pool all requests. For hosts with "
                   "noisy neighbours.")
@click.option("--step-log", type=click.Path(dir_okay=False, path_type=Path),
              help="Offline: keep the engine's metrics log here (JSON lines, warm-up included): a \"step\" "
                   "record per engine step (start, duration, decode and prefill tokens, running / waiting requests, "
                   "KV blocks) and a \"request\" record per request. Must be a new file.")
def bench_cmd(engine_dir: Path | None, url: str | None, protocol: str, model: str | None, tokenizer: Path | None,
              isl: int, osl: int, isl_dist: str, osl_dist: str, spread: float, num_prompts: int | None,
              prompts: Path | None, concurrency: str, temperature: float, top_p: float, top_k: int,
              sampling_seed: int | None, baseline: str | None, baseline_model: Path | None, device: str,
              warmup: int, json_out: Path | None, plots: Path | None, seed: int, threads: int | None,
              prefix_caching: str, repeat: int, speculative_tokens: int | None, mixed_step_tokens: int | None,
              step_log: Path | None) -> None:
    """Benchmark ENGINE_DIR offline (in-process) or a server with --url: TTFT, ITL, TGS per concurrency level."""
    if baseline and url:
        raise RequestError("baseline", "--baseline hf runs in-process; drop --url to compare against transformers")
    if url and mixed_step_tokens is not None:
        raise RequestError("mixed_step_tokens", "a server schedules steps as its build's serving.mixed_step_tokens "
                                                "says; drop --mixed-step-tokens with --url")
    if url and speculative_tokens is not None:
        raise RequestError("speculative_tokens", "a server drafts as its build's serving.speculative_tokens says; "
                                                 "drop --speculative-tokens with --url")
    if url and step_log is not None:
        raise RequestError("step_log", "a server's engine steps are not visible to a client; drop --step-log with "
                                       "--url")
    check_step_log(step_log)
    if url and prefix_caching != "auto":
        raise RequestError("prefix_caching", "a server reuses prefixes as its build's serving."
                                             "enable_kv_cache_reuse says; drop --prefix-caching with --url")
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": sampling_seed}
    execute(BenchOptions(engine_dir, url, protocol, model, tokenizer, isl, osl, isl_dist, osl_dist, spread,
                         num_prompts, prompts, parse_levels(concurrency), sampling, baseline, baseline_model, device,
                         max(0, warmup), json_out, plots, seed, threads, repeat, prefix_caching, mixed_step_tokens,
                         step_log, speculative_tokens))

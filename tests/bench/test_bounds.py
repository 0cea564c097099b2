"""Hardware bounds of a benchmark level: the 8B arithmetic of ../shared/reference/gpu-bounds.md, the two TGS bounds
of a round of fresh prompts, the report's flags for figures no GPU can produce, and no bound where peaks are unknown."""

from __future__ import annotations

import pytest

from llmc.bench.bounds import PEAKS, check, level_bound, linear_params, peaks_for, prompt_flops, step_weight_bytes
from llmc.bench.plan import BenchPlan
from llmc.bench.records import LevelResult, RequestRecord
from llmc.bench.report import build_report, print_report
from llmc.bench.workload import BenchPrompt

LLAMA8B = {"num_layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8, "head_size": 128,
           "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False, "dtype": "bfloat16"}
KV_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # 128 KiB
INT4_WEIGHTS = {"bfloat16": 2_103_058_432, "int32": 3_598_712_832}  # the 8B int4 twin on an H200 (llmc bench)
H200 = PEAKS["NVIDIA H200"]
HOST = {"bfloat16": 128256 * 4096 * 2}  # the input embedding in page-locked host memory (the engine's default)
INT4_ON_DEVICE = {"bfloat16": INT4_WEIGHTS["bfloat16"] - HOST["bfloat16"], "int32": INT4_WEIGHTS["int32"]}


def test_the_8b_shape_matches_the_reference_arithmetic():
    assert linear_params(LLAMA8B) == pytest.approx(6.98e9, rel=1e-3)
    flops = prompt_flops(LLAMA8B, 2048)
    assert flops == pytest.approx(29.7e12, rel=0.01)  # ~28.6 TFLOP of linears + ~1.1 of causal attention
    assert flops / H200.flops == pytest.approx(0.0376, rel=0.01)  # >= ~38 ms for a fresh 2,048-token prefill
    assert step_weight_bytes(LLAMA8B, INT4_WEIGHTS) == pytest.approx(4.65e9, rel=0.01)  # int4 + the bf16 lm_head
    tied = {**LLAMA8B, "tie_word_embeddings": True}
    assert step_weight_bytes(tied, INT4_WEIGHTS) == sum(INT4_WEIGHTS.values())


def test_an_embedding_in_host_memory_is_not_subtracted_from_the_device_weights_again():
    assert step_weight_bytes(LLAMA8B, INT4_ON_DEVICE, HOST) == step_weight_bytes(LLAMA8B, INT4_WEIGHTS)
    moved = level_bound([(2048, 128)], 1, 0, LLAMA8B, INT4_ON_DEVICE, KV_PER_TOKEN, H200, HOST)
    assert moved["tgs_max_prefill_then_decode"] == pytest.approx(730, rel=0.01)  # the same bound as on the device


def test_a_round_of_64_fresh_prompts_is_prefill_bound():
    bound = level_bound([(2048, 128)] * 64, 64, 0, LLAMA8B, INT4_WEIGHTS, KV_PER_TOKEN, H200)
    assert bound["decode_steps"] == 127
    assert bound["tgs_max"] == pytest.approx(64 * 128 / (64 * 0.0376), rel=0.01)  # the prefill alone: ~3,400
    assert bound["tgs_max_prefill_then_decode"] == pytest.approx(2703, rel=0.01)  # + 127 steps of >= 4.9 ms
    assert bound["ttft_p50_min_s"] == pytest.approx(0.0376, rel=0.01)
    one = level_bound([(2048, 128)], 1, 0, LLAMA8B, INT4_WEIGHTS, KV_PER_TOKEN, H200)
    assert one["tgs_max_prefill_then_decode"] == pytest.approx(730, rel=0.01)
    cached = level_bound([(2048, 128)], 1, 2016, LLAMA8B, INT4_WEIGHTS, KV_PER_TOKEN, H200)
    assert cached["ttft_p50_min_s"] is None and cached["prefill_tflop"] < 1.0  # hits: only 32 tokens' linears


def test_steps_are_at_least_the_longest_request_and_the_tokens_over_the_concurrency():
    assert level_bound([(10, 100), (10, 2)], 8, 0, LLAMA8B, INT4_WEIGHTS, KV_PER_TOKEN, H200)["decode_steps"] == 99
    assert level_bound([(10, 11)] * 10, 2, 0, LLAMA8B, INT4_WEIGHTS, KV_PER_TOKEN, H200)["decode_steps"] == 50


def test_the_h100_sxm_has_its_own_measured_peaks_and_its_figures_are_checked_against_them():
    h100 = peaks_for("cuda:0", "NVIDIA H100 80GB HBM3")
    assert h100 is PEAKS["NVIDIA H100 80GB HBM3"] and h100.bandwidth < H200.bandwidth
    assert peaks_for("cuda", "NVIDIA H100 PCIe") is None  # other memory and clocks: not measured, no bound
    # The int4 twin at concurrency 1 as measured on an H100 (2026-12-07 08:10): 16 requests, 362.3 tok/s, TTFT p50
    # 55.8 ms; the bounds there are ~550 tok/s (a fresh prefill >= 37 ms, then 127 steps of >= 1.5 ms) and ~654
    # (the decode bytes alone: a schedule overlapping the prefills).
    bound = level_bound([(2048, 128)] * 16, 1, 0, LLAMA8B, INT4_ON_DEVICE, KV_PER_TOKEN, h100, HOST)
    assert bound["tgs_max_prefill_then_decode"] == pytest.approx(550, rel=0.01)
    assert bound["tgs_max"] == pytest.approx(654, rel=0.01)
    assert check({"tgs": 362.3, "ttft_s": {"p50": 0.0558}}, bound) == []
    # 700 tok/s is faster than an H100 can go, and within the H200's bound.
    assert check({"tgs": 700.0, "ttft_s": {"p50": 0.0558}}, bound) != []
    assert level_bound([(2048, 128)] * 16, 1, 0, LLAMA8B, INT4_ON_DEVICE, KV_PER_TOKEN, H200, HOST)["tgs_max"] > 700


def _level(ttft: float, wall: float, hits: int = 0) -> LevelResult:
    records = tuple(RequestRecord(2048, 128, 0.0, tuple(ttft + 0.002 * i for i in range(128)), ttft + 0.3, "length")
                    for _ in range(4))
    return LevelResult(1, records, wall, prefix_cache={"queried_tokens": 8192, "hit_tokens": hits})


RUN = {"mode": "offline", "engine_dir": "x", "device": "cuda", "model_shape": LLAMA8B,
       "weight_bytes_on_device": INT4_WEIGHTS, "kv_bytes_per_token": KV_PER_TOKEN}
PLAN = BenchPlan(warmup=(), levels=((1, tuple(BenchPrompt("x", (0,) * 2048, 128) for _ in range(4))),))


def test_the_report_flags_figures_faster_than_the_gpu(monkeypatch):
    from rich.console import Console

    from llmc.bench import report as report_module

    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA H200"})
    honest = build_report(RUN, [_level(0.0537, 4 * 0.33)], PLAN, {})["levels"][0]
    assert honest["bound"]["problems"] == [] and honest["tgs"] < honest["bound"]["tgs_max"]
    # README's first H200 rows: 29 ms TTFT for fresh 2,048-token prompts (prefix-cache hits counted as none)
    wrong = build_report(RUN, [_level(0.029, 4 * 0.1)], PLAN, {})
    problems = wrong["levels"][0]["bound"]["problems"]
    assert any("TTFT p50 29.0 ms" in p for p in problems) and any("TGS" in p for p in problems)
    console = Console(width=200, record=True)
    print_report(wrong, console)
    assert "IMPOSSIBLE on this GPU" in console.export_text()
    hits = build_report(RUN, [_level(0.029, 4 * 0.3, hits=8000)], PLAN, {})["levels"][0]["bound"]
    assert hits["ttft_p50_min_s"] is None and not any("TTFT" in p for p in hits["problems"])


def test_a_report_from_an_h100_checks_its_levels_against_the_h100s_peaks(monkeypatch):
    from llmc.bench import report as report_module

    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA H100 80GB HBM3"})
    honest = build_report(RUN, [_level(0.0558, 4 * 0.353)], PLAN, {})["levels"][0]  # 362.7 tok/s, as measured
    assert honest["bound"]["problems"] == [] and honest["bound"]["peaks"].startswith("H100 SXM")
    fast = build_report(RUN, [_level(0.0558, 4 * 0.18)], PLAN, {})["levels"][0]  # 711 tok/s: past an H100's ~654
    assert any("TGS" in p for p in fast["bound"]["problems"])
    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA H200"})
    assert build_report(RUN, [_level(0.0558, 4 * 0.18)], PLAN, {})["levels"][0]["bound"]["problems"] == []


def test_no_bound_without_known_peaks_or_shape(monkeypatch):
    from llmc.bench import report as report_module

    assert peaks_for("cpu", "NVIDIA H200") is None and peaks_for("cuda", "NVIDIA A10") is None
    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA A10"})
    assert "bound" not in build_report(RUN, [_level(0.05, 1.3)], PLAN, {})["levels"][0]
    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA H200"})
    assert "bound" not in build_report({**RUN, "model_shape": None}, [_level(0.05, 1.3)], PLAN, {})["levels"][0]
    assert check({"tgs": None, "ttft_s": {"p50": None}}, {"tgs_max": 1.0, "ttft_p50_min_s": 1.0}) == []


def test_the_report_bounds_and_prints_an_engine_with_its_embedding_in_host_memory(monkeypatch):
    from rich.console import Console

    from llmc.bench import report as report_module

    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA H200"})
    embedding = 128256 * 4096 * 2
    run = {**RUN, "weight_bytes_on_device": {**INT4_WEIGHTS, "bfloat16": INT4_WEIGHTS["bfloat16"] - embedding},
           "weight_bytes_on_host": {"bfloat16": embedding}}
    on_host = build_report(run, [_level(0.0537, 4 * 0.33)], PLAN, {})
    on_device = build_report(RUN, [_level(0.0537, 4 * 0.33)], PLAN, {})
    assert on_host["levels"][0]["bound"] == on_device["levels"][0]["bound"]
    console = Console(width=200, record=True)
    print_report(on_host, console)
    text = console.export_text()
    assert "weights on the device: 4.65 GB" in text and "page-locked host memory" in text and "1.05 GB" in text
    assert "int4 kernel configs" not in text  # a report without int4 CUDA layers


def test_the_report_says_whose_int4_kernel_configs_the_layers_ran(monkeypatch):
    from rich.console import Console

    from llmc.bench import report as report_module

    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA H100 PCIe"})
    configs = {"6144x4096g128": "NVIDIA H100 80GB HBM3", "4096x4096g128": "NVIDIA H100 80GB HBM3",
               "4608x3584g128": "NVIDIA H100 80GB HBM3, shape 6144x4096g128", "960x576g64": "heuristics"}
    report = build_report({**RUN, "int4_kernel_configs": configs}, [_level(0.0537, 4 * 0.33)], PLAN, {})
    assert report["int4_kernel_configs"] == configs
    console = Console(width=300, record=True)
    print_report(report, console)
    assert ("int4 kernel configs: NVIDIA H100 80GB HBM3 (2 shapes); NVIDIA H100 80GB HBM3, shape 6144x4096g128 "
            "(1 shapes); heuristics (1 shapes); `llmc tune x` tunes them here") in console.export_text()
    # every shape on this GPU's own configs (shipped or tuned here): nothing to suggest
    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA H100 80GB HBM3"})
    own = {"6144x4096g128": "NVIDIA H100 80GB HBM3", "4608x3584g128": "NVIDIA H100 80GB HBM3 (llmc tune's table)"}
    report = build_report({**RUN, "engine_dir": "/b/qwen", "int4_kernel_configs": own}, [_level(0.0537, 4 * 0.33)],
                          PLAN, {})
    console = Console(width=300, record=True)
    print_report(report, console)
    text = console.export_text()
    assert "int4 kernel configs: NVIDIA H100 80GB HBM3 (1 shapes); NVIDIA H100 80GB HBM3 (llmc tune's table) " \
           "(1 shapes)\n" in text and "llmc tune" not in text.replace("(llmc tune's table)", "")
    report = build_report({**RUN, "engine_dir": "/b/qwen", "int4_kernel_configs": {**own, "1x1g64": "heuristics"}},
                          [_level(0.0537, 4 * 0.33)], PLAN, {})
    console = Console(width=300, record=True)
    print_report(report, console)
    assert "heuristics (1 shapes); `llmc tune /b/qwen` tunes them here" in console.export_text()


def test_the_triton_kernels_tuned_for_this_gpu_need_no_tuning_hint_and_borrowed_ones_get_it(monkeypatch):
    """Engines without llmc's CUDA library run the Triton kernels: their layers say "Triton: <whose>"; this GPU's own
    (shipped or from llmc tune) get no hint, another GPU's or the heuristics do."""
    from rich.console import Console

    from llmc.bench import report as report_module

    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA H100 80GB HBM3"})

    def printed(configs: dict) -> str:
        report = build_report({**RUN, "engine_dir": "/b/q", "int4_kernel_configs": configs},
                              [_level(0.0537, 4 * 0.33)], PLAN, {})
        console = Console(width=300, record=True)
        print_report(report, console)
        return console.export_text()

    own = {"6144x4096g128": "Triton: NVIDIA H100 80GB HBM3",
           "4608x3584g128": "Triton: NVIDIA H100 80GB HBM3 (llmc tune's table)",
           "3584x3584g128": "Triton: NVIDIA H100 80GB HBM3 (LLMC_INT4_CONFIGS=/t.json)"}  # llmc tune --out's
    assert "tunes them here" not in printed(own)
    assert "tunes them here" not in printed({"1x1g64": "NVIDIA H100 80GB HBM3 (LLMC_INT4_CONFIGS=/t.json)"})
    assert "tunes them here" in printed({"1x1g64": "NVIDIA H100 80GB HBM3, shape 6144x4096g128 (llmc tune's table)"})
    assert ("Triton: NVIDIA H200 (1 shapes); `llmc tune /b/q` tunes them here" in
            printed({**own, "4096x4096g128": "Triton: NVIDIA H200"}))
    heuristic = printed({"1x1g64": "Triton: heuristics"})
    assert "Triton: heuristics (1 shapes); `llmc tune /b/q` tunes them here" in heuristic


def test_the_report_names_the_kv_caches_dtype_and_why_a_recipes_fp8_ran_16bit(monkeypatch):
    from rich.console import Console

    from llmc.bench import report as report_module

    monkeypatch.setattr(report_module, "host_info", lambda: {"cuda_device": "NVIDIA H100 80GB HBM3"})
    texts = []
    for dtype, per_token, why in (("float8_e4m3fn", 65536, None),
                                  ("bfloat16", 131072, "kv_cache.dtype fp8 runs as bfloat16 here: LLMC_KV_FP8=0")):
        report = build_report({**RUN, "kv_cache_dtype": dtype, "kv_bytes_per_token": per_token,
                               "kv_cache_fallback": why}, [_level(0.0537, 4 * 0.33)], PLAN, {})
        console = Console(width=300, record=True)
        print_report(report, console)
        texts.append(console.export_text())
    assert "KV cache: float8_e4m3fn, 65,536 bytes a token\n" in texts[0]
    assert "KV cache: bfloat16, 131,072 bytes a token (kv_cache.dtype fp8 runs as bfloat16 here: LLMC_KV_FP8=0)" \
        in texts[1]

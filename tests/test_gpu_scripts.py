"""The GPU measurement and tuning scripts' own arithmetic, on CPU: decode_steps.py (steps, busy and idle time, kinds),
bench_linears.py, tune_int4_cuda.py, tune_step_order.py and sass_diff.py. Running the scripts: tests/test_scripts.py."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    """scripts/<name>.py as a module (the scripts are not on the import path)."""
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(f"scripts.{name}")
    finally:
        sys.path.remove(str(ROOT))


def test_mixed_step_puts_the_chunk_after_the_decodes_blocks():
    mixed_step = script("decode_steps").mixed_step
    step = mixed_step(3, 40, 8, 16, block_size=16, vocab_size=100)
    *decodes, chunk = step.sequences
    assert [len(s.token_ids) for s in decodes] == [1, 1, 1] and all(s.num_computed == 40 for s in decodes)
    assert chunk.num_computed == 16 and len(chunk.token_ids) == 8 and chunk.sample
    assert chunk.block_ids == (9, 10)  # 3 decodes x 3 blocks of 16 for 41 tokens, then 2 blocks for 24 tokens
    used = [b for s in step.sequences for b in s.block_ids]
    assert len(used) == len(set(used))


def test_bench_linears_sums_the_shapes_per_row_count():
    totals = script("bench_linears").totals
    per_shape = {"qkv": {"int4": {1: 0.2, 2048: 5.0}, "bf16": {1: 0.6, 2048: 4.0},
                         "bf16_gemm_only": {1: 0.6, 2048: 4.0}},
                 "fc_gate": {"int4": {1: 0.6, 2048: 25.0}, "bf16": {1: 1.8, 2048: 23.0},
                             "bf16_gemm_only": {1: 1.7, 2048: 22.0}}}
    out = totals(per_shape)
    assert out[1] == {"int4": 0.8, "bf16": 2.4, "bf16_gemm_only": 2.3, "int4_over_bf16": 0.333,
                      "int4_over_bf16_gemm_only": 0.348}
    assert out[2048]["int4"] == 30.0 and out[2048]["bf16"] == 27.0 and out[2048]["int4_over_bf16"] == 1.111
    assert out[2048]["int4_over_bf16_gemm_only"] == round(30.0 / 26.0, 3)


def test_bench_linears_timeline_gives_each_shape_what_its_kernels_add_to_the_step():
    added_us = script("bench_linears").added_us
    # two layers of qkv, o, fc + gate, down: kernels overlap, so a kernel adds its end minus the previous one's
    ends = [10.0, 15.0, 34.0, 46.0, 53.5, 58.7, 77.2, 89.0]
    assert added_us(ends) == {"qkv": 7.5, "o": 5.1, "fc_gate": 18.75, "down": 11.9}  # the first kernel left out
    assert added_us([3.0]) == {}


def test_the_step_table_sums_only_what_was_timed():
    """``--only-dense`` times no bucket: the decode-step table then holds the dense row counts alone (each the faster
    of the kernel and dequantize + cuBLAS, summed over the shapes)."""
    module = script("tune_int4_cuda")
    MMA, step_table = module.MMA, module.step_table
    shapes = [("a", 64, 64, 64, False, False), ("b", 128, 64, 64, False, False)]
    cell = {"dequant_cublas_us": 900.0, "kernel_us": 1200.0, "cublas_bf16_us": 600.0}
    report = {"64x64g64": {f"mma_dense_{m}": cell for m in MMA.report_ms},
              "128x64g64": {f"mma_dense_{m}": {**cell, "kernel_us": 800.0} for m in MMA.report_ms}}
    rows = step_table(report, shapes, MMA)
    assert [row["M"] for row in rows] == list(MMA.report_ms)
    assert rows[0] == {"M": MMA.report_ms[0], "int4_ms": 1.7, "bf16_ms": 1.2, "bf16_over_int4": 0.71}
    report["64x64g64"]["mma_16"] = {"us_32_layers": 100.0, "cublas_bf16_us_32_layers": 300.0}  # one shape only
    assert [row["M"] for row in step_table(report, shapes, MMA)] == list(MMA.report_ms)


def test_gpu_busy_time_counts_overlapping_kernels_once():
    """decode_steps' busy time is the union of kernel intervals: kernels launched programmatically overlap their
    predecessors, so the sum of their durations (2.7 ms here) overstates the time the GPU ran (2.1 ms)."""
    busy_ms = script("decode_steps").busy_ms
    spans = [(1000.0, 2000.0), (1500.0, 2500.0), (1600.0, 1700.0), (3000.0, 3500.0), (2500.0, 2600.0)]
    assert busy_ms(spans) == pytest.approx(1.6 + 0.5)  # [1000, 2600) and [3000, 3500)
    assert busy_ms([]) == 0.0 and busy_ms([(5.0, 5.0)]) == 0.0
    assert busy_ms(list(reversed(spans))) == busy_ms(spans)


def test_decode_steps_largest_gaps_name_the_kernels_around_each_idle_stretch():
    largest_gaps = script("decode_steps").largest_gaps
    spans = [(0.0, 100.0, "a"), (50.0, 300.0, "b"), (340.0, 400.0, "c"), (400.0, 410.0, "d"), (500.0, 600.0, "e"),
             (90_000.0, 90_100.0, "next step")]  # 89,400 us later: another profiled step, not a gap
    assert largest_gaps(spans) == [{"us": 90.0, "after": "d", "before": "e"},
                                   {"us": 40.0, "after": "b", "before": "c"}]
    assert largest_gaps(spans, top=1) == [{"us": 90.0, "after": "d", "before": "e"}]


def test_decode_steps_kinds_count_every_int4_kernel_as_an_int4_matmul():
    kind_of = script("decode_steps").kind_of
    for name in ("void (anonymous namespace)::w4a16_pipe_kernel<__nv_bfloat16, 1, 2, 4, 2>(",
                 "void (anonymous namespace)::w4a16_reg_kernel<__nv_bfloat16, 1, 1, 8, 8>(", "w4a16_matmul"):
        assert kind_of(name) == "int4 matmul (llmc)", name
    assert kind_of("w4a16_mma_dequant_kernel") == "int4 dequantize (llmc)"
    assert kind_of("paged_decode_combine") == "attention split merge (llmc)"
    assert kind_of("paged_decode") == "attention (llmc paged decode)"


def test_decode_steps_idle_time_adds_up_by_the_kinds_of_kernel_around_it():
    idle_by_kinds = script("decode_steps").idle_by_kinds
    spans = [(0.0, 100.0, "gemm_a"), (110.0, 200.0, "w4a16_mma_dequant_kernel"), (230.0, 300.0, "gemm_b"),
             (340.0, 400.0, "w4a16_mma_dequant_kernel"), (400.0, 500.0, "nvjet_gemm"), (505.0, 600.0, "silu_mul_k"),
             (60_000.0, 60_100.0, "gemm_next_step")]  # beyond 20 ms: between profiled steps, not counted
    idle = idle_by_kinds(spans)
    assert list(idle) == ["cuBLAS GEMM -> int4 dequantize", "int4 dequantize -> cuBLAS GEMM",
                          "cuBLAS GEMM -> SiLU x gate"]  # largest first
    assert idle == pytest.approx({"cuBLAS GEMM -> int4 dequantize": 0.05, "int4 dequantize -> cuBLAS GEMM": 0.03,
                                  "cuBLAS GEMM -> SiLU x gate": 0.005})


def test_decode_steps_added_time_attributes_the_step_span_to_kinds_exactly():
    added_by_kind = script("decode_steps").added_by_kind
    # a norm, an int4 kernel started early inside it (programmatic launch), attention after an idle gap, a kernel
    # ending inside the attention (adds nothing), then the next profiled step 60 ms later (counted from its start)
    spans = [(0.0, 10.0, "add_rms_norm_k"), (5.0, 30.0, "w4a16_pipe_kernel"), (40.0, 60.0, "paged_decode_k"),
             (45.0, 50.0, "add_rms_norm_k"), (60_000.0, 60_008.0, "add_rms_norm_k")]
    added = added_by_kind(spans)
    assert added == pytest.approx({"int4 matmul (llmc)": 0.020, "attention (llmc paged decode)": 0.030,
                                   "add + RMSNorm (llmc)": 0.018})
    assert list(added)[0] == "attention (llmc paged decode)"  # largest first
    assert sum(added.values()) == pytest.approx((60.0 + 8.0) / 1e3)  # the two steps' spans


SASS = """
\t\tFunction : _ZN4kern1aEv
        /*0000*/                   LDC R1, c[0x0][0x28] ;                /* 0x00000a00ff017b82 */
                                                                        /* 0x000fe20000000800 */
        /*0010*/               @P0 BRA 0x70 ;                          /* 0x0000000000000947 */
        /*0020*/                   EXIT ;                               /* 0x000000000000794d */
\t\tFunction : _ZN4kern1bELi0EEEv
        /*0000*/                   LDC R1, c[0x0][0x30] ;                /* 0x00000a00ff017b82 */
        /*0010*/                   EXIT ;                               /* 0x000000000000794d */
"""


def test_sass_diff_reads_opcodes_and_names_the_kernels_whose_code_changed():
    module = script("sass_diff")
    compare, kernels = module.compare, module.kernels
    new = kernels(SASS)
    assert new == {"_ZN4kern1aEv": ["LDC", "BRA", "EXIT"], "_ZN4kern1bELi0EEEv": ["LDC", "EXIT"]}
    # operands and predicates do not count (parameter offsets move with the parameters); opcodes do
    old = {"_ZN4kern1aEv": ["LDC", "BRA", "EXIT"], "_ZN4kern1bEEv": ["LDC", "LDC", "EXIT"], "_ZN4kern1cEv": ["EXIT"]}
    report = compare(old, new, renames=[("ELi0EEEv", "EEv")])
    assert report["same"] == ["_ZN4kern1aEv"] and report["missing"] == ["_ZN4kern1cEv"] and report["added"] == []
    assert report["changed"] == [{"kernel": "_ZN4kern1bEEv", "instructions": [3, 2], "opcodes": {"LDC": [2, 1]}}]
    unrenamed = compare(old, new)
    assert unrenamed["added"] == ["_ZN4kern1bELi0EEEv"] and "_ZN4kern1bEEv" in unrenamed["missing"]
    assert compare(old, new, match="kern1a") == {"same": ["_ZN4kern1aEv"], "changed": [], "missing": [], "added": []}


def test_step_order_tuning_takes_the_reports_fastest_configs_and_keeps_only_real_gains():
    module = script("tune_step_order")
    bucket_configs, descend, missing_inputs = module.bucket_configs, module.descend, module.missing_inputs
    set_bucket, top_candidates = module.set_bucket, module.top_candidates
    tried = {"[1, 1, 8, 2]": 206.4, "[1, 2, 8, 2]": 218.0, "[1, 4, 4, 2]": 296.4, "[2, 1, 4, 8]": "wrong: rel err 1",
             "[1, 1, 8, 4]": 220.3}
    assert top_candidates(tried, [1, 1, 8, 2], 2) == [(1, 1, 8, 2), (1, 2, 8, 2)]
    assert top_candidates(tried, [1, 4, 4, 2], 2) == [(1, 1, 8, 2), (1, 2, 8, 2), (1, 4, 4, 2)]  # the table's own
    # a step whose time is each shape's cost, plus a penalty when o follows a qkv config of 8 warps
    cost = {"qkv": {(1, 1, 8, 2): 1.0, (1, 2, 4, 2): 1.1}, "o": {(1, 2, 16, 2): 1.0, (1, 1, 8, 0): 1.2},
            "down": {(1, 2, 16, 2): 2.0, (1, 2, 16, 4): 1.999}}
    calls = []

    def seconds_of(configs):
        calls.append(dict(configs))
        step = sum(cost[shape][config] for shape, config in configs.items())
        return step + (0.5 if configs["qkv"][2] == 8 and configs["o"] == (1, 2, 16, 2) else 0.0)

    start = {"qkv": (1, 1, 8, 2), "o": (1, 2, 16, 2), "down": (1, 2, 16, 2)}  # each shape's own fastest
    chosen, log = descend(start, {shape: list(cost[shape]) for shape in cost}, seconds_of)
    # qkv's fastest config alone costs more before o's: the step takes the other; down's 0.02 % is below min_gain
    assert chosen == {"qkv": (1, 2, 4, 2), "o": (1, 2, 16, 2), "down": (1, 2, 16, 2)}
    assert seconds_of(chosen) < seconds_of(start)
    assert [r["shape"] for r in log] == ["qkv", "o", "down"] * 2  # the second pass changed nothing: stop
    assert all(len(r["us"]) == 2 for r in log)  # the incumbent timed again next to each candidate
    table = {"devices": {"GPU": {"k1": {"mma": {"buckets": [[1, 1, 1, 8, 2], [8, 1, 2, 8, 2]]}}}}}
    assert bucket_configs(table, "GPU", {"qkv": "k1"}, 8) == {"qkv": (1, 2, 8, 2)}
    set_bucket(table, "GPU", {"qkv": "k1"}, 8, {"qkv": (1, 4, 4, 2)})
    assert table["devices"]["GPU"]["k1"]["mma"]["buckets"] == [[1, 1, 1, 8, 2], [8, 1, 4, 4, 2]]
    report = {"shapes": {"k1": {"mma_8": {"tried_us": tried}}}}
    buckets = [(1, 1), (8, 8), (16, 16)]
    assert missing_inputs(report, table, "GPU", {"qkv": "k1"}, [8], buckets) == []
    assert missing_inputs(report, table, "GPU", {"qkv": "k1"}, [1, 16, 5], buckets) == [
        "row count 5 is not a tuned mma bucket ([1, 8, 16])", "the report has no timings of qkv (k1) at 1 rows",
        "the report has no timings of qkv (k1) at 16 rows", "the table has no GPU mma bucket of qkv (k1) up to 16 rows"]


def test_tuning_the_shapes_of_a_build_says_what_is_wrong_as_the_scripts_error(tmp_path):
    """``--shapes-of`` reads a build's shapes with ``int4_tune.build_shapes`` (tests/engine/torch/test_int4_tune.py)
    and stops with its message."""
    with pytest.raises(SystemExit, match=f"--shapes-of {tmp_path / 'nothing'}: .*config.json is missing"):
        script("tune_int4_cuda").ir_shapes(tmp_path / "nothing")

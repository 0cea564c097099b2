"""Tuning the int4 CUDA kernels (``int4_tune``, what ``llmc tune`` runs): a build's shapes, the tables it writes, and,
on a GPU, a tuned shape that the next layer of that shape runs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from llmc.engine.torch import int4_configs
from llmc.engine.torch.int4_tune import build_shapes, layer_copies, merge_buckets, save_table
from llmc.errors import EngineError
from tests.engine.torch.helpers import w4a16_ir

QWEN7B = [("qkv", 4608, 3584, 128, False, False), ("o", 3584, 3584, 128, False, True),
          ("fc_gate", 37888, 3584, 128, True, False), ("down", 3584, 18944, 128, False, True)]


def test_the_shapes_of_a_build_are_its_int4_layers_as_the_loader_builds_them(tmp_path):
    build = tmp_path / "build"
    w4a16_ir(build / "checkpoint")
    assert build_shapes(build) == QWEN7B == build_shapes(build / "checkpoint")
    with pytest.raises(EngineError, match="no W4A16 layer of whole 16 x 64 tiles to tune. Fix: give an AWQ int4"):
        build_shapes(w4a16_ir(tmp_path / "bf16", quantized=False))
    with pytest.raises(EngineError, match=f"{tmp_path / 'nothing'}: .*config.json is missing"):
        build_shapes(tmp_path / "nothing")


def test_tuning_some_row_buckets_keeps_the_others_and_the_dense_threshold():
    old = {"buckets": [[1, 1, 1, 8, 2], [8, 1, 2, 8, 2], [16, 2, 4, 8, 4], [64, 4, 4, 4, 2]], "dense_from_m": 256}
    merged = merge_buckets(old, [[1, 1, 1, 8, 0], [16, 2, 4, 4, 2]])
    assert merged == {"buckets": [[1, 1, 1, 8, 0], [8, 1, 2, 8, 2], [16, 2, 4, 4, 2], [64, 4, 4, 4, 2]],
                      "dense_from_m": 256}
    assert old["buckets"][0] == [1, 1, 1, 8, 2]  # the table's entry itself is not changed
    with pytest.raises(ValueError, match=r"buckets \[32\] are not in the table's entry"):
        merge_buckets(old, [[32, 4, 4, 8, 2]])


def test_a_shape_is_timed_over_as_many_weight_copies_as_half_the_free_memory_holds():
    n, k = 37888, 3584  # Qwen2.5-7B's fc + gate
    per_copy, shared = n * k * 5 // 2, 8 * 2048 * n * 4 + 2 * n * k  # ~340 MB a copy, ~2.8 GB of shared buffers
    assert layer_copies(n, k, free_bytes=80 << 30) == 32  # an 80 GB GPU: all 32
    assert layer_copies(n, k, free_bytes=2 * (shared + 20 * per_copy)) == 20
    assert layer_copies(n, k, free_bytes=6 << 30) == 4  # a nearly full GPU: the floor


def tuned_table(gpu: str, shape: str, bucket: list[int]) -> dict:
    return {"version": 2, "gpus": {gpu: {"capability": "8.9", "multiprocessors": 142}},
            "devices": {gpu: {shape: {"mma": {"buckets": [bucket], "dense_from_m": 96}}}}}


def test_a_saved_table_keeps_the_other_gpus_and_shapes_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "cuda" / "int4_cuda_configs.json"
    save_table(path, tuned_table("L40S", "4608x3584g128", [1, 1, 2, 8, 2]))  # the folder is made
    save_table(path, tuned_table("L40S", "3584x3584g128", [1, 1, 1, 8, 4]))
    merged = save_table(path, tuned_table("A10", "4608x3584g128", [1, 1, 4, 4, 2]))
    assert json.loads(path.read_text()) == merged
    assert merged["devices"]["L40S"]["4608x3584g128"]["mma"]["buckets"] == [[1, 1, 2, 8, 2]]
    assert merged["devices"]["L40S"]["3584x3584g128"]["mma"]["buckets"] == [[1, 1, 1, 8, 4]]
    assert set(merged["gpus"]) == {"L40S", "A10"} and "mma_table" not in json.dumps(merged)
    merged = save_table(path, tuned_table("L40S", "4608x3584g128", [8, 1, 4, 8, 2]))  # tuned again: replaced
    assert merged["devices"]["L40S"]["4608x3584g128"]["mma"]["buckets"] == [[8, 1, 4, 8, 2]]
    assert sorted(p.name for p in path.parent.iterdir()) == ["int4_cuda_configs.json"]


def test_an_unreadable_table_is_not_overwritten(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text("[1, 2]")
    with pytest.raises(EngineError, match=f"{path} \\(the table to merge into\\): not a table of tuned configs.*"
                                          "Fix: give another file, or move this one away"):
        save_table(path, tuned_table("L40S", "4608x3584g128", [1, 1, 2, 8, 2]))
    assert path.read_text() == "[1, 2]" and sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]


@pytest.mark.gpu
def test_a_shape_tuned_here_is_what_the_next_layer_of_that_shape_runs(tmp_path, monkeypatch):
    """SmolLM2's o projection (input scale in the kernel) tuned at 1 and 16 rows: each bucket's config is the fastest
    of those timed, the one the layer ran before among them; saved as this machine's table, a new layer of the shape
    runs it, says so, and matches a float32 product."""
    from llmc.engine.torch.int4_tune import MMA, tune_build

    spec = ("o", 576, 576, 64, False, True)
    family = dataclasses.replace(MMA, buckets=[(1, 1), (16, 16)], dense_ms=(32,), report_ms=(32,))
    table, report = tune_build([spec], log=lambda line: None, family=family, step_rows=(1,))
    gpu = torch.cuda.get_device_name()
    entry = table["devices"][gpu]["576x576g64"]["mma"]
    assert [b[0] for b in entry["buckets"]] == [1, 16] and entry["dense_from_m"] == 32
    step = report["step_order"][1]  # the 1-row bucket chosen again in step order (one shape: o after o)
    assert entry["buckets"][0][1:] == step["chosen"]["o"] and set(step) >= {"before_ms", "per_shape_ms", "chosen_ms"}
    assert entry["buckets"][1][1:] == report["shapes"]["576x576g64"]["mma_16"]["best"]  # not in step order
    for m in (1, 16):
        cell = report["shapes"]["576x576g64"][f"mma_{m}"]
        timed = {label: us for label, us in cell["tried_us"].items() if isinstance(us, float)}
        assert cell["us_32_layers"] == min(timed.values()) and cell["best"] in [json.loads(k) for k in timed]
        before = cell["before"]
        assert str(before["config"]) in cell["tried_us"] and cell["us_32_layers"] <= before["us_32_layers"]
    check_new_layer_runs(tmp_path, monkeypatch, table, "mma", f"{gpu} (llmc tune's table)",
                         [tuple(bucket[1:]) for bucket in entry["buckets"]])


def test_the_triton_tuning_compiles_each_config_of_a_shape_once_at_the_fewest_rows_it_runs():
    from llmc.engine.torch.int4_tune_triton import TRITON, candidates, compile_jobs, tried_configs

    shapes = [("o", 576, 576, 64, False, True), ("qkv", 960, 576, 64, False, False)]
    jobs = compile_jobs(shapes)
    per_shape = {name: [(values, rows) for spec, values, rows in jobs if spec[0] == name] for name, *_ in shapes}
    configs = {tuple(c.to_list()) for _, c in tried_configs(576)}
    assert len(per_shape["o"]) == len(per_shape["qkv"]) == len(configs)  # each distinct config once a shape
    assert {tuple(v) for v, _ in per_shape["o"]} == configs
    rows = dict((tuple(v), r) for v, r in per_shape["o"])
    assert rows[tuple(candidates(1)[0].to_list())] == 1  # tried first at 1 row (the 1- and 16-row lists are one)
    assert rows[tuple(candidates(64)[0].to_list())] == 64 and rows[(128, 128, 1, 8, 3, 1)] == 128  # from 65 rows
    assert len(compile_jobs(shapes, quick=frozenset({"576x576g64"}))) < len(jobs)
    assert TRITON.prefix == "triton_" and [m for _, m in TRITON.buckets] == [1, 16, 32, 64, 128, 256]


@pytest.mark.gpu
def test_the_triton_kernels_tuned_here_are_what_the_next_triton_layer_of_that_shape_runs(tmp_path, monkeypatch):
    """Where llmc's CUDA library cannot run, llmc tune tunes the Triton kernels: SmolLM2's o (input scale in the
    kernel) at 1 and 16 rows over a few candidates, compiled as they are tried; each bucket's config is the fastest
    timed, the one the layer ran before among them; saved as this machine's table, a new Triton layer of the shape
    runs it, says so, and matches a float32 product."""
    from llmc.engine.torch.int4_configs import KernelConfig
    from llmc.engine.torch.int4_tune_triton import TRITON, candidates, tune_build_triton

    spec = ("o", 576, 576, 64, False, True)
    family = dataclasses.replace(TRITON, buckets=[(1, 1), (16, 16)], dense_ms=(128,), report_ms=(128,),
                                 candidates=lambda m, quick: candidates(m, quick=True))
    table, report = tune_build_triton([spec], log=lambda line: None, family=family, workers=1)
    gpu = torch.cuda.get_device_name()
    entry = table["devices"][gpu]["576x576g64"]
    assert [b[0] for b in entry["buckets"]] == [1, 16] and entry["dense_from_m"] == 128 and "mma" not in entry
    for m, bucket in ((1, 0), (16, 1)):
        cell = report["shapes"]["576x576g64"][f"triton_{m}"]
        timed = {label: us for label, us in cell["tried_us"].items() if isinstance(us, float)}
        assert cell["us_32_layers"] == min(timed.values()) and entry["buckets"][bucket][1:] == cell["best"]
        assert str(cell["before"]["config"]) in cell["tried_us"] and cell["us_32_layers"] <= cell["before"][
            "us_32_layers"]
    check_new_layer_runs(tmp_path, monkeypatch, table, "triton", f"Triton: {gpu} (llmc tune's table)",
                         [KernelConfig(*bucket[1:]) for bucket in entry["buckets"]])


def check_new_layer_runs(tmp_path, monkeypatch, table: dict, backend: str, said: str, configs: list) -> None:
    """Saved as this machine's table, ``table`` is what a new layer of SmolLM2's o (input scale in the kernel) on
    ``backend`` runs: it says so (``said``), runs ``configs`` at 1 and 16 rows, and matches a float32 product."""
    from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4
    from llmc.engine.torch.int4_cuda import Int4CudaLinear, Scratch

    local = tmp_path / "int4_cuda_configs.json"
    save_table(local, table)
    monkeypatch.setattr(int4_configs, "local_table_path", lambda: local)
    int4_configs._tuned_table.cache_clear()
    try:
        gen = torch.Generator(device="cuda").manual_seed(3)
        q = torch.randint(-8, 8, (576, 576), generator=gen, dtype=torch.int8, device="cuda")
        scales = (torch.rand(576, 9, generator=gen, device="cuda") * 0.01 + 0.002).bfloat16()
        pq = (torch.rand(576, generator=gen, device="cuda") + 0.5).bfloat16()
        layer = Int4CudaLinear.from_ir([(pack_int4(q), scales)], pq, 64, Scratch(torch.bfloat16, torch.device("cuda")),
                                       backend=backend)
        layer.scratch.allocate()
        assert layer.configs_from == said
        weight = dequantize_w4a16(pack_int4(q), scales, pq, 64)
        for m, config in zip((1, 16), configs, strict=True):
            assert (layer.mma_config_for(m) if backend == "mma" else layer.config_for(m)) == config
            x = torch.randn(m, 576, generator=gen, device="cuda").bfloat16()
            ref = x.float() @ weight.T
            assert ((layer(x).float() - ref).norm() / ref.norm()).item() < 8e-3
    finally:
        int4_configs._tuned_table.cache_clear()

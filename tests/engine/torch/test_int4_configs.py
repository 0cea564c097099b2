"""Whose tuned int4 kernel configs a GPU runs: its own, else those of the tuned GPU of its compute capability."""

from __future__ import annotations

import json

import pytest
import torch

from llmc.engine.torch import int4_configs
from llmc.engine.torch.int4_configs import CONFIG_FILE, config_devices, tuned_entry

SHAPE = "4096x4096g128"
TRITON = {"buckets": [[1, 16, 64, 1, 2, 3, 8]], "dense_from_m": 128}  # the Triton fallback's keys
TRITON_A = {**TRITON, "triton_gpu": "A"}  # as tuned_entry gives them: A's
MMA_A = {"mma": {"buckets": [[1, 1, 2, 16, 2]], "dense_from_m": 160}}
MMA_B = {"mma": {"buckets": [[1, 1, 4, 8, 4]], "dense_from_m": 256}}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A table of three tuned GPUs: A (9.0, 132 multiprocessors: both kernel families), B (9.0, 114: the CUDA
    library's only), C (8.0)."""
    data = {"version": 2,
            "gpus": {"A": {"capability": "9.0", "multiprocessors": 132},
                     "B": {"capability": "9.0", "multiprocessors": 114},
                     "C": {"capability": "8.0", "multiprocessors": 108}},
            "devices": {"A": {SHAPE: {**TRITON, **MMA_A}}, "B": {SHAPE: MMA_B}, "C": {SHAPE: MMA_A}}}
    (tmp_path / "t.json").write_text(json.dumps(data))
    monkeypatch.setattr(int4_configs, "CONFIG_FILE", tmp_path / "t.json")
    int4_configs._tuned_table.cache_clear()
    yield data
    int4_configs._tuned_table.cache_clear()


def test_a_tuned_gpu_runs_its_own_configs_first_then_its_closest_sibling(table):
    assert config_devices("A", "9.0", 132) == ["A", "B"]
    assert config_devices("B", "9.0", 114) == ["B", "A"]
    assert config_devices("C", "8.0", 108) == ["C"]  # no other tuned GPU of 8.0
    assert config_devices("A") == ["A"]  # no capability given: its own entry only


def test_an_untuned_gpu_borrows_the_closest_tuned_gpu_of_its_compute_capability(table):
    assert config_devices("New Hopper", "9.0", 120) == ["B"]  # 6 multiprocessors from B, 12 from A
    assert config_devices("New Hopper", "9.0", 130) == ["A"]
    assert config_devices("New Ada", "8.9", 128) == []  # no tuned GPU of 8.9: the heuristics
    assert tuned_entry("New Ada", 4096, 4096, 128, "8.9", 128) is None
    assert tuned_entry("New Hopper", 4096, 4096, 128) is None  # without its capability nothing is borrowed
    assert tuned_entry("New Hopper", 4096, 4096, 128, "9.0", 130) == {**TRITON_A, **MMA_A, "mma_gpu": "A"}


def test_each_kernel_family_comes_from_the_first_gpu_that_has_it(table):
    # B's own CUDA-library configs; the Triton fallback's from A, which B has none of
    assert tuned_entry("B", 4096, 4096, 128, "9.0", 114) == {**TRITON_A, **MMA_B, "mma_gpu": "B"}
    assert tuned_entry("A", 4096, 4096, 128, "9.0", 132) == {**TRITON_A, **MMA_A, "mma_gpu": "A"}
    assert tuned_entry("B", 4096, 4096, 128) == {**MMA_B, "mma_gpu": "B"}
    # a shape nobody tuned: the CUDA library's configs of the nearest shape, never the Triton fallback's
    assert tuned_entry("B", 576, 576, 64, "9.0", 114) == {**MMA_B, "mma_gpu": "B", "mma_from": SHAPE}


def test_the_triton_configs_tuned_here_go_over_those_borrowed_and_say_where_they_come_from(table, tmp_path,
                                                                                         monkeypatch):
    """What ``llmc tune`` writes where the Triton kernels run: B's own Triton entry (from this machine's table) over
    A's shipped one, marked as this machine's; A keeps its own; a GPU that borrows gets no mark of B's table."""
    local = tmp_path / "cache" / "int4_cuda_configs.json"
    monkeypatch.setattr(int4_configs, "local_table_path", lambda: local)
    local.parent.mkdir()
    mine = {"buckets": [[1, 16, 32, 1, 2, 3, 4]], "dense_from_m": 256}
    local.write_text(json.dumps({"version": 2, "devices": {"B": {SHAPE: mine}}}))
    int4_configs._tuned_table.cache_clear()
    assert tuned_entry("B", 4096, 4096, 128, "9.0", 114) == {**mine, **MMA_B, "mma_gpu": "B", "triton_gpu": "B",
                                                              "triton_table": "llmc tune's table"}
    assert tuned_entry("A", 4096, 4096, 128, "9.0", 132) == {**TRITON_A, **MMA_A, "mma_gpu": "A"}
    assert tuned_entry("New Hopper", 4096, 4096, 128, "9.0", 120) == {
        **mine, **MMA_B, "mma_gpu": "B", "triton_gpu": "B", "triton_table": "llmc tune's table"}  # B's, borrowed
    assert "buckets" not in tuned_entry("B", 4608, 3584, 128, "9.0", 114)  # no nearest shape for the Triton kernels


def test_a_shape_nobody_tuned_takes_the_cuda_configs_of_the_nearest_tuned_shape(table):
    table["devices"]["A"]["28672x4096g128"] = {**TRITON, "mma": {"buckets": [[1, 1, 4, 4, 2]], "dense_from_m": 384}}
    table["devices"]["A"]["960x576g64"] = {"mma": {"buckets": [[1, 1, 1, 8, 2]], "dense_from_m": 512}}
    int4_configs.CONFIG_FILE.write_text(json.dumps(table))
    int4_configs._tuned_table.cache_clear()
    # Qwen2.5-7B's qkv (4608 x 3584): nearer 4096 x 4096 than 28672 x 4096; only the CUDA library's configs come
    assert tuned_entry("A", 4608, 3584, 128, "9.0", 132) == {**MMA_A, "mma_gpu": "A", "mma_from": SHAPE}
    assert tuned_entry("A", 37888, 3584, 128, "9.0", 132) == {  # its fc + gate
        "mma": {"buckets": [[1, 1, 4, 4, 2]], "dense_from_m": 384}, "mma_gpu": "A", "mma_from": "28672x4096g128"}
    # another group size counts as a doubling of both dimensions: a 64-group 2048 x 2048 stays with 960 x 576 g64
    assert tuned_entry("A", 2048, 2048, 64, "9.0", 132)["mma_from"] == "960x576g64"
    # B's own shapes first; C's only shape, whatever the group
    assert tuned_entry("B", 4608, 3584, 128, "9.0", 114) == {**MMA_B, "mma_gpu": "B", "mma_from": SHAPE}
    assert tuned_entry("C", 4096, 4096, 64) == {**MMA_A, "mma_gpu": "C", "mma_from": SHAPE}
    assert tuned_entry("New Ada", 4608, 3584, 128, "8.9", 128) is None
    assert int4_configs.nearest_shape(4096, 4096, 128, []) is None


def test_every_gpu_of_the_shipped_table_says_what_an_untuned_gpu_is_matched_by():
    table = json.loads(CONFIG_FILE.read_text())
    assert set(table["devices"]) <= set(table["gpus"])
    for info in table["gpus"].values():
        assert info["capability"].count(".") == 1 and info["multiprocessors"] > 0
    assert {"NVIDIA H200", "NVIDIA H100 80GB HBM3"} <= set(table["devices"])
    assert config_devices("NVIDIA H100 PCIe", "9.0", 114) == ["NVIDIA H100 80GB HBM3"]  # tie at 132: by name


@pytest.mark.gpu
def test_a_layer_on_this_gpu_takes_the_configs_config_devices_names():
    from llmc.checkpoint.int4 import pack_int4
    from llmc.engine.torch.int4_cuda import MMA_DENSE_FROM_M_DEFAULT, Int4CudaLinear, Scratch

    gpu = torch.cuda.get_device_properties(0)
    chosen = config_devices(gpu.name, f"{gpu.major}.{gpu.minor}", gpu.multi_processor_count)
    # a GPU with no tuned configs of its own or of its compute capability: the heuristics' (no bucket)
    mma = tuned_entry(chosen[0], 6144, 4096, 128)["mma"] if chosen else {"buckets": [],
                                                                         "dense_from_m": MMA_DENSE_FROM_M_DEFAULT}
    q = torch.randint(-8, 8, (6144, 4096), dtype=torch.int8, device="cuda")
    scales = torch.full((6144, 4096 // 128), 0.01, dtype=torch.bfloat16, device="cuda")
    layer = Int4CudaLinear.from_ir([(pack_int4(q), scales)], None, 128, Scratch(torch.bfloat16, q.device),
                                   backend="mma")
    assert layer.dense_from_m == mma["dense_from_m"]
    assert layer._mma_buckets == [(b[0], tuple(b[1:])) for b in mma["buckets"]]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,prequant", [(6144, 5120, False), (5120, 14336, True)])  # Mistral-Nemo's qkv, down
def test_a_shape_nobody_tuned_runs_borrowed_configs_correctly_at_every_row_count(n, k, prequant):
    from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4
    from llmc.engine.torch.int4_cuda import Int4CudaLinear, Scratch

    gpu = torch.cuda.get_device_properties(0)
    entry = tuned_entry(gpu.name, n, k, 128, f"{gpu.major}.{gpu.minor}", gpu.multi_processor_count)
    tuned = {"6144x4096g128", "4096x4096g128", "4096x14336g128", "4608x3584g128", "3584x3584g128", "3584x18944g128"}
    assert entry is None or entry["mma_from"] in tuned
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8, device="cuda")
    scales = (torch.rand(n, k // 128, generator=gen, device="cuda") * 0.01 + 0.002).bfloat16()
    pq = (torch.rand(k, generator=gen, device="cuda") + 0.5).bfloat16() if prequant else None
    layer = Int4CudaLinear.from_ir([(pack_int4(q), scales)], pq, 128, Scratch(torch.bfloat16, q.device),
                                   backend="mma")
    weight = dequantize_w4a16(pack_int4(q), scales, pq if prequant else torch.ones(k, device="cuda"), 128)
    for rows in (1, 3, 8, 16, 17, 64, 100, 255, 600):
        x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
        ref = x.float() @ weight.T
        got = layer(x)
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(got).all() and rel < 8e-3, (rows, rel, layer.mma_config_for(rows))


def test_a_users_table_named_by_the_environment_goes_over_the_shipped_one(table, tmp_path, monkeypatch):
    from llmc.errors import EngineError

    mine = {"version": 2, "gpus": {"NVIDIA L40S": {"capability": "8.9", "multiprocessors": 142}},
            "devices": {"NVIDIA L40S": {SHAPE: MMA_B}, "A": {SHAPE: MMA_B, "4608x3584g128": MMA_B}}}
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    monkeypatch.setenv(int4_configs.CONFIGS_ENV, str(tmp_path / "mine.json"))
    int4_configs._tuned_table.cache_clear()
    env = {"mma_table": f"LLMC_INT4_CONFIGS={tmp_path / 'mine.json'}"}
    assert tuned_entry("A", 4096, 4096, 128) == {**TRITON_A, **MMA_B, "mma_gpu": "A", **env}  # A's Triton entry stays
    assert tuned_entry("A", 4608, 3584, 128) == {**MMA_B, "mma_gpu": "A", **env}  # tuned by the user: not borrowed
    assert tuned_entry("NVIDIA L40S", 4096, 4096, 128, "8.9", 142) == {**MMA_B, "mma_gpu": "NVIDIA L40S", **env}
    assert tuned_entry("B", 4096, 4096, 128, "9.0", 114) == {**TRITON_A, **MMA_B, "mma_gpu": "B"}  # B's own, shipped
    assert config_devices("B", "9.0", 114) == ["B", "A"]  # the shipped GPUs stay
    assert json.loads(int4_configs.CONFIG_FILE.read_text()) == table  # nothing written
    for bad, why in (("missing.json", "cannot be read \\(No such file"), ("bad.json", "not valid JSON"),
                     ("list.json", "not a table of tuned configs")):
        (tmp_path / "bad.json").write_text("{")
        (tmp_path / "list.json").write_text("[]")
        monkeypatch.setenv(int4_configs.CONFIGS_ENV, str(tmp_path / bad))
        int4_configs._tuned_table.cache_clear()
        with pytest.raises(EngineError, match=f"LLMC_INT4_CONFIGS=.*{bad}: .*{why}.*Fix: point it at a table "
                                              "written by `llmc tune BUILD --out FILE`"):
            tuned_entry("A", 4096, 4096, 128)


def test_the_int4_layer_shapes_of_an_ir_as_the_loader_builds_them():
    from llmc.engine.torch.int4_install import int4_layer_shapes

    tensors = {"transformer.layers.0.attention.qkv.weight": ("I8", (3072, 4096), 0),
               "transformer.layers.0.attention.qkv.prequant_scaling_factor": ("BF16", (1, 4096), 0),
               "transformer.layers.0.attention.dense.weight": ("I8", (2048, 4096), 0),
               "transformer.layers.0.mlp.fc.weight": ("I8", (7168, 4096), 0),
               "transformer.layers.0.mlp.gate.weight": ("I8", (7168, 4096), 0),
               "transformer.layers.0.mlp.proj.weight": ("I8", (2048, 14336), 0),
               "transformer.layers.0.mlp.proj.prequant_scaling_factor": ("BF16", (1, 14336), 0),
               "transformer.layers.1.mlp.proj.weight": ("I8", (9, 9), 0),  # only layer 0 is read
               "lm_head.weight": ("BF16", (128256, 4096), 0)}
    # qkv's input scale is folded into the norm; o has none here; down applies its own in the kernel
    assert int4_layer_shapes(tensors, 128) == [("qkv", 6144, 4096, 128, False, False),
                                               ("o", 4096, 4096, 128, False, False),
                                               ("fc_gate", 28672, 4096, 128, True, False),
                                               ("down", 4096, 14336, 128, False, True)]
    tensors["transformer.layers.0.attention.dense.weight"] = ("I8", (500, 576), 0)  # 1000 columns: Triton's layout
    assert [s[0] for s in int4_layer_shapes(tensors, 128)] == ["qkv", "fc_gate", "down"]


def test_llmc_tunes_table_on_this_machine_goes_over_the_shipped_one_and_the_environments_over_both(
        table, tmp_path, monkeypatch):
    from llmc.errors import EngineError

    local = tmp_path / "cache" / "int4_cuda_configs.json"
    monkeypatch.setattr(int4_configs, "local_table_path", lambda: local)
    local.parent.mkdir()
    local.write_text(json.dumps({"version": 2, "devices": {"A": {SHAPE: MMA_B, "4608x3584g128": MMA_B}}}))
    int4_configs._tuned_table.cache_clear()
    here = {"mma_table": "llmc tune's table"}
    assert [label for label, _ in int4_configs.table_sources()] == ["llmc tune's table"]
    assert tuned_entry("A", 4096, 4096, 128) == {**TRITON_A, **MMA_B, "mma_gpu": "A", **here}
    # a shape tuned here lends its configs, marked as this machine's, to the shapes near it
    assert tuned_entry("A", 4608, 4096, 128, "9.0", 132) == {**MMA_B, "mma_gpu": "A", **here, "mma_from": SHAPE}
    # B's own CUDA-library configs, from the shipped table (not marked), A's shipped Triton ones under them
    assert tuned_entry("B", 4096, 4096, 128, "9.0", 114) == {**TRITON_A, **MMA_B, "mma_gpu": "B"}
    (tmp_path / "env.json").write_text(json.dumps({"version": 2, "devices": {"A": {SHAPE: MMA_A}}}))
    monkeypatch.setenv(int4_configs.CONFIGS_ENV, str(tmp_path / "env.json"))
    int4_configs._tuned_table.cache_clear()
    assert tuned_entry("A", 4096, 4096, 128)["mma_table"] == f"LLMC_INT4_CONFIGS={tmp_path / 'env.json'}"
    assert tuned_entry("A", 4608, 3584, 128) == {**MMA_B, "mma_gpu": "A", **here}  # the local table's other shape
    local.write_text("{")
    int4_configs._tuned_table.cache_clear()
    with pytest.raises(EngineError, match=f"llmc tune's table {local}: not valid JSON.*Fix: move it away and run "
                                          "`llmc tune BUILD` again"):
        tuned_entry("A", 4096, 4096, 128)
    assert local.read_text() == "{"  # left as it was

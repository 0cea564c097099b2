"""The input embedding in host memory: the gather kernel (Triton's interpreter on CPU, the real kernel on the GPU),
the placement switch, the loader's move and the weight bytes the engine reports for it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmc.engine.torch import host_embedding, triton_support
from llmc.engine.torch.host_embedding import HostEmbedding, gather_rows, move_to_host, placement
from llmc.engine.torch.loader import host_weight_bytes, load_model, weight_bytes
from llmc.errors import EngineError
from tests import factories
from tests.engine.torch.helpers import PagedSession, write_ir

needs_triton = pytest.mark.skipif(triton_support.modules() is None or not triton_support.interpreting(),
                                  reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1, set by the conftest)")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_rows_copies_each_ids_row_and_zeros_ids_outside_the_table(dtype):
    table = torch.randn(50, 1500, dtype=dtype)  # two programs a row, the second one part-masked
    rows = torch.tensor([[3, 11], [49, 12], [0, 13], [3, 14], [50, 15], [-1, 16], [7, 17]])
    ids = rows[:, 0]  # a strided column, as the CUDA graphs' input rows hold the token ids
    out = torch.full((7, 1500), 9.0, dtype=dtype)
    gather_rows(table, ids, out)
    good = torch.tensor([True, True, True, True, False, False, True])
    assert torch.equal(out[good], table[ids[good]])
    assert torch.equal(out[~good], torch.zeros(2, 1500, dtype=dtype))  # never a read past the table
    assert gather_rows(table, ids[:0], out[:0]).shape == (0, 1500)


def test_placement_is_host_unless_the_environment_says_device(monkeypatch):
    monkeypatch.delenv(host_embedding.ENV, raising=False)
    assert placement() == "host"
    monkeypatch.setenv(host_embedding.ENV, " Device ")
    assert placement() == "device"
    monkeypatch.setenv(host_embedding.ENV, "gpu")
    with pytest.raises(EngineError, match="LLMC_EMBEDDING='gpu'.*Fix: set LLMC_EMBEDDING to host or device"):
        placement()


def _untied_ir(tmp_path, dtype="bfloat16"):
    (tmp_path / "tok").mkdir()
    hf = factories.make_tiny_llama(tmp_path / "hf", tmp_path / "tok", tie_word_embeddings=False)
    return write_ir(hf, tmp_path / "ir", dtype=dtype)


@needs_triton
def test_the_cuda_path_keeps_an_untied_embedding_in_host_memory_with_the_same_logits(tmp_path, monkeypatch):
    """The loader's CUDA path, run on CPU through the interpreter: the table leaves the model's weights (and the
    bytes the engine reports on the device), the logits stay bit-identical to the table kept in place."""
    ir = _untied_ir(tmp_path)
    monkeypatch.setenv(host_embedding.ENV, "device")
    kept = load_model(ir, "cpu", triton_on_cpu=True)
    monkeypatch.delenv(host_embedding.ENV)
    moved = load_model(ir, "cpu", triton_on_cpu=True)
    assert type(kept.transformer.vocab_embedding) is nn.Embedding
    table = moved.transformer.vocab_embedding
    assert isinstance(table, HostEmbedding) and torch.equal(table.weight, kept.transformer.vocab_embedding.weight)
    table_bytes = table.weight.numel() * table.weight.element_size()
    dtype = str(table.weight.dtype).removeprefix("torch.")  # float32 on CPU: the CPU computes in float32
    assert host_weight_bytes(moved) == {dtype: table_bytes} and host_weight_bytes(kept) == {}
    assert sum(weight_bytes(kept).values()) - sum(weight_bytes(moved).values()) == table_bytes
    ids = list(range(5, 45))
    logits = [PagedSession(m, block_size=16, num_blocks=8).step({"a": ids})["a"] for m in (kept, moved)]
    assert torch.equal(logits[0], logits[1])


def test_a_tied_embedding_stays_where_the_logits_layer_reads_it():
    config = type("C", (), {"tie_word_embeddings": True})()
    model = nn.Module()
    model.config, model.transformer = config, nn.Module()
    model.transformer.vocab_embedding = nn.Embedding(10, 4)
    assert not move_to_host(model) and type(model.transformer.vocab_embedding) is nn.Embedding
    config.tie_word_embeddings = False
    assert move_to_host(model) and isinstance(model.transformer.vocab_embedding, HostEmbedding)
    assert not move_to_host(model)  # already there


@pytest.mark.gpu
def test_on_cuda_the_table_is_page_locked_and_decodes_as_the_device_table_in_graphs_too(tmp_path, monkeypatch):
    """Eager prompt steps and CUDA-graph decode steps read the page-locked table through the GPU: the same greedy
    tokens as the table on the device, and the device memory the loaded weights hold drops by the table's bytes."""
    from llmc.engine.torch.runner import TorchModelRunner
    from tests.engine.torch.helpers import MiniScheduler, make_build_dir

    (tmp_path / "tok").mkdir()
    hf = factories.make_tiny_llama(tmp_path / "hf", tmp_path / "tok", tie_word_embeddings=False, vocab_size=4096,
                                   hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64)
    build = make_build_dir(hf, tmp_path / "build", dtype="bfloat16", tokens_per_block=16)
    table_bytes = 4096 * 256 * 2
    outs, held = {}, {}
    for where in ("device", "host"):
        monkeypatch.setenv(host_embedding.ENV, where)
        runner = TorchModelRunner(build, device="cuda", num_blocks=32)
        held[where] = sum(runner.weight_bytes.values())
        table = runner.model.transformer.vocab_embedding
        assert isinstance(table, HostEmbedding) == (where == "host")
        if where == "host":
            assert table.weight.device.type == "cpu" and table.weight.is_pinned()
            assert runner.host_weight_bytes == {"bfloat16": table_bytes}
        calls = []
        run = runner.graphs.run
        runner.graphs.run = lambda seqs, fill=None, run=run: calls.append(len(seqs)) or run(seqs, fill)
        sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=16)
        sched.add("a", list(range(1, 40)), max_new=12)
        sched.add("b", list(range(900, 917)), max_new=12)
        for step in range(20):
            sched.update(runner.execute(sched.schedule(step)).sampled_token_ids)
        outs[where] = {rid: r["out"] for rid, r in sched.reqs.items()}
        assert calls and all(len(r) == 12 for r in outs[where].values())
        del runner, table
    assert outs["host"] == outs["device"]
    assert held["device"] - held["host"] == table_bytes

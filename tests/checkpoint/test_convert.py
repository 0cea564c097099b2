"""HF -> IR conversion: exact names/shapes/dtypes, qkv stacking, TP sharding and its inverse."""

from __future__ import annotations

import pytest
import torch

from llmc.checkpoint.config import trtllm_config_from_hf
from llmc.checkpoint.convert import (
    dequantized_weights, hf_to_trtllm, merge_shards, pad_for_groupwise, shard, trtllm_to_hf,
)
from llmc.checkpoint.int4 import dequantize_w4a16, pack_int4, unpack_int4
from llmc.errors import CheckpointError, SourceError
from tests.checkpoint.helpers import LLAMA3_8B_HF, SMOLLM2_HF, hf_state_dict, rtn_quantized, tiny_hf
from tests.checkpoint.helpers import QWEN_TINY

L = "transformer.layers.{}."


def layer_shapes(i: int, qkv, dense, fc, proj, h) -> dict:
    p = L.format(i)
    return {p + "input_layernorm.weight": (h,), p + "post_layernorm.weight": (h,),
            p + "attention.qkv.weight": qkv, p + "attention.dense.weight": dense,
            p + "mlp.fc.weight": fc, p + "mlp.gate.weight": fc, p + "mlp.proj.weight": proj}  # fmt: skip


def test_smollm2_names_shapes_dtypes_meta():
    cfg = trtllm_config_from_hf(SMOLLM2_HF, "bfloat16")
    ir = hf_to_trtllm(hf_state_dict(SMOLLM2_HF, device="meta"), cfg)
    expected = {"transformer.vocab_embedding.weight": (49152, 576), "transformer.ln_f.weight": (576,),
                "lm_head.weight": (49152, 576)}  # fmt: skip
    for i in range(30):  # qkv (9 + 2*3) * 64 = 960 rows
        expected |= layer_shapes(i, (960, 576), (576, 576), (1536, 576), (576, 1536), 576)
    assert {k: tuple(v.shape) for k, v in ir.items()} == expected
    assert {v.dtype for v in ir.values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "tp, qkv_rows, dense_in, inter, vocab_rows",
    [(1, 6144, 4096, 14336, 128256), (2, 3072, 2048, 7168, 64128), (4, 1536, 1024, 3584, 32064),
     (8, 768, 512, 1792, 16032)],
)  # fmt: skip
def test_llama3_8b_rank_shapes_meta(tp, qkv_rows, dense_in, inter, vocab_rows):
    cfg = trtllm_config_from_hf(LLAMA3_8B_HF, "float16", tp)
    ir = hf_to_trtllm(hf_state_dict(LLAMA3_8B_HF, device="meta"), cfg)
    expected = {"transformer.vocab_embedding.weight": (128256, 4096), "transformer.ln_f.weight": (4096,),
                "lm_head.weight": (vocab_rows, 4096)}  # fmt: skip
    for i in range(32):
        expected |= layer_shapes(i, (qkv_rows, 4096), (4096, dense_in), (inter, 4096), (4096, inter), 4096)
    for rank in (0, tp - 1):
        got = shard(ir, cfg, rank)
        assert {k: tuple(v.shape) for k, v in got.items()} == expected
        assert {v.dtype for v in got.values()} == {torch.float16}


def test_kv_duplication_at_tp16_with_8_kv_heads_meta():
    hf = {**LLAMA3_8B_HF, "num_hidden_layers": 1}
    cfg = trtllm_config_from_hf(hf, "float16", 16)
    got = shard(hf_to_trtllm(hf_state_dict(hf, device="meta"), cfg), cfg, 5)
    assert tuple(got[L.format(0) + "attention.qkv.weight"].shape) == ((2 + 2 * 1) * 128, 4096)
    assert tuple(got["lm_head.weight"].shape) == (8016, 4096)  # 128256 / 16


def test_qkv_stacking_order_and_mlp_mapping():
    hf = tiny_hf(num_hidden_layers=1)
    sd = hf_state_dict(hf)
    ir = hf_to_trtllm(sd, trtllm_config_from_hf(hf, "float32"))
    p, h = L.format(0), "model.layers.0."
    qkv = ir[p + "attention.qkv.weight"]
    assert torch.equal(qkv[:64], sd[h + "self_attn.q_proj.weight"])
    assert torch.equal(qkv[64:96], sd[h + "self_attn.k_proj.weight"])
    assert torch.equal(qkv[96:], sd[h + "self_attn.v_proj.weight"])
    assert torch.equal(ir[p + "mlp.fc.weight"], sd[h + "mlp.gate_proj.weight"])  # the SiLU branch
    assert torch.equal(ir[p + "mlp.gate.weight"], sd[h + "mlp.up_proj.weight"])
    assert torch.equal(ir[p + "mlp.proj.weight"], sd[h + "mlp.down_proj.weight"])
    assert torch.equal(ir[p + "attention.dense.weight"], sd[h + "self_attn.o_proj.weight"])
    assert torch.equal(ir[p + "post_layernorm.weight"], sd[h + "post_attention_layernorm.weight"])


def test_tied_embeddings_write_lm_head_and_cast():
    hf = tiny_hf(tie_word_embeddings=True)
    sd = hf_state_dict(hf)
    ir = hf_to_trtllm(sd, trtllm_config_from_hf(hf, "float16"))
    assert torch.equal(ir["lm_head.weight"], sd["model.embed_tokens.weight"].half())
    assert ir["lm_head.weight"].dtype == torch.float16


def test_missing_hf_tensor_is_a_source_error():
    hf = tiny_hf()
    sd = hf_state_dict(hf)
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(SourceError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_trtllm(sd, trtllm_config_from_hf(hf, "float32"))


def test_rank_slices_by_hand_with_kv_duplication():
    hf = tiny_hf(num_hidden_layers=1)  # 4 heads, 2 kv heads of 16, tp 4: kv head r // 2 on rank r
    sd = hf_state_dict(hf)
    cfg = trtllm_config_from_hf(hf, "float32", 4)
    ir = hf_to_trtllm(sd, cfg)
    h, p = "model.layers.0.self_attn.", L.format(0)
    for rank in range(4):
        got = shard(ir, cfg, rank)
        kv = rank // 2
        expected_qkv = torch.cat([sd[h + "q_proj.weight"][16 * rank : 16 * rank + 16],
                                  sd[h + "k_proj.weight"][16 * kv : 16 * kv + 16],
                                  sd[h + "v_proj.weight"][16 * kv : 16 * kv + 16]])  # fmt: skip
        assert torch.equal(got[p + "attention.qkv.weight"], expected_qkv)
        assert torch.equal(got[p + "attention.dense.weight"], sd[h + "o_proj.weight"][:, 16 * rank : 16 * rank + 16])
        down = sd["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(got[p + "mlp.proj.weight"], down[:, 32 * rank : 32 * rank + 32])
        assert torch.equal(got["transformer.ln_f.weight"], sd["model.norm.weight"])


def test_lm_head_vocab_padding():
    hf = tiny_hf(vocab_size=10)
    sd = hf_state_dict(hf)
    cfg = trtllm_config_from_hf(hf, "float32", 4)
    ranks = [shard(hf_to_trtllm(sd, cfg), cfg, r) for r in range(4)]
    assert [tuple(r["lm_head.weight"].shape) for r in ranks] == [(3, 64)] * 4
    assert torch.equal(ranks[3]["lm_head.weight"][0], sd["lm_head.weight"][9])
    assert not ranks[3]["lm_head.weight"][1:].any()
    assert torch.equal(merge_shards(ranks, cfg)["lm_head.weight"], sd["lm_head.weight"])


@pytest.mark.parametrize("tp, kv_heads", [(2, 2), (4, 4), (4, 2), (4, 1)])
def test_shards_recombine_to_original(tp, kv_heads):
    hf = tiny_hf(num_key_value_heads=kv_heads, attention_bias=True, vocab_size=51)
    cfg = trtllm_config_from_hf(hf, "float32", tp)
    ir = hf_to_trtllm(hf_state_dict(hf), cfg)
    merged = merge_shards([shard(ir, cfg, r) for r in range(tp)], cfg)
    assert merged.keys() == ir.keys()
    assert all(torch.equal(merged[k], ir[k]) for k in ir)


def test_merge_detects_disagreeing_duplicated_kv_heads():
    hf = tiny_hf(num_key_value_heads=2)
    cfg = trtllm_config_from_hf(hf, "float32", 4)
    ir = hf_to_trtllm(hf_state_dict(hf), cfg)
    shards = [shard(ir, cfg, r) for r in range(4)]
    shards[1][L.format(0) + "attention.qkv.weight"][-1, 0] += 1.0  # rank 1's copy of v head 0
    with pytest.raises(CheckpointError, match="duplicated kv heads differ"):
        merge_shards(shards, cfg)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_w4a16_shards_recombine_and_keep_groups_with_weights(tp):
    hf = tiny_hf(num_key_value_heads=2)
    sd = hf_state_dict(hf)
    cfg = trtllm_config_from_hf(hf, "float16", tp, {"quant_algo": "W4A16_AWQ", "group_size": 16})
    quantized = rtn_quantized(sd, hf, 16)
    ir = hf_to_trtllm(sd, cfg, quantized)
    ranks = [shard(ir, cfg, r) for r in range(tp)]
    merged = merge_shards(ranks, cfg)
    assert all(torch.equal(merged[k], ir[k]) for k in ir)
    p = L.format(0) + "mlp.proj."
    q, scales, prequant = quantized["model.layers.0.mlp.down_proj"]
    cols = 128 // tp  # row-parallel: rank r holds input features [r * cols, (r + 1) * cols)
    for r, got in enumerate(ranks):
        assert torch.equal(unpack_int4(got[p + "weight"]), q[:, r * cols : (r + 1) * cols])
        assert torch.equal(got[p + "weights_scaling_factor"], scales[:, r * cols // 16 : (r + 1) * cols // 16])
        assert torch.equal(got[p + "prequant_scaling_factor"], prequant[r * cols : (r + 1) * cols].half())


def test_w4a16_qkv_needs_one_prequant():
    hf = tiny_hf(num_hidden_layers=1)
    sd = hf_state_dict(hf)
    quantized = rtn_quantized(sd, hf, 16)
    q, s, _ = quantized["model.layers.0.self_attn.k_proj"]
    quantized["model.layers.0.self_attn.k_proj"] = (q, s, torch.ones(64))
    cfg = trtllm_config_from_hf(hf, "float16", 1, {"quant_algo": "W4A16_AWQ", "group_size": 16})
    with pytest.raises(CheckpointError, match="different prequant"):
        hf_to_trtllm(sd, cfg, quantized)
    del quantized["model.layers.0.self_attn.k_proj"]
    with pytest.raises(CheckpointError, match="no quantized tensors"):
        hf_to_trtllm(sd, cfg, quantized)


@pytest.mark.parametrize("tp", [1, 2])
def test_dequantized_weights_are_the_w4a16_layers_weights_merged(tp):
    hf = tiny_hf(num_key_value_heads=2)
    sd = hf_state_dict(hf)
    quantized = rtn_quantized(sd, hf, 16)
    cfg = trtllm_config_from_hf(hf, "float32", tp, {"quant_algo": "W4A16_AWQ", "group_size": 16})
    ir = hf_to_trtllm(sd, cfg, quantized)
    full = dequantized_weights(cfg, [shard(ir, cfg, r) for r in range(tp)])
    q, scales, prequant = quantized["model.layers.1.mlp.down_proj"]
    assert torch.equal(full[L.format(1) + "mlp.proj.weight"], dequantize_w4a16(pack_int4(q), scales, prequant, 16))
    assert not any(k.endswith("scaling_factor") for k in full)
    assert torch.equal(full[L.format(0) + "input_layernorm.weight"], ir[L.format(0) + "input_layernorm.weight"])


@pytest.mark.parametrize("tied", [False, True])
def test_trtllm_to_hf_inverts_hf_to_trtllm(tied):
    hf = tiny_hf(num_key_value_heads=2, tie_word_embeddings=tied)
    sd = hf_state_dict(hf)
    back = trtllm_to_hf(hf_to_trtllm(sd, trtllm_config_from_hf(hf, "float32")), hf)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_trtllm_to_hf_cuts_the_groupwise_padding():
    hf = tiny_hf(intermediate_size=96)
    sd = hf_state_dict(hf)
    cfg = trtllm_config_from_hf(hf, "float32")
    ir, padded_cfg, record = pad_for_groupwise(hf_to_trtllm(sd, cfg), cfg, 1, 64)
    assert record["intermediate_size"] == {"original": 96, "padded": 128}
    back = trtllm_to_hf(ir, hf)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_biases_and_head_norms_convert_both_ways(family):
    hf = QWEN_TINY[family]
    sd = hf_state_dict(hf)
    cfg = trtllm_config_from_hf(hf, "float32")
    ir = hf_to_trtllm(sd, cfg)
    p, hp = "transformer.layers.1.attention.", "model.layers.1.self_attn."
    if family == "qwen2":
        want = torch.cat([sd[hp + f"{m}_proj.bias"] for m in "qkv"])
        assert torch.equal(ir[p + "qkv.bias"], want) and want.shape == (128,)
        assert p + "q_layernorm.weight" not in ir
    else:
        assert torch.equal(ir[p + "q_layernorm.weight"], sd[hp + "q_norm.weight"])
        assert torch.equal(ir[p + "k_layernorm.weight"], sd[hp + "k_norm.weight"])
        assert p + "qkv.bias" not in ir
    assert p + "dense.bias" not in ir
    back = trtllm_to_hf(ir, hf)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_shards_recombine_and_hold_their_ranks_tensors(family, tmp_path):
    """tp 2 with 2 kv heads: the qkv bias splits with q, k, v's rows; the head norms are whole on both ranks."""
    from llmc.checkpoint.io import read_checkpoint, write_checkpoint

    hf = QWEN_TINY[family]
    cfg = trtllm_config_from_hf(hf, "float32", 2)
    ir = hf_to_trtllm(hf_state_dict(hf), cfg)
    ranks = [shard(ir, cfg, r) for r in range(2)]
    if family == "qwen2":
        bias = ir["transformer.layers.0.attention.qkv.bias"]  # q 64, k 32, v 32 rows
        assert torch.equal(ranks[1]["transformer.layers.0.attention.qkv.bias"],
                           torch.cat([bias[32:64], bias[80:96], bias[112:128]]))
    else:
        norm = "transformer.layers.0.attention.k_layernorm.weight"
        assert torch.equal(ranks[0][norm], ir[norm]) and torch.equal(ranks[1][norm], ir[norm])
    write_checkpoint(tmp_path / "ir", cfg, ranks)  # checks every rank's tensors against the config
    _, read = read_checkpoint(tmp_path / "ir")
    merged = merge_shards(read, cfg)
    assert merged.keys() == ir.keys() and all(torch.equal(merged[k], ir[k]) for k in ir)

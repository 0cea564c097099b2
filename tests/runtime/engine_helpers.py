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
from tests.runtime.scheduler_helpers import resolve_placeholders

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


class LazyStepRunner:
    """The CPU runner presented as an asynchronous one (the CUDA runner's ``launch`` / ``result()`` split):
    ``launch`` only records the step and ``result()`` computes it, so the engine's overlapped step path runs in
    the CPU tests. ``log`` records ("launch", step), ("result", step) in call order; tests may append to it.
    ``late_masks``: ``launch`` takes output-format masks after recording the step, as the CUDA runner does after
    queuing its forward pass."""

    async_steps = True

    def __init__(self, runner, fail_on_launch: set[int] = frozenset(), late_masks: bool = True):
        self._runner = runner
        self.late_masks = late_masks
        self.verifies_drafts = getattr(runner, "verifies_drafts", False)
        self.block_size, self.num_blocks, self.vocab_size = runner.block_size, runner.num_blocks, runner.vocab_size
        self.fail_on_launch = set(fail_on_launch)
        self.launches = 0
        self.log: list[tuple[str, object]] = []

    def execute(self, scheduled):
        return self._runner.execute(scheduled)

    def launch(self, scheduled, previous=None, masks=None):
        self.launches += 1
        if self.launches in self.fail_on_launch:
            raise RuntimeError("simulated device failure")
        self.log.append(("launch", scheduled.step))
        if masks is not None:
            masked = masks()
            assert [s.request_id for s in masked.sequences] == [s.request_id for s in scheduled.sequences]
            scheduled = masked
        runner, log = self._runner, self.log

        class Pending:
            _result = None

            def result(self):
                if self._result is None:
                    log.append(("result", scheduled.step))
                    done = previous.result() if previous is not None else None
                    self._result = runner.execute(resolve_placeholders(scheduled, done))
                return self._result

        return Pending()


def make_engine(build_dir: Path, num_blocks: int | None = None, max_wait_s: float | None = None,
                overlap: bool = False, late_masks: bool = True, **serving_overrides) -> Engine:
    """A fresh Engine (own scheduler and block manager) over the build's runner, loaded once per session;
    ``overlap``: through :class:`LazyStepRunner` (the engine's overlapped path, as on CUDA), taking late
    output-format masks unless ``late_masks`` is False."""
    base = _loaded(Path(build_dir))
    recipe = base.recipe
    if serving_overrides:
        recipe = dataclasses.replace(recipe, serving=dataclasses.replace(recipe.serving, **serving_overrides))
    runner = LazyStepRunner(base.runner, late_masks=late_masks) if overlap else base.runner
    return Engine(runner, base.tokenizer, recipe, base.eos_token_ids, num_blocks=num_blocks,
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

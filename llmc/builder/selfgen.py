"""Self-generated calibration text (dataset ``self``): the 16-bit model answers llmc's seed prompts through
llmc's own runtime.

The source model is exported as a 16-bit IR into a temporary build folder (checkpoint, torch engine, tokenizer,
manifest) and opened with :class:`llmc.Engine`, so generation uses continuous batching over the
paged KV cache on the build's device. Every seed prompt (:mod:`llmc.builder.seed_prompts`) is asked in a
chat-formatted conversation and answered with sampling (``calibration.self_generation``: temperature, top_p,
max_new_tokens; each request seeded from the recipe's calibration seed, so a build is reproducible); with
``follow_up`` a follow-up question from ``FOLLOW_UPS`` gets a second answer in the same conversation.
Rounds over the shuffled prompts continue, with new request seeds, until the conversations hold the tokens the
calibration mix asked for. The conversations become calibration units like any other source's. A model
without a chat template is prompted with the raw prompt text and answers once.
"""

from __future__ import annotations

import dataclasses
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from llmc.builder.calib_text import Unit
from llmc.builder.seed_prompts import FOLLOW_UPS, all_prompts

TEMPLATE_TOKENS = 16  # chat markers and role names around each turn (SmolLM2: 5 per turn)


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One self-generated conversation: the messages, and its prompt + generated token counts."""

    messages: tuple[dict[str, str], ...]
    tokens: int


class SelfTextWriter:
    """Callable ``writer(tokens) -> units``: conversations the 16-bit model writes, at least ``tokens`` tokens.

    ``source``: the SourceModel; ``recipe``: the build's recipe (its ``calibration.self_generation`` and seed);
    ``device``: where the runtime runs. After a call, ``report`` holds what was generated and how fast.
    """

    def __init__(self, source: Any, recipe: Any, device: torch.device, progress: Any = None):
        self.source = source
        self.recipe = recipe
        self.device = device
        self.progress = progress
        self.report: dict[str, Any] | None = None

    def __call__(self, tokens: int) -> list[Unit]:
        from llmc.builder.devices import PeakMemory

        spec = self.recipe.quantization.calibration.self_generation
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="llmc-selfgen-") as tmp, PeakMemory(self.device) as peak:
            engine = open_generator(self.source, self.recipe, Path(tmp), self.device)
            try:
                conversations = generate_conversations(engine, tokens, spec, self.recipe.quantization.calibration.seed,
                                                       chat=self.source.chat_template is not None,
                                                       progress=self.progress)
            finally:
                engine.shutdown()
                del engine
        seconds = time.perf_counter() - started
        generated = sum(c.tokens for c in conversations)
        self.report = {
            "device": str(self.device),
            "conversations": len(conversations),
            "turns": sum(len(c.messages) // 2 for c in conversations),
            "tokens": generated,
            "tokens_asked": tokens,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(generated / seconds, 1) if seconds > 0 else None,
            "peak_gpu_memory_bytes": peak.bytes,
            "sampling": dataclasses.asdict(spec),
        }
        return [tuple(c.messages) for c in conversations]


def generator_recipe(recipe: Any) -> Any:
    """The 16-bit, torch-backend recipe of the generator: limits sized for seed prompts plus answers, a 16-bit
    KV cache (a recipe's fp8 cache is calibrated after quantizing, for the weights that ship)."""
    from llmc.recipe import recipe_from_dict, recipe_to_dict

    spec = recipe.quantization.calibration.self_generation
    data = recipe_to_dict(recipe)
    max_input = 512 + (2 * spec.max_new_tokens if spec.follow_up else 0)  # prompt, answer and a follow-up
    data.update(name=f"{recipe.name}-selfgen", backend="torch", quantization={"method": "none"})
    data["engine"] = {"max_batch_size": spec.max_batch_size, "max_input_len": max_input,
                      "max_seq_len": max_input + spec.max_new_tokens, "tp_size": 1,
                      "max_num_tokens": max(recipe.engine.max_num_tokens, spec.max_batch_size)}
    data["serving"] = {**data["serving"], "enable_kv_cache_reuse": False}
    data["kv_cache"] = {**data["kv_cache"], "dtype": "auto"}  # the 16-bit model's own text: an exact cache, no scales
    return recipe_from_dict(data, check_inputs=False)


def open_generator(source: Any, recipe: Any, folder: Path, device: torch.device) -> Any:
    """Write the 16-bit generator build into ``folder`` and open it with llmc's runtime on ``device``.

    The KV cache holds exactly one full batch (``max_batch_size`` x ``max_seq_len``), not a memory fraction, so
    the generator's GPU memory stays proportional to the batch.
    """
    from llmc import manifest as mf
    from llmc.builder.export import export_checkpoint
    from llmc.builder.build_files import export_tokenizer, make_manifest
    from llmc.engine.base import compile_engine
    from llmc.runtime.api import Engine

    gen = generator_recipe(recipe)
    export_checkpoint(source, gen, folder / "checkpoint")
    compile_engine(gen, folder / "checkpoint", folder / "engine")
    export_tokenizer(source, folder / "tokenizer")
    mf.write_manifest(folder, make_manifest(gen, "self-generation", source, {}))
    block = gen.kv_cache.tokens_per_block
    num_blocks = gen.engine.max_batch_size * math.ceil(gen.engine.max_seq_len / block)
    return Engine.from_dir(folder, device=device.type, num_blocks=num_blocks, prepare_formats=False)  # free text


def generate_conversations(engine: Any, tokens: int, spec: Any, seed: int, chat: bool = True,
                           progress: Any = None) -> list[Conversation]:
    """Conversations from ``engine`` until they hold at least ``tokens`` tokens (prompts + answers).

    Round r asks every seed prompt once, in an order shuffled with (seed, r); requests go in chunks of at most
    two batches, each as large as the tokens still missing need at the mean conversation length so far, so the
    text stops close to ``tokens`` (generation is the expensive part on a CPU). Request i of round r samples
    with seed (seed, r, i, turn), so the text does not depend on how requests were batched.
    """
    from llmc.request.params import SamplingParams

    prompts = all_prompts()
    conversations: list[Conversation] = []
    total, round_index = 0, 0
    turns = 2 if spec.follow_up and chat else 1
    per_conversation = turns * (spec.max_new_tokens + 40) * 0.75  # a guess until the first chunk is measured
    while total < tokens:
        order = list(range(len(prompts)))
        random.Random(f"{seed}:{round_index}").shuffle(order)
        start = 0
        while start < len(order) and total < tokens:
            size = max(1, min(2 * spec.max_batch_size, math.ceil((tokens - total) / per_conversation)))
            picked = order[start:start + size]

            def params(i: int, turn: int) -> SamplingParams:
                return SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                                      top_p=spec.top_p, seed=request_seed(seed, round_index, i, turn))

            new = _converse(engine, [prompts[i] for i in picked], [params(i, 0) for i in picked],
                            [params(i, 1) for i in picked], turns == 2, chat,
                            random.Random(f"{seed}:{round_index}:{start}:follow"))
            conversations += new
            total += sum(c.tokens for c in new)
            per_conversation = max(1.0, total / max(1, len(conversations)))
            start += size
            if progress is not None:
                progress.note(f"self-generation {min(total, tokens):,}/{tokens:,} tokens")
        round_index += 1
    return conversations


def request_seed(seed: int, round_index: int, prompt_index: int, turn: int) -> int:
    """A request's sampling seed, unique per (calibration seed, round, prompt, turn)."""
    return ((seed * 1_000_003 + round_index) * 1_009 + prompt_index) * 2 + turn


def _converse(engine: Any, prompts: Sequence[str], first: Sequence[Any], second: Sequence[Any], follow_up: bool,
              chat: bool, rng: random.Random) -> list[Conversation]:
    """One answer per prompt, then (``follow_up``) a follow-up question and its answer."""
    asks = [[{"role": "user", "content": p}] for p in prompts]
    answers = engine.generate([a if chat else p for a, p in zip(asks, prompts)], list(first))
    histories = [ask + [{"role": "assistant", "content": done.text.strip()}] for ask, done in zip(asks, answers)]
    counts = [_tokens(engine, p) + len(done.token_ids) for p, done in zip(prompts, answers)]
    if follow_up:
        for history in histories:
            history.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
        again = engine.generate([list(h) for h in histories], list(second))
        for history, done, i in zip(histories, again, range(len(histories))):
            history.append({"role": "assistant", "content": done.text.strip()})
            counts[i] += _tokens(engine, history[-2]["content"]) + len(done.token_ids)
    return [Conversation(tuple(h), n + TEMPLATE_TOKENS * (len(h) // 2))
            for h, n in zip(histories, counts) if all(m["content"] for m in h)]


def _tokens(engine: Any, text: str) -> int:
    return len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])

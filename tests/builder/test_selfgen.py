"""Self-generated calibration text: the 16-bit model answers the seed prompts through llmc's runtime."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.builder import selfgen
from llmc.builder.seed_prompts import FOLLOW_UPS, SEED_PROMPTS, all_prompts
from llmc.recipe import recipe_from_dict


@dataclass
class _Done:
    text: str
    token_ids: tuple[int, ...]


class FakeEngine:
    """Records generate() calls; every answer is "answer to <last user message>" with 5 tokens."""

    def __init__(self):
        self.calls: list[tuple[list, list]] = []

    def tokenizer(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text.split())))}

    def generate(self, prompts, params):
        self.calls.append((prompts, params))
        last = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        return [_Done(f"answer to {text}", (7,) * 5) for text in last]


SPEC = recipe_from_dict({"name": "t", "model": {"source": "/x"}, "quantization": {"calibration": {
    "self_generation": {"max_new_tokens": 5, "max_batch_size": 4}}}}, check_inputs=False).quantization.calibration


def test_conversations_are_chat_turns_with_follow_ups_until_the_tokens_are_there():
    engine = FakeEngine()
    conversations = selfgen.generate_conversations(engine, 100, SPEC.self_generation, seed=3)
    assert sum(c.tokens for c in conversations) >= 100
    first, follow = engine.calls[0], engine.calls[1]
    assert len(first[0]) == len(follow[0]) == 2  # 100 tokens / (2 turns x (5 + 40) x 0.75) expected per conversation
    assert sum(c.tokens for c in conversations) < 100 + 2 * 60  # stops close to the tokens asked
    many = FakeEngine()
    selfgen.generate_conversations(many, 10_000, SPEC.self_generation, seed=3)
    assert max(len(prompts) for prompts, _ in many.calls) == 8  # at most two batches at once
    for c in conversations:
        roles = [m["role"] for m in c.messages]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert c.messages[0]["content"] in all_prompts() and c.messages[2]["content"] in FOLLOW_UPS
        assert c.messages[1]["content"] == f"answer to {c.messages[0]['content']}"
    assert all(p.temperature == 0.8 and p.top_p == 0.95 and p.max_new_tokens == 5 for p in first[1])
    seeds = [p.seed for _, params in engine.calls for p in params]
    assert len(seeds) == len(set(seeds))  # every request samples with its own seed


def test_rounds_are_seeded_and_go_past_the_prompt_set():
    engine = FakeEngine()
    tokens = 80 * len(all_prompts())  # more than one round: ~59 tokens per conversation
    conversations = selfgen.generate_conversations(engine, tokens, SPEC.self_generation, seed=0)
    assert len(conversations) > len(all_prompts())  # a second round with new request seeds
    again = selfgen.generate_conversations(FakeEngine(), tokens, SPEC.self_generation, seed=0)
    other = selfgen.generate_conversations(FakeEngine(), tokens, SPEC.self_generation, seed=1)
    assert [c.messages for c in again] == [c.messages for c in conversations]
    assert [c.messages[0] for c in other] != [c.messages[0] for c in conversations]  # another prompt order


def test_without_a_chat_template_prompts_are_raw_text_and_answered_once():
    engine = FakeEngine()
    conversations = selfgen.generate_conversations(engine, 10, SPEC.self_generation, seed=0, chat=False)
    assert all(isinstance(p, str) for p in engine.calls[0][0]) and len(engine.calls) == 1
    assert all(len(c.messages) == 2 for c in conversations)


def test_seed_prompts_cover_the_categories():
    assert set(SEED_PROMPTS) >= {"chat", "code", "explain", "story", "list", "other_languages"}
    assert len(all_prompts()) == len(set(all_prompts())) >= 80


def test_the_model_writes_its_text_through_llmcs_runtime(tiny_hf_dir):
    from llmc.source.load import resolve_source

    recipe = recipe_from_dict({"name": "tiny", "model": {"source": str(tiny_hf_dir)}, "quantization": {
        "method": "awq", "group_size": 32, "calibration": {"dataset": "self", "seed": 5, "self_generation": {
            "max_new_tokens": 6, "max_batch_size": 4, "temperature": 1.0}}}})
    source = resolve_source(recipe.model)
    writer = selfgen.SelfTextWriter(source, recipe, torch.device("cpu"))
    units = writer(60)
    report = writer.report
    assert report["tokens"] >= 60 and report["conversations"] == len(units) and report["turns"] == 2 * len(units)
    assert report["device"] == "cpu" and report["tokens_per_s"] > 0 and report["peak_gpu_memory_bytes"] is None
    assert all([m["role"] for m in u] == ["user", "assistant"] * 2 and u[1]["content"] for u in units)
    assert units == selfgen.SelfTextWriter(source, recipe, torch.device("cpu"))(60)  # seeded: the same text


def test_generator_recipe_is_16bit_torch_with_room_for_a_follow_up():
    recipe = recipe_from_dict({"name": "x", "model": {"source": "/x"}, "backend": "tensorrt_llm", "quantization": {
        "method": "awq", "calibration": {"dataset": "self"}}, "kv_cache": {"dtype": "fp8"}}, check_inputs=False)
    gen = selfgen.generator_recipe(recipe)
    assert gen.quantization.method == "none" and gen.backend == "torch" and gen.name == "x-selfgen"
    assert gen.kv_cache.dtype == "auto"  # no fp8 scales exist yet: the generator's cache is 16-bit
    assert gen.engine.max_batch_size == 16 and gen.engine.max_input_len == 512 + 2 * 256
    assert gen.engine.max_seq_len == gen.engine.max_input_len + 256 and not gen.serving.enable_kv_cache_reuse

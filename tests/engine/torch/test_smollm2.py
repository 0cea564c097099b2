"""The embedded SmolLM2-135M through the portable engine: logits and greedy text equal transformers' (fp32)."""

from __future__ import annotations

import pytest
import torch

from llmc.engine.torch.runner import TorchModelRunner
from llmc.tokenizer import load_tokenizer
from tests.engine.torch.helpers import MiniScheduler, PagedSession, make_build_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_dir, tmp_path_factory):
    """(runner over a float32 torch build of SmolLM2, transformers' model, tokenizer)."""
    from transformers import LlamaForCausalLM

    build = make_build_dir(smollm2_hf_dir, tmp_path_factory.mktemp("smollm2") / "build", tokens_per_block=16)
    runner = TorchModelRunner(build, device="cpu", num_blocks=64)
    hf_model = LlamaForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    return runner, hf_model, load_tokenizer(smollm2_hf_dir)


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_logits_match_transformers(smollm2):
    runner, hf_model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "Explain in two sentences why the sky is blue.")
    session = PagedSession(runner.model, block_size=16, num_blocks=16)
    split = len(ids) * 2 // 3
    got = torch.cat([session.step({"a": ids[:split]})["a"], session.step({"a": ids[split:]})["a"]])  # 2 chunks
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (got - ref).abs().max().item()
    print(f"SmolLM2 fp32 max abs logits diff vs transformers over {len(ids)} positions: {diff:.3e}")
    assert diff < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_32_tokens_equal_transformers_generate(smollm2):
    runner, hf_model, tokenizer = smollm2
    prompt = chat_ids(tokenizer, "Write a short poem about the sea.")
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=len(prompt))
    sched.add("a", prompt, max_new=32)
    for step in range(32):
        sched.update(runner.execute(sched.schedule(step)).sampled_token_ids)
    got = sched.reqs["a"]["out"]
    assert len(ref) == 32, tokenizer.decode(ref)  # the answer is long enough to compare 32 tokens
    assert got == ref, (tokenizer.decode(got), tokenizer.decode(ref))

"""GPU-box acceptance: TensorRT engines vs llmc's torch engine from the *same* checkpoint IR, greedy.

Run by scripts/acceptance_trtllm.sh on a machine with TensorRT-LLM 1.2 (never in CI here)::

    python -m llmc.engine.tensorrt_llm.acceptance --torch-build build/smollm2-accept-torch \\
        --trt-recipe /tmp/accept/smollm2-trt.yaml --work /tmp/accept/trt

It compiles TensorRT engines from the torch build's ``checkpoint/`` (so both engines read identical
tensors), generates greedily with ModelRunnerCpp (:class:`TrtllmRunner`) and with ``Engine.from_dir``
(torch, CUDA), and compares the token ids. Exact agreement of every token is not expected: TensorRT's
int4 GEMM and attention kernels accumulate in a different order than the torch engine, and one near-tie
flips a greedy choice. The pass rule (a judgement, stated in docs/TENSORRT_LLM.md): every prompt's first
``--min-prefix`` tokens agree, and on average at least half of the generated tokens agree before the
first divergence. Exit status 0 on pass, 1 on fail; a JSON report goes to ``--work``/acceptance.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a paged KV cache is in one sentence.",
    "List three prime numbers.",
)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(trt: list[list[int]], ref: list[list[int]], min_prefix: int) -> dict:
    """Per-prompt agreement and the verdict (pure: tested on CPU)."""
    prefixes = [common_prefix(a, b) for a, b in zip(trt, ref)]
    fractions = [1.0 if a == b else p / max(len(b), 1) for a, b, p in zip(trt, ref, prefixes)]
    mean_fraction = sum(fractions) / len(fractions)
    passed = all(p >= min(min_prefix, len(r)) for p, r in zip(prefixes, ref)) and mean_fraction >= 0.5
    return {"prefixes": prefixes, "mean_prefix_fraction": round(mean_fraction, 3), "passed": passed,
            "exact": [a == b for a, b in zip(trt, ref)]}


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


@click.command()
@click.option("--torch-build", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--trt-recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--min-prefix", default=8, show_default=True)
def main(torch_build: Path, trt_recipe: Path, work: Path, max_new_tokens: int, min_prefix: int) -> None:
    """Compare greedy tokens of TensorRT engines and the torch engine built from the same IR."""
    from llmc.builder.load import load_tokenizer
    from llmc.builder.manifest import read_manifest
    from llmc.engine.tensorrt_llm.build import build_engines
    from llmc.engine.tensorrt_llm.runner import TrtllmRunner, TrtllmRunnerConfig
    from llmc.recipe import load_recipe
    from llmc.runtime.api import Engine
    from llmc.runtime.params import SamplingParams

    recipe = load_recipe(trt_recipe)
    engine_dir = work / "engine"
    build_report = build_engines(recipe, torch_build / "checkpoint", engine_dir)
    tokenizer = load_tokenizer(torch_build / "tokenizer")
    eos = read_manifest(torch_build).eos_token_ids
    prompts = [_chat_ids(tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    trt = TrtllmRunner(TrtllmRunnerConfig.from_recipe(recipe, engine_dir), tokenizer, eos)
    trt_out = [list(c.token_ids) for c in trt.generate(prompts, params)]
    ref_out = [list(c.token_ids) for c in Engine.from_dir(torch_build, device="cuda").generate(prompts, params)]
    report = {"build": build_report, **compare(trt_out, ref_out, min_prefix),
              "trt_tokens": trt_out, "torch_tokens": ref_out,
              "trt_text": [tokenizer.decode(t) for t in trt_out], "torch_text": [tokenizer.decode(t) for t in ref_out]}
    (work / "acceptance.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    for prompt, prefix, exact in zip(PROMPTS, report["prefixes"], report["exact"]):
        click.echo(f"{'same' if exact else f'{prefix:>3} tokens agree'}  {prompt}")
    click.echo(f"{'PASS' if report['passed'] else 'FAIL'}: on average {report['mean_prefix_fraction']:.0%} of the "
               f"torch engine's tokens agree before the first divergence (max_new_tokens {max_new_tokens})")
    raise SystemExit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()

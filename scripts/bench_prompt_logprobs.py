#!/usr/bin/env python3
"""What scoring a prompt costs: requests that ask for their prompt's log-probabilities (``prompt_logprobs``, what
lm-eval's ``local-completions`` loglikelihood requests ask for through ``echo``) against the same requests without,
on one build, in one process.

    python scripts/bench_prompt_logprobs.py BUILD_DIR --prompts 16 --prompt-len 2048 --device cuda

Every prompt is distinct random token ids (no prefix-cache hit on either side; a scoring request looks nothing up
anyway), one token generated, greedy. Two rounds, the modes alternating: ``alone`` runs the prompts one after the
other (the request's latency: prefill + scoring), ``batch`` submits them all at once (prompt tokens scored per
second). Prints one JSON object with both modes' figures and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--top", type=int, default=1, help="alternatives a scored token comes with (lm-eval: 1)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    engine = Engine.from_dir(args.build_dir, device=args.device)
    vocab = engine.runner.vocab_size
    rng = random.Random(0)

    def prompts() -> list[list[int]]:  # fresh ids every call: no prompt is ever seen twice
        return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    modes = {"plain": SamplingParams(max_new_tokens=1, temperature=0.0),
             "scored": SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=args.top)}
    for params in modes.values():  # warm-up: first-call compiles and plans
        engine.generate(prompts()[:2], params)
    alone: dict[str, list[float]] = {m: [] for m in modes}
    batch: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, params in modes.items():
            for prompt in prompts():
                start = time.perf_counter()
                out = engine.generate([prompt], params)[0]
                alone[mode].append(time.perf_counter() - start)
                assert len(out.prompt_logprobs) == (args.prompt_len - 1 if params.prompt_logprobs is not None else 0)
            start = time.perf_counter()
            engine.generate(prompts(), params)
            batch[mode].append(args.prompts * args.prompt_len / (time.perf_counter() - start))
    engine.shutdown()
    report = {"device": str(engine.runner.device), "prompts": args.prompts, "prompt_len": args.prompt_len,
              "top": args.top, "rounds": args.rounds,
              "alone_ms_p50": {m: statistics.median(v) * 1000 for m, v in alone.items()},
              "batch_prompt_tok_s": {m: max(v) for m, v in batch.items()}}
    report["alone_ratio"] = report["alone_ms_p50"]["scored"] / report["alone_ms_p50"]["plain"]
    report["batch_ratio"] = report["batch_prompt_tok_s"]["scored"] / report["batch_prompt_tok_s"]["plain"]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A chat's second turn: its prompt repeats the first turn's prompt and answer, which the prefix cache serves.

    python scripts/bench_turns.py BUILD_DIR --first 40 --answer 190 --tail 20 --conversations 5 --device cpu

Each conversation: a first prompt of ``--first`` distinct random token ids, a greedy answer of exactly ``--answer``
tokens, then a second prompt (first prompt + answer + ``--tail`` new random ids) that generates one token. Run with
the prefix cache on and off, in one process on one build (the modes alternating per conversation). Reports the second
turn's TTFT (median, ms) and the prompt tokens the cache served (``cached_tokens``) in each mode. With the cache on,
the answer's computed full blocks are served too, not only the first prompt's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir")
    parser.add_argument("--first", type=int, default=40, help="tokens of the first prompt")
    parser.add_argument("--answer", type=int, default=190, help="tokens of the first answer")
    parser.add_argument("--tail", type=int, default=20, help="new tokens of the second prompt")
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    base = Engine.from_dir(args.build_dir, device=args.device)
    engines = {mode: Engine(base.runner, base.tokenizer, base.recipe, base.eos_token_ids, prefix_caching=on)
               for mode, on in (("cache_on", True), ("cache_off", False))}
    rng = random.Random(0)
    answer = SamplingParams(max_new_tokens=args.answer, temperature=0.0, ignore_eos=True)
    ttft: dict[str, list[float]] = {mode: [] for mode in engines}
    cached: dict[str, list[int]] = {mode: [] for mode in engines}
    for _ in range(args.conversations):
        first = [rng.randrange(3, base.runner.vocab_size) for _ in range(args.first)]
        tail = [rng.randrange(3, base.runner.vocab_size) for _ in range(args.tail)]
        for mode, engine in engines.items():
            said = engine.generate([first], answer)[0].token_ids
            second = engine.generate([first + list(said) + tail], SamplingParams(max_new_tokens=1))[0]
            ttft[mode].append(second.metrics.ttft)
            cached[mode].append(second.metrics.cached_tokens)
    p50 = {mode: statistics.median(times) * 1000 for mode, times in ttft.items()}
    print(json.dumps({"device": str(base.runner.device), "second_prompt_tokens": args.first + args.answer + args.tail,
                      "ttft_ms_p50": {m: round(v, 2) for m, v in p50.items()},
                      "cached_tokens": cached, "speedup": round(p50["cache_off"] / p50["cache_on"], 3)}))


if __name__ == "__main__":
    main()

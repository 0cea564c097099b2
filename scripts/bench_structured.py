#!/usr/bin/env python3
"""What an output format costs (structured outputs, ``SamplingParams.structured``): the same requests free and
constrained, on one build, in one process.

    python scripts/bench_structured.py BUILD_DIR --concurrency 1,8 --new-tokens 64 --device cpu
    python scripts/bench_structured.py BUILD_DIR --formats regex --regex '[0-9 ]{4000}' --regex-check '[0-9 ]*'

The random benchmark models' word-level tokenizer (scripts/make_random_llama.py) cannot be read by llguidance, so
on a GPU this runs on a build with a real tokenizer (the embedded SmolLM2's, or a real checkpoint's).

Every request has a distinct prompt of random token ids, is greedy and generates exactly ``--new-tokens`` tokens:
free requests ignore the end ids; the formats never complete that soon and allow no end id before (``regex``: 4,000
letters or spaces; ``json``: a JSON array of at least 1,000 integers). Two rounds, the modes alternating, at each
concurrency (that many requests submitted at once). Reports generated tokens per second, the ratio to free decoding,
and the host time spent computing the formats' masks (per masked token). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

from llmc.request import structured
from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine

FORMATS = {"regex": ({"type": "regex", "pattern": "[a-z ]{4000}"}, re.compile("[a-z ]*")),
           "json": ({"type": "json_schema", "schema": {"type": "array", "items": {"type": "integer"},
                                                        "minItems": 1000}}, re.compile(r"\[(-?[0-9]+,?)*-?"))}


class MaskClock:
    """Wraps :meth:`Constraint.masks` (how the engine computes a step's masks) to count the masks computed and the
    host seconds they took."""

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0
        original = structured.Constraint.masks

        def timed(constraints, drafts=None):
            start = time.perf_counter()
            try:
                return original(constraints, drafts)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += len(constraints) + sum(map(len, drafts or ()))

        structured.Constraint.masks = staticmethod(timed)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated request counts submitted at once")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--formats", default="regex,json", help="comma-separated: regex, json")
    parser.add_argument("--regex", default=FORMATS["regex"][0]["pattern"],
                        help="the regex format (must not complete within --new-tokens tokens)")
    parser.add_argument("--regex-check", default=FORMATS["regex"][1].pattern,
                        help="a Python regex every regex-format output must fully match")
    args = parser.parse_args()
    FORMATS["regex"] = ({"type": "regex", "pattern": args.regex}, re.compile(args.regex_check))
    for name in set(FORMATS) - set(args.formats.split(",")):
        del FORMATS[name]
    clock = MaskClock()
    engine = Engine.from_dir(args.build_dir, device=args.device)
    vocab, rng = engine.runner.vocab_size, random.Random(0)

    def prompts(n: int) -> list[list[int]]:  # fresh ids every call: no prefix is ever reused
        return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(n)]

    base = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    modes = {"free": base.replace(ignore_eos=True), **{name: base.replace(structured=fmt)
                                                      for name, (fmt, _) in FORMATS.items()}}
    for params in modes.values():  # warm-up: first-call costs, the format's tokenizer index
        engine.generate(prompts(2), params.replace(max_new_tokens=4))
    levels = [int(c) for c in args.concurrency.split(",")]
    tgs: dict[str, dict[int, float]] = {m: {} for m in modes}
    mask_us: dict[str, dict[int, float]] = {m: {} for m in FORMATS}
    for _ in range(args.rounds):
        for n in levels:
            for mode, params in modes.items():
                calls, seconds = clock.calls, clock.seconds
                start = time.perf_counter()
                done = engine.generate(prompts(n), params)
                elapsed = time.perf_counter() - start
                assert all(len(c.token_ids) == args.new_tokens and c.finish_reason == "length" for c in done), mode
                if mode in FORMATS:
                    assert all(FORMATS[mode][1].fullmatch(c.text) for c in done), (mode, done[0].text)
                    per_mask = (clock.seconds - seconds) / max(1, clock.calls - calls) * 1e6
                    mask_us[mode][n] = min(mask_us[mode].get(n, per_mask), per_mask)
                tgs[mode][n] = max(tgs[mode].get(n, 0.0), n * args.new_tokens / elapsed)
    engine.shutdown()
    report = {"device": str(engine.runner.device), "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
              "rounds": args.rounds, "tgs": tgs, "mask_us_per_token": mask_us,
              "ratio_to_free": {m: {n: tgs[m][n] / tgs["free"][n] for n in levels} for m in FORMATS}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

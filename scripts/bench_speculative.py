#!/usr/bin/env python3
"""What prompt-lookup speculation (``serving.speculative_tokens``) gives: the same greedy requests with and without
draft tokens, on one build, in one process (two engines over one loaded runner).

    python scripts/bench_speculative.py BUILD_DIR --speculative-tokens 4 --concurrency 1,8 --device cpu

Four workloads of chat requests, each prompt distinct (Python's own documentation and sources, so nothing is
downloaded and no prefix is shared between requests): ``quote`` asks to repeat a paragraph word for word, ``edit``
to add type hints to a function (answers that copy their prompt: where drafts are accepted), ``free`` to write a
story (little to look up: what the drafts cost when they fail), ``json`` (not by default) to describe a function
in a JSON schema's object (structured outputs: the format's forced tokens and the values copied from the prompt).
Greedy (``--temperature`` samples, each request with its own seed), the model's own end ids, ``--new-tokens`` at most;
no prefix caching in either mode. The modes alternate within each round; every round's requests are new. Reports
generated tokens per second (the best round), the ratio to plain decoding, the draft tokens verified and accepted (with
the tokens generated), and how many requests' tokens differ between the modes (0 on CPU in float32; a chunk's kernels
round differently from a one-token step's, so in 16-bit a near-tie may break the other way), and for ``json`` the
output-format masks computed and their host time per mask (summed over the rounds). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pydoc
import sys
import time

from llmc.request.params import SamplingParams
from llmc.runtime.api import Engine

MODULES = ["json", "csv", "heapq", "bisect", "textwrap", "string", "shlex", "fnmatch", "glob", "base64", "hashlib",
           "random", "statistics", "fractions", "decimal", "difflib", "pprint", "secrets", "uuid", "calendar",
           "colorsys", "queue", "sched", "weakref", "copy", "enum", "graphlib", "zlib", "gzip", "tarfile", "zipfile",
           "argparse", "logging", "getopt", "tempfile", "shutil", "filecmp", "sqlite3", "html", "email"]
# the json workload's output format (structured outputs: keys the format forces, values copied from the prompt)
FUNCTION_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "parameters": {
    "type": "array", "items": {"type": "string"}}, "docstring": {"type": "string"}},
    "required": ["name", "parameters", "docstring"], "additionalProperties": False}
TOPICS = ["a lighthouse keeper", "a lost robot", "a desert town", "the first snow", "a clockmaker", "a night train",
          "an old library", "a river festival", "a chess champion", "a hidden garden", "a storm at sea", "a baker",
          "the last dragon", "a mountain rescue", "a street musician", "a moon colony"]


def _paragraph(module: str) -> str:
    text = pydoc.render_doc(__import__(module), renderer=pydoc.plaintext)
    paragraphs = [p.strip() for p in text.split("\n\n") if 200 <= len(p.strip()) <= 700]
    return paragraphs[0] if paragraphs else text[:500]


def _function(module: str) -> str:
    mod = __import__(module)
    for _, fn in inspect.getmembers(mod, inspect.isfunction):
        if fn.__module__ == module:
            source = inspect.getsource(fn)
            if 200 <= len(source) <= 900:
                return source
    try:
        return inspect.getsource(mod)[:600]
    except (OSError, TypeError):  # a module built into the interpreter (zlib on some builds) has no source
        return inspect.getsource(_function)


def workloads(n: int, round_no: int) -> dict[str, list[str]]:
    """``n`` distinct user messages per workload for one round."""
    picks = [MODULES[(round_no * n + i) % len(MODULES)] for i in range(n)]
    tag = f" (request {round_no}.{{}})"
    return {
        "quote": [f"Repeat the following paragraph word for word{tag.format(i)}:\n\n{_paragraph(m)}"
                  for i, m in enumerate(picks)],
        "edit": [f"Add type hints to this Python function and return the whole function{tag.format(i)}:\n\n"
                 f"{_function(m)}" for i, m in enumerate(picks)],
        "free": [f"Write a short story about {TOPICS[(round_no * n + i) % len(TOPICS)]}{tag.format(i)}."
                 for i in range(n)],
        "json": [f"Describe this Python function in JSON: its name, its parameters' names and the first line of its "
                 f"docstring word for word{tag.format(i)}.\n\n{_function(m)}" for i, m in enumerate(picks)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir")
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--concurrency", default="1", help="comma-separated request counts submitted at once")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", default="quote,edit,free", help="of quote, edit, free, json")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; above 0 each request samples with its own seed (the same in both modes)")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    # The two engines share the runner's KV cache: neither may reuse a prefix (the other may have written its blocks
    # since), so prefix caching is off in both (like for like: the chat template's shared head is computed by both).
    plain = Engine.from_dir(args.build_dir, device=args.device, speculative_tokens=0, prefix_caching=False)
    spec = Engine(plain.runner, plain.tokenizer, plain.recipe, plain.eos_token_ids, prefix_caching=False,
                  speculative_tokens=args.speculative_tokens)
    engines = {"plain": plain, "speculative": spec}
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature)
    names = args.workloads.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    for engine in engines.values():  # warm-up
        engine.generate([[{"role": "user", "content": "Say hello."}]], params.replace(max_new_tokens=8))
    tgs: dict = {w: {m: {} for m in engines} for w in names}
    drafts: dict = {w: {} for w in names}
    masks: dict = {w: {m: {} for m in engines} for w in names}  # output-format masks: count, host seconds
    differ: dict = {w: {} for w in names}
    for round_no in range(args.rounds):
        for n in levels:
            messages = workloads(n, round_no * len(levels) + levels.index(n))
            for w in names:
                prompts = [[{"role": "user", "content": text}] for text in messages[w]]
                base = params.replace(structured={"type": "json_schema", "schema": FUNCTION_SCHEMA}) \
                    if w == "json" else params
                seeded = [base.replace(seed=i) if args.temperature else base for i in range(len(prompts))]
                outputs = {}
                for mode, engine in engines.items():
                    before = engine.stats()
                    start = time.perf_counter()
                    done = engine.generate(prompts, seeded)
                    elapsed = time.perf_counter() - start
                    tokens = sum(len(c.token_ids) for c in done)
                    tgs[w][mode][n] = max(tgs[w][mode].get(n, 0.0), tokens / elapsed)
                    outputs[mode] = [c.token_ids for c in done]
                    after = engine.stats()
                    count, seconds = masks[w][mode].get(n, (0, 0.0))
                    masks[w][mode][n] = (count + after["structured_masks"] - before["structured_masks"],
                                         seconds + after["structured_mask_seconds"] - before["structured_mask_seconds"])
                    if mode == "speculative":
                        drafted = after["draft_tokens"] - before["draft_tokens"]
                        accepted = after["accepted_draft_tokens"] - before["accepted_draft_tokens"]
                        total = drafts[w].setdefault(n, {"drafted": 0, "accepted": 0, "generated": 0})
                        total["drafted"] += drafted
                        total["accepted"] += accepted
                        total["generated"] += tokens
                differ[w][n] = differ[w].get(n, 0) + sum(a != b for a, b in zip(outputs["plain"],
                                                                                 outputs["speculative"]))
    spec.shutdown()
    plain.shutdown()
    report = {
        "device": str(plain.runner.device), "speculative_tokens": args.speculative_tokens,
        "temperature": args.temperature,
        "new_tokens": args.new_tokens, "rounds": args.rounds, "tgs": tgs,
        "ratio": {w: {n: tgs[w]["speculative"][n] / tgs[w]["plain"][n] for n in levels} for w in names},
        "drafts": {w: {n: {**d, "acceptance": d["accepted"] / max(1, d["drafted"]),
                           "accepted_per_generated": d["accepted"] / max(1, d["generated"])}
                       for n, d in drafts[w].items()} for w in names},
        "outputs_differing": differ,
        "masks": {w: {m: {n: {"masks": c, "host_us_per_mask": 1e6 * t / c} for n, (c, t) in v.items() if c}
                      for m, v in modes.items()} for w, modes in masks.items() if w == "json"},
        "python": sys.version.split()[0],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Greedy tokens of llmc's engine vs transformers on the same model (e.g. a random Llama-3.1-8B on a GPU).

Runs every prompt alone through transformers ``generate(do_sample=False)`` and all prompts together through
llmc's continuous-batching engine (different lengths, one batch), then compares the token ids. Prints one
JSON object; exit status 1 when a prompt differs in its first ``--tokens`` tokens where
transformers' own logits did not tie between the two choices.

    python scripts/greedy_check.py BUILD_DIR HF_DIR --tokens 16 --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from llmc.runtime.api import Engine
    from llmc.runtime.params import SamplingParams

    engine = Engine.from_dir(args.build_dir, device=args.device)
    vocab = engine.runner.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (7, 33, 130, 517)[: args.prompts]]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    ours = [c.token_ids for c in engine.generate(prompts, params)]
    llmc_s = time.perf_counter() - start
    engine.shutdown()
    dtype = engine.runner.model.transformer.ln_f.weight.dtype
    del engine
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=dtype).to(args.device).eval()
    theirs, margins, scores = [], [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=args.device)
        out = model.generate(ids, do_sample=False, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        theirs.append(out.sequences[0, len(prompt):].tolist())
        scores.append([s[0].float() for s in out.scores])
        top2 = [torch.topk(s[0].float(), 2).values for s in out.scores]
        margins.append(min(float(t[0] - t[1]) for t in top2))
    results = []
    for p, a, b, m, sc in zip(prompts, ours, theirs, margins, scores):
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        # Up to the first difference both saw the same prefix, so transformers' own scores at that step say
        # whether llmc's token was tied with its choice (16-bit logits have coarse spacing: ties are common).
        tie = None if first_diff is None else bool(sc[first_diff][a[first_diff]] == sc[first_diff].max())
        results.append({"prompt_len": len(p), "llmc": list(a), "transformers": b, "match": list(a) == b,
                        "first_difference": first_diff, "tie_at_first_difference": tie,
                        "min_top2_logit_margin_hf": round(m, 4)})
    ok = all(r["match"] or r["tie_at_first_difference"] for r in results)
    print(json.dumps({"device": args.device, "dtype": str(dtype), "tokens": args.tokens, "all_match": ok,
                      "llmc_batch_seconds": round(llmc_s, 3), "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

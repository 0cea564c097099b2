#!/usr/bin/env python3
"""Compare two lm-eval runs' per-request log-likelihoods (``--log_samples`` output folders): e.g. lm-eval's
``local-completions`` model against ``llmc serve`` and its ``hf`` model on the same weights. Prints one JSON object;
exit status 1 when a log-likelihood differs by more than ``--tolerance`` or a greedy flag differs.

    # llmc serve BUILD --port 8311 --device cpu   (in another shell), then from the repository root:
    lm_eval --model local-completions --model_args base_url=http://127.0.0.1:8311/v1/completions,model=NAME,\\
        tokenizer=HF_DIR,tokenizer_backend=huggingface,num_concurrent=4 --include_path scripts/lm_eval \\
        --tasks llmc_local_mc --output_path /tmp/lm_llmc --log_samples
    lm_eval --model hf --model_args pretrained=HF_DIR,dtype=float32 --device cpu --include_path scripts/lm_eval \\
        --tasks llmc_local_mc --output_path /tmp/lm_hf --log_samples
    python scripts/lm_eval/compare.py /tmp/lm_llmc /tmp/lm_hf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def samples(folder: Path) -> dict[tuple[str, int], list]:
    """(task, doc id) -> its filtered responses ([log-likelihood, is greedy] per choice) of the newest samples file
    of each task under ``folder``."""
    out = {}
    newest: dict[str, Path] = {}
    for path in sorted(folder.rglob("samples_*.jsonl")):
        newest[path.name.split("_20")[0]] = path  # names end in a timestamp: the last sorted is the newest
    for task, path in newest.items():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out[(task, record["doc_id"])] = record["filtered_resps"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ours", type=Path)
    parser.add_argument("reference", type=Path)
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest |log-likelihood difference|")
    args = parser.parse_args()
    ours, ref = samples(args.ours), samples(args.reference)
    if not ours or set(ours) != set(ref):
        sys.exit(f"the runs cover different documents ({len(ours)} vs {len(ref)}); run the same tasks on both")
    diffs, flags = [], 0
    for key, responses in ours.items():
        for (ll, greedy), (ll_ref, greedy_ref) in zip(responses, ref[key], strict=True):
            diffs.append(abs(float(ll) - float(ll_ref)))
            flags += str(greedy) != str(greedy_ref)
    report = {"requests": len(diffs), "max_abs_diff": max(diffs), "greedy_flags_differing": flags,
              "tolerance": args.tolerance}
    print(json.dumps(report))
    sys.exit(0 if report["max_abs_diff"] <= args.tolerance and not flags else 1)


if __name__ == "__main__":
    main()

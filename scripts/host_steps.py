#!/usr/bin/env python3
"""The engine's host work per step, without a GPU: llmc's Engine over a runner that only waits for the GPU.

    python scripts/host_steps.py --gpu-step-ms 12 --concurrency 1,64 [--isl 2048 --osl 128] [--serial]

The runner sleeps for a decode step's GPU time (``--gpu-step-ms``) or a prefill's (``--prefill-us-per-token`` per
token) and returns random tokens; everything else is llmc's: the scheduler, the output pipeline (stop checks,
incremental detokenizing with a 128,256-word tokenizer), the events, and ``llmc bench``'s offline closed loop of one
thread per stream. So ``ITL - gpu step`` is the host time a step adds on top of the GPU. By default the runner is
asynchronous like the CUDA runner (``launch`` returns at once, ``result()`` waits out the step), so the engine
overlaps the previous step's token processing with the step; ``--serial`` measures the serial engine (CPU runners).
Prints one JSON object: per level, ITL p50 / p95, TTFT p50, TGS and the engine's step time p50.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.engine.types import ModelRunnerOutput, SchedulerOutput  # noqa: E402


class SleepRunner:
    """A step runner whose steps take ``decode_s`` (every sequence decodes) or ``prefill_s_per_token`` x tokens."""

    block_size = 32
    vocab_size = 128256

    def __init__(self, decode_s: float, prefill_s_per_token: float, asynchronous: bool, num_blocks: int,
                 seed: int = 0):
        self.decode_s, self.prefill_s_per_token = decode_s, prefill_s_per_token
        self.async_steps = asynchronous
        self.num_blocks = num_blocks
        self._rng = random.Random(seed)

    def _plan(self, scheduled: SchedulerOutput) -> tuple[float, ModelRunnerOutput]:
        seqs = scheduled.sequences
        tokens = sum(len(s.token_ids) for s in seqs)
        seconds = self.decode_s if tokens == len(seqs) else tokens * self.prefill_s_per_token
        sampled = {s.request_id: self._rng.randrange(1000, 100_000) for s in seqs if s.sample}
        return (seconds if seqs else 0.0), ModelRunnerOutput(sampled_token_ids=sampled)

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        seconds, output = self._plan(scheduled)
        time.sleep(seconds)
        return output

    def launch(self, scheduled: SchedulerOutput, previous: _Pending | None = None) -> _Pending:
        """The step starts when the previous one ends (one GPU queue); placeholder tokens need no values here."""
        seconds, output = self._plan(scheduled)
        begin = max(time.perf_counter(), previous.done_at if previous is not None else 0.0)
        return _Pending(begin + seconds, output)


class _Pending:
    def __init__(self, done_at: float, output: ModelRunnerOutput):
        self.done_at, self._output = done_at, output

    def result(self) -> ModelRunnerOutput:
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self._output


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu-step-ms", type=float, default=12.0, help="decode step's GPU time")
    ap.add_argument("--prefill-us-per-token", type=float, default=35.0, help="prefill GPU time per prompt token")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--isl", type=int, default=2048)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--serial", action="store_true", help="a synchronous runner (the serial engine path)")
    args = ap.parse_args(argv)

    from llmc.bench.offline import run_level
    from llmc.bench.workload import BenchPrompt
    from llmc.recipe import recipe_from_dict
    from llmc.request.params import SamplingParams
    from llmc.runtime.api import Engine
    from scripts.make_random_llama import word_level_tokenizer

    levels = [int(c) for c in args.concurrency.split(",")]
    max_batch = max(levels)
    recipe = recipe_from_dict({
        "name": "host-steps",
        "model": {"source": ".", "dtype": "bfloat16"},
        "engine": {"max_batch_size": max_batch, "max_input_len": args.isl, "max_seq_len": args.isl + args.osl,
                   "max_num_tokens": max(8192, args.isl)},
    }, check_inputs=False)
    tokenizer = word_level_tokenizer(SleepRunner.vocab_size, 128009)
    blocks = max_batch * -(-(args.isl + args.osl) // SleepRunner.block_size) + 8
    runner = SleepRunner(args.gpu_step_ms / 1e3, args.prefill_us_per_token / 1e6, not args.serial, blocks)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.osl, ignore_eos=True)
    result = {"gpu_step_ms": args.gpu_step_ms, "isl": args.isl, "osl": args.osl, "levels": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for concurrency in levels:
            log = Path(tmp) / f"steps{concurrency}.jsonl"
            engine = Engine(runner, tokenizer, recipe, [128009], prefix_caching=False, metrics_log=log)
            result["engine_path"] = "overlapped" if engine.overlapped_steps else "serial"
            engine.start()
            try:
                prompts = [BenchPrompt("", tuple(rng.randrange(1000, 100_000) for _ in range(args.isl)), args.osl)
                           for _ in range(concurrency)]
                level = run_level(engine, prompts, concurrency, params, step_log=log)
            finally:
                engine.shutdown()
            itls = sorted(b - a for r in level.records for a, b in zip(r.token_times, r.token_times[1:]))
            ttfts = sorted(r.token_times[0] - r.start for r in level.records)
            result["levels"][concurrency] = {
                "itl_p50_ms": round(itls[len(itls) // 2] * 1e3, 3),
                "itl_p95_ms": round(itls[int(len(itls) * 0.95)] * 1e3, 3),
                "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1e3, 3),
                "tgs": round(sum(r.generated_tokens for r in level.records) / level.wall_s, 1),
                "step_p50_ms": round(level.steps["duration_s"]["p50"] * 1e3, 3),
            }
            print(json.dumps({concurrency: result["levels"][concurrency]}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

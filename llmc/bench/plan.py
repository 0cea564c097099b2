"""Benchmark plans: which prompts warm up and which each measured level (and repetition) runs, and the
sampling parameters that make every benchmark request generate exactly its output length."""

from __future__ import annotations

from dataclasses import dataclass

from llmc.bench.workload import BenchPrompt, Workload
from llmc.request.params import SamplingParams


def bench_params(base: SamplingParams, max_new_tokens: int) -> SamplingParams:
    """The sampling parameters of one benchmark request: ``base`` with the prompt's output length enforced
    (``ignore_eos=True`` and ``max_new_tokens``), so every request generates exactly its OSL."""
    return base.replace(max_new_tokens=max_new_tokens, ignore_eos=True, min_tokens=0)


@dataclass(frozen=True)
class BenchPlan:
    """Which prompts warm up and which each measurement runs (``levels``: ``(concurrency, prompts)`` in run order).

    With repetitions, every concurrency level appears once per repetition (``1, 16, 1, 16, ...``: each
    repetition measures all levels, so a slow spell of the host hits them alike). Measurements get disjoint
    slices of the workload when it is large enough, so a KV-cache prefix reused from an earlier level (or from
    the warm-up) never flatters a later level's TTFT."""

    warmup: tuple[BenchPrompt, ...]
    levels: tuple[tuple[int, tuple[BenchPrompt, ...]], ...]

    @property
    def concurrency(self) -> tuple[int, ...]:
        """The distinct levels, in run order."""
        return tuple(dict.fromkeys(c for c, _ in self.levels))

    @property
    def repeat(self) -> int:
        """Measurements per level."""
        return max((sum(1 for c, _ in self.levels if c == level) for level in self.concurrency), default=0)

    def prompts_of(self, concurrency: int) -> tuple[BenchPrompt, ...]:
        """Every prompt measured at ``concurrency``, over all repetitions."""
        return tuple(p for c, prompts in self.levels if c == concurrency for p in prompts)


def level_sizes(levels: tuple[int, ...] | list[int], per_level: int) -> list[int]:
    """Requests per level: ``per_level``, but at least the level's concurrency (so it is reached)."""
    return [max(per_level, c) for c in levels]


def plan_levels(workload: Workload, levels: tuple[int, ...] | list[int], per_level: int, warmup: int,
                repeat: int = 1) -> BenchPlan:
    """Split the workload into warm-up prompts and one slice per level and repetition (cycling only when it is
    too short); the levels run in order, ``repeat`` times."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    sizes = level_sizes(levels, per_level)
    prompts = workload.take(warmup + repeat * sum(sizes))
    out, cursor = [], warmup
    for _ in range(repeat):
        for concurrency, size in zip(levels, sizes):
            out.append((concurrency, prompts[cursor:cursor + size]))
            cursor += size
    return BenchPlan(prompts[:warmup], tuple(out))

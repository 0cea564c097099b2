"""What the GPU allows a benchmark level: an upper bound on its TGS and a lower bound on its TTFT p50.

A figure faster than the hardware can compute is a measuring error (a prefix-cache hit, identical prompts, a
skipped prompt, a wrong clock): the first H200 figures of llmc's README were, and their TTFT gave it away. So
every level of an offline run on a GPU whose peaks are known gets, from its own requests (prompt and generated
tokens) and the engine's shape, weights on the device and KV bytes per token:

- **prefill FLOPs**: per prompt, 2 FLOPs per weight of the decoder's linears per uncached token, plus causal
  attention (QK and PV: ``2 x layers x heads x head_size x L (L + 1)`` for a fresh prompt of L tokens; left out
  where the level had prefix-cache hits, which can remove it);
- **decode bytes**: every decode step reads the weights (all of them but an untied input-embedding table) and
  every decode token reads its sequence's cached K and V; a level of concurrency C takes at least
  ``max(ceil(decode tokens / C), longest request's decode tokens)`` steps;
- ``tgs_max``: generated tokens over ``max(FLOPs / peak FLOP/s, bytes / bandwidth)``: no schedule beats it;
  ``tgs_max_prefill_then_decode``: over their sum, the bound of a schedule that does not overlap the
  compute-bound prefill with the bandwidth-bound decode steps (what a round of simultaneous fresh prompts gets
  when the prompts are prefilled before they are decoded);
- ``ttft_p50_min_s`` (no prefix-cache hits): the median of the prompts' own prefill times at the peak.

Peaks are measured figures, for the GPUs llmc was measured on (``PEAKS``: the H200 and the H100 SXM, by the names
PyTorch gives them); elsewhere no bound is given (an H100 PCIe or NVL has other memory and clocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from llmc.recipe.checks import DTYPE_BYTES


@dataclass(frozen=True)
class Peaks:
    bandwidth: float  # bytes/s the GPU's memory is read at (a read-only stream: what a decode step mostly does)
    flops: float  # dense 16-bit matmul FLOP/s
    source: str


PEAKS = {
    "NVIDIA H200": Peaks(4.54e12, 790e12, "H200 as measured through llmc's device tool: 4.54 TB/s read-only "
                         "stream (scripts/stream_floor.cu, 3.6 GB in one kernel, the faster of two machines: "
                         "4.41-4.54; a torch device copy of 4 GiB reaches 4.29), ~790 TFLOP/s dense bf16 matmul"),
    "NVIDIA H100 80GB HBM3": Peaks(3.20e12, 800e12, "H100 SXM as measured through llmc's device tool: 3.20 TB/s "
                                   "read-only stream (scripts/stream_floor.cu, 3.6 GB in one kernel: 3.17-3.20 on two "
                                   "machines; a torch device copy of 4 GiB reaches 3.05), ~800 TFLOP/s dense bf16 "
                                   "matmul (8192^3 on random data: 799-801 at best)"),
}


def peaks_for(device: str | None, gpu_name: str | None) -> Peaks | None:
    """The peaks of the GPU a run used (``device`` cuda..., ``gpu_name`` as torch names it), or None."""
    if not device or not str(device).startswith("cuda") or not gpu_name:
        return None
    return PEAKS.get(gpu_name)


def shape_of(config: Any) -> dict[str, Any]:
    """The figures of a model config (:class:`llmc.engine.torch.model.ModelConfig`) the bounds need."""
    return {name: getattr(config, name) for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                      "head_size", "intermediate_size", "vocab_size",
                                                      "tie_word_embeddings", "dtype")}


def linear_params(shape: dict[str, Any]) -> int:
    """Weights of the decoder layers' linears (qkv, o, gate and up, down), all layers."""
    h, q, kv = shape["hidden_size"], shape["num_heads"] * shape["head_size"], shape["num_kv_heads"] * shape["head_size"]
    return shape["num_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * shape["intermediate_size"])


def prompt_flops(shape: dict[str, Any], tokens: int, attention: bool = True) -> float:
    """FLOPs of a fresh prompt's prefill: the linears, and causal attention unless ``attention`` is False."""
    flops = 2.0 * linear_params(shape) * tokens
    if attention:
        flops += 2.0 * shape["num_layers"] * shape["num_heads"] * shape["head_size"] * tokens * (tokens + 1)
    return flops


def step_weight_bytes(shape: dict[str, Any], weight_bytes: dict[str, int], host_bytes: dict[str, int] | None = None
                      ) -> int:
    """Weight bytes one decode step reads: all on the device but an untied input-embedding table (read a row a
    token), unless that table is the weights the engine holds in host memory (``host_bytes``; not counted)."""
    total = sum(weight_bytes.values())
    if not shape["tie_word_embeddings"] and not host_bytes:
        total -= shape["vocab_size"] * shape["hidden_size"] * DTYPE_BYTES.get(shape["dtype"], 2)
    return max(total, 0)


def level_bound(requests: Sequence[tuple[int, int]], concurrency: int, hit_tokens: int, shape: dict[str, Any],
                weight_bytes: dict[str, int], kv_bytes_per_token: int, peaks: Peaks,
                host_bytes: dict[str, int] | None = None) -> dict[str, Any]:
    """Bounds of one measured repetition: ``requests`` its (prompt tokens, generated tokens), ``hit_tokens`` the
    prompt tokens it served from the prefix cache, ``host_bytes`` the weights held in host memory
    (:func:`step_weight_bytes`)."""
    prompts = sum(p for p, _ in requests)
    flops = (sum(prompt_flops(shape, p) for p, _ in requests) if not hit_tokens
             else prompt_flops(shape, max(prompts - hit_tokens, 0), attention=False))
    decodes = [max(g - 1, 0) for _, g in requests]  # the first token comes with the prefill
    steps = max(math.ceil(sum(decodes) / max(concurrency, 1)), max(decodes, default=0))
    # decode token t (1-based) of a prompt of p tokens reads at least the p + t - 1 cached positions before it
    kv_reads = sum(d * p + d * (d - 1) // 2 for (p, _), d in zip(requests, decodes))
    moved = steps * step_weight_bytes(shape, weight_bytes, host_bytes) + kv_reads * kv_bytes_per_token
    compute_s, memory_s = flops / peaks.flops, moved / peaks.bandwidth
    generated = sum(g for _, g in requests)
    own = sorted(prompt_flops(shape, p) / peaks.flops for p, _ in requests)
    return {
        "tgs_max": generated / max(compute_s, memory_s) if compute_s or memory_s else None,
        "tgs_max_prefill_then_decode": generated / (compute_s + memory_s) if compute_s or memory_s else None,
        "ttft_p50_min_s": own[(len(own) - 1) // 2] if own and not hit_tokens else None,
        "prefill_tflop": flops / 1e12, "decode_steps": steps, "decode_gb": moved / 1e9,
        "peaks": peaks.source,
    }


def check(level: dict[str, Any], bound: dict[str, Any]) -> list[str]:
    """What in a level's figures the hardware cannot do (empty: nothing)."""
    problems = []
    tgs, ttft = level.get("tgs"), (level.get("ttft_s") or {}).get("p50")
    if tgs and bound.get("tgs_max") and tgs > bound["tgs_max"]:
        problems.append(f"TGS {tgs:.1f} tok/s is above the bound {bound['tgs_max']:.1f}")
    if ttft is not None and bound.get("ttft_p50_min_s") and ttft < bound["ttft_p50_min_s"]:
        problems.append(f"TTFT p50 {ttft * 1e3:.1f} ms is below the prompts' prefill at the peak "
                        f"({bound['ttft_p50_min_s'] * 1e3:.1f} ms)")
    return problems

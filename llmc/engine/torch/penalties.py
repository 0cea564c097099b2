"""Repetition, frequency and presence penalties (OpenAI / vLLM semantics) of a step's logits, on the device: the
sampler's stage 3 (:mod:`llmc.engine.torch.sampler`)."""

from __future__ import annotations

from typing import Sequence

import torch

from llmc.engine.types import ScheduledSequence


def apply_penalties(
    logits: torch.Tensor, seqs: Sequence[ScheduledSequence], device: torch.device
) -> torch.Tensor:
    """Penalized copy of ``logits [S, V]``: repetition (prompt + output ids), then frequency and presence.

    Repetition divides positive logits and multiplies negative ones by ``repetition_penalty`` for every token
    seen in the prompt or the output; then ``frequency_penalty * count + presence_penalty * (count > 0)``
    is subtracted, counting the output ids only. Rows without penalties come back unchanged.
    """
    num_rows, vocab = logits.shape
    seen_ids, out_ids, factors = [], [], []
    for s in seqs:
        p = s.params
        use = p.uses_penalties
        seen_ids.append(tuple(s.prompt_token_ids) + tuple(s.output_token_ids) if use else ())
        out_ids.append(tuple(s.output_token_ids) if use else ())
        factors.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    seen = _padded(seen_ids, pad=vocab).to(device, non_blocking=True)  # [S, Ls], pad = vocab
    out = _padded(out_ids, pad=vocab).to(device, non_blocking=True)  # [S, Lo]
    f = torch.tensor(factors, dtype=torch.float32).to(device, non_blocking=True)  # [S, 3]
    rep, freq, pres = f[:, 0:1], f[:, 1:2], f[:, 2:3]

    # one extra column absorbs the padding, then is dropped
    seen_mask = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device)
    seen_mask.scatter_(1, seen, True)
    seen_mask = seen_mask[:, :vocab]  # [S, V]
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.float32))
    counts = counts[:, :vocab]  # [S, V]

    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen_mask, penalized, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _padded(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """``[len(rows), max_len]`` int64 on the host, right-padded with ``pad`` (at least one column)."""
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out

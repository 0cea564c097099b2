"""Log-probabilities of a request's prompt tokens (``SamplingParams.prompt_logprobs``), computed by the step that
runs the prompt's chunk: what scoring and evaluation harnesses ask for (a continuation's log-likelihood).

A chunk covers prompt positions ``p = num_computed .. num_computed + n - 1``; the hidden state at ``p`` scores
prompt token ``p + 1`` (the last prompt position scores the first generated token: that is the sampled token's own
log-probability, ``SamplingParams.logprobs``). The logits layer runs over those rows in slices of
:data:`SLICE_ROWS` (a 2,048-token chunk of a 128k-token vocabulary would be 1 GB of float32 logits at once); each
slice's log-softmax is float32 over the raw logits, as for generated tokens (as ``logits - logsumexp``: the
full log-softmax is never written). Steps with such a chunk run eagerly (the captured graphs compute the logits of
the sampled rows only); other steps pay one pass over their sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llmc.engine.torch.sampler import sanitize_
from llmc.engine.types import ScheduledSequence
from llmc.request.outputs import TokenLogprob

# Prompt rows a logits pass takes at once. H200, the 8B shape's lm_head, 2,047 rows: 6.9 ms for the pass (3.1 of
# them the GEMM) at 256 rows a slice, 6.2 at 1,024; 256 keeps a slice's float32 logits at 131 MB.
SLICE_ROWS = 256


def wanted(seqs: Sequence[ScheduledSequence]) -> bool:
    """Whether a sequence of the step has prompt positions to score."""
    for s in seqs:
        if s.params.prompt_logprobs is not None and s.num_computed < len(s.prompt_token_ids) - 1:
            return True
    return False


@dataclass(frozen=True)
class PromptRows:
    """One step's prompt log-probabilities on the device: ``spans`` (request id, first position scored, rows,
    alternatives asked for) in row order, the scored ``targets`` (host), ``chosen`` [R] and the most likely
    ``top_logprobs`` / ``top_ids`` [R, k] (k: the most alternatives a span asked for)."""

    spans: tuple[tuple[str, int, int, int], ...]
    targets: tuple[int, ...]
    chosen: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.chosen, self.top_logprobs, self.top_ids

    def entries(self, host: Sequence[torch.Tensor]) -> dict[str, tuple[int, tuple[TokenLogprob, ...]]]:
        """Request id -> (first position, one :class:`TokenLogprob` per position) from :meth:`tensors`' values
        on the host."""
        chosen, top_lps, top_ids = (t.tolist() for t in host)
        out, row = {}, 0
        for request_id, start, count, k in self.spans:
            out[request_id] = (start, tuple(
                TokenLogprob(self.targets[r], chosen[r], tuple(zip(top_ids[r][:k], top_lps[r][:k])))
                for r in range(row, row + count)))
            row += count
        return out


def prompt_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                seqs: Sequence[ScheduledSequence]) -> PromptRows | None:
    """Score the prompt positions of ``seqs``' chunks from the step's ``hidden`` [T, H] (the sequences' new tokens
    packed in order); None when no sequence asks."""
    index: list[int] = []
    targets: list[int] = []
    spans = []
    offset = 0
    for s in seqs:
        prompt, first = s.prompt_token_ids, s.num_computed
        if s.params.prompt_logprobs is not None and first < len(prompt) - 1:
            end = min(first + len(s.token_ids), len(prompt) - 1)  # positions first .. end - 1 score a prompt token
            index += range(offset, offset + end - first)
            targets += prompt[first + 1:end + 1]
            spans.append((s.request_id, first + 1, end - first, s.params.prompt_logprobs))
        offset += len(s.token_ids)
    if not spans:
        return None
    k = max(span[3] for span in spans)
    rows = torch.tensor(index, dtype=torch.long).to(hidden.device, non_blocking=True)
    wanted_ids = torch.tensor(targets, dtype=torch.long).to(hidden.device, non_blocking=True)
    chosen, top_lps, top_ids = [], [], []
    for i in range(0, len(index), SLICE_ROWS):
        logits = compute_logits(hidden.index_select(0, rows[i:i + SLICE_ROWS]))  # [r, V] float32, a new tensor
        sanitize_(logits)
        norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # log-softmax = logits - norm (one pass less)
        chosen.append((logits.gather(1, wanted_ids[i:i + SLICE_ROWS, None]) - norm).squeeze(1))
        # the most likely token alone: a max (topk's selection took 3.3 of 10.2 ms for 2,047 rows of the 8B shape)
        values, ids = logits.max(dim=-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1)
        top_lps.append(values - norm)
        top_ids.append(ids)
    return PromptRows(tuple(spans), tuple(targets), torch.cat(chosen), torch.cat(top_lps), torch.cat(top_ids))

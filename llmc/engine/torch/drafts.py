"""Draft tokens in the torch runner (prompt-lookup speculation: :mod:`llmc.runtime.scheduler.speculate`).

A sequence with ``num_draft`` drafts runs its decode token and the drafts as one short chunk; the logits at each of
its new tokens but the last (:func:`~llmc.engine.torch.cuda_graphs.verify_rows`) choose the token that follows,
and the last row is sampled as usual. Each drafted row chooses as that output position would without drafts
(:func:`draft_views`: the sampler sees the output so far plus the drafts before the row, so a seed's index,
``min_tokens`` and the penalties follow plain decoding, and an output format's row its mask at that position):
greedy rows take the argmax; a sampled row's draw equals the draft with probability p(draft) and is otherwise a
draw from p without the draft, speculative sampling's rule for a one-token draft, so the output keeps plain
decoding's distribution (and a seeded request its tokens). The scheduler keeps the drafts up to the first row whose
choice differs. Rows whose request asks for token log-probabilities get them as sampled rows do
(:func:`~llmc.engine.torch.sampler.token_logprobs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from llmc.engine.torch.sampler import LogprobRows, Sampler, token_logprobs
from llmc.engine.types import ScheduledSequence
from llmc.request.outputs import TokenLogprob


def draft_views(seqs: Sequence[ScheduledSequence]) -> list[ScheduledSequence]:
    """One view per drafted row (``verify_rows``' order): row ``i`` of a sequence with drafts chooses its output
    token number ``len(output_token_ids) + i``, after its first ``i`` drafts."""
    views = []
    for s in seqs:
        drafts = s.draft_token_ids
        masks = s.draft_masks if s.draft_masks is not None else [None] * len(drafts)
        views.extend(dataclasses.replace(s, output_token_ids=s.output_token_ids + drafts[:i], token_mask=masks[i])
                     for i in range(len(drafts)))
    return views


def after_drafts(sampled: tuple[ScheduledSequence, ...]) -> tuple[ScheduledSequence, ...]:
    """The sampled sequences as their last row chooses: a drafted one after all its drafts (its output token number
    ``len(output_token_ids) + num_draft``)."""
    return tuple(dataclasses.replace(s, output_token_ids=s.output_token_ids + s.draft_token_ids)
                 if s.num_draft else s for s in sampled)


@dataclasses.dataclass(frozen=True)
class DraftRows:
    """The tokens a step's drafted rows chose (``ids`` [R], on the device) and whose they are (``counts``: request id,
    number of drafts, in row order), with their log-probabilities where asked for (``logprobs``, rows indexing
    the drafted rows)."""

    counts: tuple[tuple[str, int], ...]
    ids: torch.Tensor
    logprobs: LogprobRows | None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What :meth:`entries` reads, to be copied to the host behind the step's kernels."""
        lp = self.logprobs
        return (self.ids,) + ((lp.chosen, lp.top_logprobs, lp.top_ids) if lp else ())

    def entries(self, host: Sequence[torch.Tensor]
                ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[TokenLogprob, ...]]]:
        """({request id: its rows' tokens}, {request id: their log-probabilities, where asked for}) from
        :meth:`tensors`' values on the host (``ModelRunnerOutput.verify_token_ids`` / ``verify_logprobs``)."""
        ids = host[0].tolist()
        per_row: dict[int, TokenLogprob] = {}
        if self.logprobs is not None:
            chosen, top_lps, top_ids = (t.tolist() for t in host[1:])
            for j, (row, count) in enumerate(zip(self.logprobs.rows, self.logprobs.counts)):
                per_row[row] = TokenLogprob(ids[row], chosen[j], tuple(zip(top_ids[j][:count], top_lps[j][:count])))
        tokens, logprobs, at = {}, {}, 0
        for request_id, count in self.counts:
            tokens[request_id] = tuple(ids[at:at + count])
            if at in per_row:
                logprobs[request_id] = tuple(per_row[r] for r in range(at, at + count))
            at += count
        return tokens, logprobs


def choose(sampler: Sampler, seqs: Sequence[ScheduledSequence], logits: torch.Tensor,
           greedy: torch.Tensor | None = None) -> DraftRows:
    """The drafted rows' choices from their ``logits`` [R, V] (``greedy``: their argmax where already computed)."""
    views = draft_views(seqs)
    if sampler.plain_greedy(views):
        ids = greedy if greedy is not None else torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1)
    else:
        ids = sampler(logits, views)
    return DraftRows(tuple((s.request_id, s.num_draft) for s in seqs if s.num_draft), ids,
                     token_logprobs(logits, ids, views))

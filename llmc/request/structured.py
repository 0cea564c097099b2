"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regular expression, one of
a list of strings, or a context-free grammar (Lark or EBNF syntax) (``SamplingParams.structured``).

:class:`OutputFormat` is the request's description (validated for shape without any library). :class:`Grammars`
(one per engine) compiles it against the engine's tokenizer with llguidance (a Rust library: compiling a JSON schema
takes about a millisecond; its tokenizer index, built once per engine, about 0.3 s for SmolLM2's 49,152 tokens: in
the background while a loaded engine warms up, else on the first structured request) into a :class:`Constraint`:
before each token the request samples, the constraint computes which token ids may come next (a bitmask of 32-bit
words, bit ``i % 32`` of word ``i // 32`` for token ``i``: llguidance's layout), the sampler sets every other token's
logit to -inf on the device, and the sampled token advances the constraint. The end-of-sequence ids are allowed once
the output may end; a constraint that admits no further token ends its request ("stop").
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmc.errors import RequestError, short_repr
from llmc.request.json_strict import close_objects
from llmc.tokenizer import byte_level_decoder

log = logging.getLogger(__name__)

MIN_POOL_CPUS = 4  # fewer CPUs: a step's masks are computed one after the other (on 2 cores llguidance's pool of
# one thread took 130 us a mask at 8 rows against 121 us in turn: scripts/bench_structured.py, SmolLM2, regex format)
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "ebnf")
_FIELD = "structured"
PROBE = "Paris is green\n\tand {\"x\": 1}"  # llguidance must read its tokens back as these bytes
_SPEC_KEY = {"json_schema": "schema", "regex": "pattern", "choice": "choices", "grammar": "grammar", "ebnf": "grammar"}
_EXAMPLE = ('{"type": "json_schema", "schema": {...}}, {"type": "json_object"}, {"type": "regex", "pattern": "..."}, '
            '{"type": "choice", "choices": ["yes", "no"]}, {"type": "grammar", "grammar": "start: ..."} (Lark syntax), '
            '{"type": "ebnf", "grammar": "root ::= ..."} (GBNF / EBNF syntax)')


@dataclass(frozen=True)
class OutputFormat:
    """What a request's output must be. ``kind``: one of :data:`KINDS`; ``spec``: the JSON schema as JSON text
    (``json_schema``; an object that lists properties allows no others unless it says so:
    :mod:`llmc.request.json_strict`), the regular expression (``regex``, Rust ``regex`` syntax with ASCII
    ``\\d \\w \\s``, matched against the whole output),
    the choices as a JSON list (``choice``), the grammar (``grammar``: llguidance's Lark syntax; ``ebnf``: the
    ``root ::= ...`` syntax of llama.cpp's GBNF and XGrammar's EBNF, which Triton's ``ebnf_grammar`` guides use), ""
    for ``json_object``."""

    kind: str
    spec: str = ""

    @classmethod
    def from_dict(cls, d: Any) -> OutputFormat:
        """From ``{"type": kind, <its key>: value}`` (the keys: ``schema``, ``pattern``, ``choices``, ``grammar``);
        RequestError naming ``structured`` (or ``structured.<key>``) for anything else."""
        if isinstance(d, OutputFormat):
            return d
        if not isinstance(d, Mapping) or d.get("type") not in KINDS:
            raise RequestError(_FIELD, f"must be an object with a type in {', '.join(KINDS)}, got {short_repr(d)}; "
                                       f"e.g. {_EXAMPLE}")
        kind = d["type"]
        key = _SPEC_KEY.get(kind)
        extra = set(d) - {"type", key}
        if extra:
            raise RequestError(f"{_FIELD}.{sorted(extra)[0]}", f"is not a field of a {kind!r} format; it takes "
                                                               f"{'nothing but type' if key is None else repr(key)}")
        if key is None:
            return cls(kind)
        value = d.get(key)
        where = f"{_FIELD}.{key}"
        if kind == "json_schema":
            if not isinstance(value, (Mapping, bool)):
                raise RequestError(where, f"must be a JSON schema (an object), got {short_repr(value)}")
            return cls(kind, json.dumps(value))  # key order kept: properties come in that order
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise RequestError(where, f"must be a non-empty list of non-empty strings, got {short_repr(value)}")
            return cls(kind, json.dumps(list(value)))
        if not isinstance(value, str) or not value:
            raise RequestError(where, f"must be a non-empty string, got {short_repr(value)}")
        return cls(kind, value)

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads (``from_dict(f.to_dict()) == f``)."""
        key = _SPEC_KEY.get(self.kind)
        if key is None:
            return {"type": self.kind}
        value = json.loads(self.spec) if self.kind in ("json_schema", "choice") else self.spec
        return {"type": self.kind, key: value}

    def grammar(self, llguidance: Any) -> str:
        """llguidance's grammar text for this format."""
        matcher = llguidance.LLMatcher
        if self.kind in ("json_object", "json_schema"):
            schema: Any = {"type": "object"}
            if self.kind == "json_schema":
                schema = json.dumps(close_objects(json.loads(self.spec)))
            try:
                return matcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            except TypeError:  # llguidance 0.7 (TensorRT-LLM 1.2's pin): no defaults (its own: whitespace allowed)
                return matcher.grammar_from_json_schema(schema)
        if self.kind == "regex":
            return matcher.grammar_from_regex(ascii_classes(self.spec))
        if self.kind == "choice":  # JSON string literals are Lark string literals
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.spec)))
        if self.kind == "ebnf":
            return llguidance.grammar_from("ebnf", self.spec)  # converted to Lark; ValueError when it cannot be
        return matcher.grammar_from_lark(self.spec)


# \d \w \s and their negations as ASCII classes, as JSON Schema's (ECMAScript) patterns, which llguidance already reads
# so, and XGrammar's regex converter (TensorRT-LLM's and vLLM's default; mlc-ai/xgrammar@105c915 cpp/regex_converter.cc:
# \d is [0-9]) read them. Rust's are Unicode: SmolLM2 answered "🯱🯱🯱-🯱🯱🯱-🯱🯱🯱🯱" (U+1FBF1, a segmented
# digit one) to a phone-number regex of \d. A class nests in a class in Rust's syntax, so each stands inside [...] too.
_ASCII_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]", "s": "[\\t\\n\\v\\f\\r ]",
                  "S": "[^\\t\\n\\v\\f\\r ]"}


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\w``, ``\\s``, ``\\D``, ``\\W``, ``\\S`` spelled as ASCII classes (``\\p{Nd}``
    asks for every Unicode digit); every other escape, ``\\\\`` included, is kept as written."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            out.append(_ASCII_CLASSES.get(pattern[i + 1], pattern[i:i + 2]))
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


class Constraint:
    """One request's compiled format and how far its output got (used by the thread that runs the steps)."""

    def __init__(self, matcher: Any, words: int, executor: Callable[[], Any]):
        self._matcher = matcher
        self._words = words
        self._executor = executor  # the engine's llguidance thread pool (made on first use)

    def mask(self) -> np.ndarray:
        """The token ids allowed next: int32 ``[ceil(vocab / 32)]``, bit ``i % 32`` of word ``i // 32``."""
        out = np.zeros(self._words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    @staticmethod
    def masks(constraints: Sequence[Constraint], drafts: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """Every constraint's :meth:`mask` (int32 ``[len(constraints), words]``): several in parallel on llguidance's
        own threads where the engine has a pool (a step's masked rows take tens of microseconds to a few hundred
        each, which would add up on the step loop), else one after the other. ``drafts`` (one sequence per
        constraint, each from :meth:`drafts`): a constraint with ``k`` draft tokens gets ``k + 1`` rows, its mask
        now and after each of its drafts (the rows a drafted step samples); its state is left as it was."""
        counts = [len(d) for d in drafts] if drafts is not None else [0] * len(constraints)
        out = np.zeros((len(constraints) + sum(counts), constraints[0]._words), dtype=np.int32)
        pool = constraints[0]._executor() if len(out) > 1 else None
        rows = list(zip(constraints, _starts(counts), drafts or [()] * len(constraints)))
        if pool is not None:
            plain = [(c._matcher, at) for c, at, d in rows if not d]
            if plain:
                pool.unsafe_compute_mask_ptr(plain, out.ctypes.data, out.shape[1] * 4, out.shape[0])
            rows = [row for row in rows if row[2]]
            batched = getattr(pool, "unsafe_compute_mask_ptr_with_draft_token", None)  # (not in llguidance 0.7)
            if rows and batched is not None:  # it takes only constraints that have drafts
                batched([(c._matcher, at, list(d)) for c, at, d in rows], out.ctypes.data, out.shape[1] * 4,
                        out.shape[0])
                rows = []
        for c, at, d in rows:  # in turn: each mask, advanced over each draft, then rolled back
            out[at] = c.mask()
            for i, token in enumerate(d):
                if not c._matcher.consume_token(token):
                    raise ValueError(f"draft token {token} is not allowed by the output format")
                out[at + 1 + i] = c.mask()
            if d:
                c._matcher.rollback(len(d))
        return out

    def drafts(self, proposed: Sequence[int], limit: int) -> tuple[int, ...]:
        """Draft tokens for the output's next positions (speculation), at most ``limit``: the longest prefix of
        ``proposed`` (prompt lookup's) that the format allows, where it is longer than the tokens the format forces
        from here and begins with them; else those forced tokens (a schema's next key, the rest of the only choice
        left: llguidance's fast-forward tokens), else the allowed prefix."""
        if limit <= 0:
            return ()
        forced = tuple(self._matcher.compute_ff_tokens()[:limit])
        proposed = list(proposed[:limit])
        allowed = tuple(proposed[:self._matcher.validate_tokens(proposed)]) if proposed else ()
        if len(allowed) > len(forced) and allowed[:len(forced)] == forced:
            return allowed
        return forced or allowed

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False when the format does not allow it (the constraint is then broken)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def complete(self) -> bool:
        """True when no further token is allowed (the output is a whole match; only an end id could follow)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class Grammars:
    """Compiles :class:`OutputFormat` values for one engine: its tokenizer (a Hugging Face fast tokenizer), the
    model's vocabulary size (the logits' width; ids past the tokenizer's are never allowed) and its end ids."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], mask_threads: int | None = None):
        """``mask_threads``: llguidance threads that compute a step's masks together; None: 80 % of the CPUs (at
        most 32) where there are at least :data:`MIN_POOL_CPUS`, else none; 0 or 1: none (one after the other)."""
        if mask_threads is None:
            mask_threads = 0 if (os.cpu_count() or 1) < MIN_POOL_CPUS else -1  # -1: llguidance's default count
        self.mask_threads = mask_threads
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._index: Any = None  # llguidance's tokenizer, built on first use
        self._pool: Any = None  # llguidance's LLExecutor (its threads compute a step's masks), made on first use
        self._lock = threading.Lock()
        self.ready = threading.Event()  # set once the tokenizer index is built (or found unreadable)

    def prepare(self) -> None:
        """Build the tokenizer index now, so the first structured request does not pay for it (0.7-1.1 s for
        SmolLM2's 49,152 tokens on 2 cores; longer for larger vocabularies). Not on a thread beside the engine:
        llguidance holds the GIL while it builds, which stalled the first request's steps as long (TTFT 1.1-1.3 s
        instead of 0.08 s). A tokenizer llguidance cannot read is reported to the first structured request."""
        try:
            self._tokenizer_index(_llguidance())
        except RequestError as exc:
            log.debug("structured outputs unavailable: %s", exc)

    def compile(self, fmt: OutputFormat) -> Constraint:
        """A fresh constraint for ``fmt``; RequestError naming ``structured`` when the format is invalid (a schema
        llguidance does not support, a bad regular expression or grammar)."""
        llguidance = _llguidance()
        index = self._tokenizer_index(llguidance)
        try:
            grammar = fmt.grammar(llguidance)
        except ValueError as exc:
            raise RequestError(_FIELD, f"is not a valid {fmt.kind} format: {exc}") from None
        try:
            matcher = llguidance.LLMatcher(index, grammar, log_level=0)
        except (ValueError, RuntimeError) as exc:  # versions that raise instead of entering the error state
            raise RequestError(_FIELD, f"is not a valid {fmt.kind} format: {_first_lines(str(exc))}") from None
        if matcher.is_error():
            raise RequestError(_FIELD, f"is not a valid {fmt.kind} format: {_first_lines(matcher.get_error())}")
        return Constraint(matcher, (self.vocab_size + 31) // 32, self._executor)

    def _executor(self) -> Any:
        """The thread pool for a step's masks; None: compute them one after the other."""
        if 0 <= self.mask_threads <= 1:
            return None
        with self._lock:
            if self._pool is None:
                threads = None if self.mask_threads < 0 else self.mask_threads
                self._pool = _llguidance().LLExecutor(num_threads=threads)
            return self._pool

    def _tokenizer_index(self, llguidance: Any) -> Any:
        with self._lock:
            try:
                return self._build_index(llguidance)
            finally:
                self.ready.set()

    def _build_index(self, llguidance: Any) -> Any:
        if self._index is None:
            backend = getattr(self._hf, "backend_tokenizer", None)
            if backend is None:
                raise RequestError(_FIELD, f"needs a fast (Rust) tokenizer; this engine's is "
                                           f"{type(self._hf).__name__}")
            backend = copy.copy(backend)  # its JSON without the padding and truncation a caller may have set
            backend.no_padding()
            backend.no_truncation()
            text = byte_level_decoder(backend.to_str())
            ends = self.eos_token_ids or None
            try:
                try:
                    index = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=ends)
                except TypeError:  # llguidance 0.7 (TensorRT-LLM 1.2's pin) takes one end id: the first one
                    index = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                   eos_token=ends[0] if ends else None)
            except (ValueError, RuntimeError) as exc:  # e.g. a decoder it cannot map tokens to bytes through
                raise RequestError(_FIELD, f"is not available for this engine's tokenizer: llguidance cannot "
                                           f"read it ({exc}); structured outputs need a byte-level BPE, "
                                           f"SentencePiece (byte-fallback) or similar tokenizer") from None
            ids = self._hf.encode(PROBE, add_special_tokens=False)
            read = bytes(index.decode_bytes(list(ids)))
            if read.strip() != PROBE.encode().strip():  # (SentencePiece tokens keep their word's leading space)
                raise RequestError(_FIELD, f"is not available for this engine's tokenizer: llguidance reads its "
                                           f"tokens as other bytes ({PROBE!r} -> {read!r}), so every mask would "
                                           f"be wrong; structured outputs need a byte-level BPE, SentencePiece "
                                           f"(byte-fallback) or similar tokenizer")
            self._index = index
        return self._index


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a core dependency; missing only from a broken install
        raise RequestError(_FIELD, f"structured outputs need the llguidance package ({exc}); install it: "
                                   f"pip install 'llguidance>=0.7.29,<2'") from None
    return llguidance


def _starts(counts: Sequence[int]) -> list[int]:
    """The first row of each constraint in :meth:`Constraint.masks`' output (one row and one per draft each)."""
    starts, at = [], 0
    for n in counts:
        starts.append(at)
        at += 1 + n
    return starts


def _first_lines(text: str) -> str:
    """llguidance's message without its source excerpt: the first line and the lines that say ``error:``."""
    lines = [line.strip() for line in text.strip().splitlines()]
    kept = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(kept)

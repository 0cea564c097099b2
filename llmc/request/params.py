"""SamplingParams: the one sampling-parameter type used by the CLI, the Python API and the server.

Construct it directly (Python) or with :meth:`SamplingParams.from_dict` (CLI flags, server JSON, recipe
``runtime.sampling``); call :meth:`SamplingParams.validate` at the edge, once the vocabulary size is known.
Every problem raises :class:`~llmc.errors.RequestError` whose ``field`` names the offending field and whose
message says how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from llmc.errors import RequestError
from llmc.request.structured import KINDS, OutputFormat

_UINT64_MAX = 2**64 - 1
MAX_LOGPROBS = 20  # the most alternatives a token's log-probabilities come with (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS = 100.0  # |bias| bound of logit_bias (OpenAI's: -100 bans a token, 100 all but forces it)
MAX_LOGIT_BIAS_IDS = 300  # token ids one request may bias (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters. Defaults are identical on every entry point.

    ``temperature == 0`` means greedy. ``seed`` makes a request reproducible regardless of the batch.
    ``logprobs`` (None: off) returns each generated token's log-probability under the model (the log-softmax of
    its raw logits, before temperature, penalties and filters) and that of the ``logprobs`` most likely tokens
    (0 to :data:`MAX_LOGPROBS`). ``prompt_logprobs`` (None: off) does the same for the prompt: each prompt token
    after the first gets its log-probability given the tokens before it, and the ``prompt_logprobs`` most likely
    tokens' at that position (what scoring and evaluation harnesses ask for: a continuation's log-likelihood).
    Such a request reuses no cached prefix (every prompt position is computed).
    ``structured`` (None: off) constrains the output to a format (:class:`~llmc.request.structured.OutputFormat`:
    a JSON schema, any JSON object, a regular expression, one of a list of strings, a grammar): tokens the format
    does not allow next are never sampled, and the request ends ("stop") once the output is complete.
    ``logit_bias``: ``(token id, bias)`` pairs added to those tokens' logits before penalties and sampling (bias in
    [-100, 100], OpenAI's; -100 in effect bans a token).
    Penalties follow the OpenAI / vLLM semantics: ``repetition_penalty`` (multiplicative, > 1 discourages)
    applies to every token seen in the prompt or the output; ``presence_penalty`` (subtracted once) and
    ``frequency_penalty`` (subtracted per occurrence) apply to tokens of the output only. Stop tokens and stop
    strings are honoured only after ``min_tokens`` generated tokens.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: OutputFormat | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # The Python API's natural spellings: a format as a mapping, a bias as {token id: bias}
        if self.structured is not None and (not isinstance(self.structured, OutputFormat)
                                            or self.structured.kind not in KINDS):
            object.__setattr__(self, "structured", OutputFormat.from_dict(self.structured))
        if not isinstance(self.logit_bias, tuple) or any(not isinstance(p, tuple) for p in self.logit_bias):
            object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    # ------------------------------------------------------------------------------------------------
    # Derived flags (read by the sampler to skip work no row needs)
    # ------------------------------------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """True when any of the repetition / presence / frequency penalties changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """True when the request changes its logits before sampling (penalties, a logit bias, an output format)."""
        return self.uses_penalties or bool(self.logit_bias) or self.structured is not None

    # ------------------------------------------------------------------------------------------------
    # Validation
    # ------------------------------------------------------------------------------------------------

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Check every field; return ``self`` so calls chain. Raises :class:`RequestError` naming the field.

        ``vocab_size`` (when known) bounds ``stop_token_ids`` to ``[0, vocab_size)``.
        """
        self._validate_types()
        self._validate_ranges()
        self._validate_stops(vocab_size)
        self._validate_logit_shaping(vocab_size)
        return self

    def _validate_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _NULLABLE:
                if value is not None and not _is_int(value):
                    raise RequestError(f.name, f"must be an integer or null, got {value!r}; pass e.g. "
                                               f"{f.name}={0 if f.name == 'seed' else 5}")
            elif isinstance(f.default, bool):
                if not isinstance(value, bool):
                    raise RequestError(f.name, f"must be true or false, got {value!r}")
            elif isinstance(f.default, int):
                if not _is_int(value):
                    raise RequestError(f.name, f"must be an integer, got {value!r}")
            elif isinstance(f.default, float):
                if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                    raise RequestError(f.name, f"must be a finite number, got {value!r}")

    def _validate_ranges(self) -> None:
        if self.max_new_tokens <= 0:
            raise RequestError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}; ask for at least one "
                                                 f"token (the default is 256)")
        if self.temperature < 0:
            raise RequestError("temperature", f"must be >= 0, got {self.temperature}; use 0 for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}; use 1.0 to disable nucleus sampling")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be >= 0, got {self.top_k}; use 0 to disable top-k")
        if not 0 <= self.min_p <= 1:
            raise RequestError("min_p", f"must be in [0, 1], got {self.min_p}; use 0 to disable min-p")
        if self.repetition_penalty <= 0:
            raise RequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}; use 1.0 to "
                                                     f"disable it (> 1 discourages repeats)")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise RequestError("min_tokens", f"must be in [0, max_new_tokens={self.max_new_tokens}], got "
                                             f"{self.min_tokens}; lower min_tokens or raise max_new_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise RequestError(name, f"must be in [0, {MAX_LOGPROBS}] (the most likely tokens returned with "
                                         f"each token's own log-probability), got {value}")
        if self.seed is not None and not 0 <= self.seed <= _UINT64_MAX:
            raise RequestError("seed", f"must be in [0, 2**64 - 1], got {self.seed}; pass a non-negative 64-bit "
                                       f"integer")

    def _validate_stops(self, vocab_size: int | None) -> None:
        if not isinstance(self.stop, (tuple, list)):
            raise RequestError("stop", f"must be a list of strings, got {self.stop!r}; wrap a single stop string "
                                       f"in a list")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError("stop", f"every stop string must be a non-empty string, got {s!r}; remove it")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise RequestError("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab_size)"
                raise RequestError("stop_token_ids", f"unknown token id {t!r}: ids must be integers in {bound}; "
                                                     f"remove it or look the id up with the model's tokenizer")

    def _validate_logit_shaping(self, vocab_size: int | None) -> None:
        if self.structured is not None and (not isinstance(self.structured, OutputFormat)
                                            or self.structured.kind not in KINDS):
            raise RequestError("structured", f"must be an output format such as {{\"type\": \"json_object\"}}, got "
                                             f"{self.structured!r}")
        if not isinstance(self.logit_bias, tuple):
            raise RequestError("logit_bias", f"must map token ids to biases, got {self.logit_bias!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_IDS:
            raise RequestError("logit_bias", f"biases {len(self.logit_bias)} token ids; at most {MAX_LOGIT_BIAS_IDS}")
        seen: set[int] = set()
        for pair in self.logit_bias:
            token, bias = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
            if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size) or token in seen:
                bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab_size)"
                raise RequestError("logit_bias", f"has token id {token!r}: ids must be distinct integers in {bound}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= \
                    MAX_LOGIT_BIAS:
                raise RequestError("logit_bias", f"has bias {bias!r} for token {token}: biases are numbers in "
                                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            seen.add(token)

    # ------------------------------------------------------------------------------------------------
    # Conversion
    # ------------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], vocab_size: int | None = None) -> SamplingParams:
        """Build and validate from a plain mapping (JSON body, CLI options, recipe section).

        Unknown keys raise :class:`RequestError` naming the key. Lists become tuples; ``stop`` may be a single
        string; ``None`` values keep the default (except ``seed`` and the log-probability counts, where it is the
        default). ``structured`` takes :meth:`OutputFormat.from_dict`'s mapping; ``logit_bias`` a mapping of token
        ids (integers or their decimal strings, as JSON keys are) to biases, or a list of ``[id, bias]`` pairs.
        """
        if not isinstance(d, Mapping):
            raise RequestError("sampling", f"must be a mapping of parameter names to values, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in names:
                raise RequestError(str(key), f"unknown sampling parameter; valid ones are: {', '.join(sorted(names))}")
            if value is None and key not in _NULLABLE:
                continue
            if key in ("structured", "logit_bias"):
                pass  # __post_init__ reads their mappings
            elif key == "stop" and isinstance(value, str):
                value = (value,)
            elif isinstance(value, list):
                value = tuple(value)
            elif key in _FLOAT_FIELDS and _is_int(value):
                value = float(value)
            kwargs[key] = value
        return cls(**kwargs).validate(vocab_size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of every field (tuples become lists); ``from_dict(p.to_dict()) == p``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "logit_bias":
                value = {str(token): bias for token, bias in value}
            elif isinstance(value, OutputFormat):
                value = value.to_dict()
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (same key rules as :meth:`from_dict`), validated without vocab size."""
        merged = self.to_dict()
        merged.update(changes)
        return type(self).from_dict(merged)


_NULLABLE = ("seed", "logprobs", "prompt_logprobs")  # None is a value of these (off / unseeded), not "the default"
_FLOAT_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if isinstance(f.default, float))


def _bias_pairs(value: Any) -> Any:
    """``logit_bias`` as sorted ``(id, bias)`` pairs (from a mapping or pairs; the value as given if neither, for
    validation to name it). Decimal-string ids become integers."""
    items = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(items, (list, tuple)):
        return value
    pairs = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            return value
        token, bias = item
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        pairs.append((token, float(bias) if _is_int(bias) else bias))
    return tuple(sorted(pairs, key=lambda p: p[0] if _is_int(p[0]) else -1))


def _is_int(value: Any) -> bool:
    """True for real integers (``bool`` is not accepted as a number)."""
    return isinstance(value, int) and not isinstance(value, bool)

"""Stop handling: stop token ids (cheap, exact, checked first) and incremental stop strings.

Both are pure functions of their inputs: no tokenizer, no device, no clock. The engine checks
:func:`check_stop_token` on every sampled token, then feeds the detokenizer's text delta to a
:class:`StopStringMatcher`, which looks only at the new text plus a held-back tail of at most
``longest stop - 1`` characters, so nothing is ever re-scanned.
"""

from __future__ import annotations

from typing import Iterable

from llmc.request.params import SamplingParams


def check_stop_token(
    token_id: int, num_generated: int, params: SamplingParams, eos_token_ids: Iterable[int]
) -> bool:
    """True when ``token_id`` ends the request.

    ``num_generated`` counts the generated tokens *including* ``token_id``. A stop token is honoured only
    once at least ``min_tokens`` ordinary tokens precede it (``num_generated > min_tokens``; the sampler
    masks stop ids until then, so the two agree). The request's ``stop_token_ids`` always stop; the model's
    ``eos_token_ids`` stop unless ``ignore_eos``.
    """
    if num_generated <= params.min_tokens:
        return False
    if token_id in params.stop_token_ids:
        return True
    return not params.ignore_eos and token_id in set(eos_token_ids)


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas without re-scanning what was already seen.

    ``feed(delta)`` returns ``(text_to_emit, matched_stop_or_None)``. Text that could be the start of a stop
    string is held back (at most ``longest stop - 1`` characters), so a stop split across deltas is found and
    never leaks into the output. The match reported is the one that *ends* first in the text (ties: the one
    that starts first), which makes the result independent of how the text is split into deltas. On a match
    the emitted text stops right before the stop string (or right after it with
    ``include_stop_str_in_output``) and the matcher is finished: later ``feed`` calls return ``("", None)``.
    ``flush()`` releases the held-back tail once the stream ends without a match.

    ``feed(delta, can_stop=False)`` (used while fewer than ``min_tokens`` tokens were generated) reports no
    match: stops that end inside that delta are ignored for good, while a stop that starts there and ends in a
    later delta still matches.

    ``chars_scanned`` counts every character examined (window sizes), for tests and profiling: it grows by
    at most ``len(delta) + longest stop - 1`` per feed.
    """

    def __init__(self, stops: Iterable[str], include_stop_str_in_output: bool = False):
        self.stops = tuple(stops)
        assert all(isinstance(s, str) and s for s in self.stops), "stop strings must be non-empty strings"
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None
        self.chars_scanned = 0
        self._held = ""
        self._ignore_end = 0  # matches ending at or before this offset of the next window are ignored
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1

    @property
    def finished(self) -> bool:
        """True once a stop string matched."""
        return self.matched is not None

    def feed(self, new_text: str, can_stop: bool = True) -> tuple[str, str | None]:
        """Scan ``held tail + new_text``; return the text now safe to emit and the matched stop (or None)."""
        if self.finished:
            return "", None
        if not self.stops:
            return new_text, None
        window = self._held + new_text
        self.chars_scanned += len(window)
        match = self._first_match(window) if can_stop else None
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            end = start + len(stop) if self.include_stop_str_in_output else start
            return window[:end], stop
        hold = self._hold_length(window)
        self._held = window[len(window) - hold:] if hold else ""
        # offsets shift by the emitted length; an ignored match may still sit in the held tail
        self._ignore_end = hold if not can_stop else max(0, self._ignore_end - (len(window) - hold))
        return window[: len(window) - hold], None

    def flush(self) -> str:
        """The held-back tail (never part of a stop: the stream ended first); empties the matcher."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, window: str) -> tuple[int, str] | None:
        """``(start, stop)`` of the match ending first (then starting first) in ``window``, or None."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = window.find(stop, max(0, self._ignore_end - len(stop) + 1))
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _hold_length(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of some stop string."""
        return partial_match_length(window, self.stops, self._max_hold)


def partial_match_length(text: str, markers: Iterable[str], longest: int | None = None) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``markers`` (``longest``: the longest
    marker's length - 1, when the caller knows it): the text to hold back while it may still become a marker."""
    markers = tuple(markers)
    if longest is None:
        longest = max((len(m) for m in markers), default=1) - 1
    for length in range(min(longest, len(text)), 0, -1):
        tail = text[len(text) - length:]
        if any(marker.startswith(tail) for marker in markers):
            return length
    return 0

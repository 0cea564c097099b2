"""Stop token ids and the incremental stop-string matcher."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmc.request.params import SamplingParams
from llmc.request.stop import StopStringMatcher, check_stop_token


def test_eos_and_request_stop_ids():
    p = SamplingParams(stop_token_ids=(7,))
    assert check_stop_token(2, 1, p, eos_token_ids=(2, 3))
    assert check_stop_token(3, 1, p, eos_token_ids=(2, 3))
    assert check_stop_token(7, 1, p, eos_token_ids=(2, 3))
    assert not check_stop_token(5, 1, p, eos_token_ids=(2, 3))


def test_ignore_eos_keeps_request_stop_ids():
    p = SamplingParams(stop_token_ids=(7,), ignore_eos=True)
    assert not check_stop_token(2, 4, p, eos_token_ids=(2,))
    assert check_stop_token(7, 4, p, eos_token_ids=(2,))


def test_nothing_stops_before_min_tokens():
    p = SamplingParams(min_tokens=3, stop_token_ids=(7,))
    for n in (1, 2, 3):
        assert not check_stop_token(2, n, p, eos_token_ids=(2,))
        assert not check_stop_token(7, n, p, eos_token_ids=(2,))
    assert check_stop_token(2, 4, p, eos_token_ids=(2,))
    assert check_stop_token(7, 4, p, eos_token_ids=(2,))


def run_stream(stops, deltas, include=False):
    """Feed ``deltas``; return (emitted text, matched stop)."""
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    out = []
    for d in deltas:
        emit, matched = m.feed(d)
        out.append(emit)
        if matched is not None:
            return "".join(out), matched
    out.append(m.flush())
    return "".join(out), None


TEXT = "The answer is 42.\n### END\nignored tail"


def test_stop_split_at_every_point_is_found_and_cut():
    for i in range(len(TEXT) + 1):
        for j in range(i, len(TEXT) + 1):
            text, matched = run_stream(["### END"], [TEXT[:i], TEXT[i:j], TEXT[j:]])
            assert (text, matched) == ("The answer is 42.\n", "### END"), (i, j)


def test_include_stop_str_in_output():
    for i in range(len(TEXT) + 1):
        text, matched = run_stream(["### END"], [TEXT[:i], TEXT[i:]], include=True)
        assert (text, matched) == ("The answer is 42.\n### END", "### END")


def test_char_by_char_stream():
    assert run_stream(["END"], list(TEXT)) == ("The answer is 42.\n### ", "END")


def test_no_stop_releases_everything_at_flush():
    text = "nothing to see, almost ### EN"
    for i in range(len(text) + 1):
        assert run_stream(["### END"], [text[:i], text[i:]]) == (text, None)


def test_partial_stop_prefix_is_held_back_then_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", None)  # "ST" could start "STOP"
    assert m.feed("ART") == ("START", None)  # it did not
    assert m.feed("ST") == ("", None)
    assert m.flush() == "ST"


def test_overlapping_stops_first_ending_wins():
    # "cd" ends before "bcde" does, whatever the split
    for i in range(6):
        assert run_stream(["bcde", "cd"], ["abcdef"[:i], "abcdef"[i:]]) == ("ab", "cd")
    # same end: the longer (earlier starting) stop wins
    assert run_stream(["b", "ab"], ["xab"]) == ("x", "ab")
    # a stop that is a prefix of another
    assert run_stream(["ab", "abc"], ["xa", "bc"]) == ("x", "ab")
    # self-overlapping stop
    assert run_stream(["aab"], ["aaa", "ab"]) == ("aa", "aab")


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet="ab#E\n", max_size=40),
    stops=st.lists(st.text(alphabet="ab#E", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    include=st.booleans(),
)
def test_matches_a_whole_text_search_for_any_split(text, stops, cuts, include):
    # reference: the stop ending first in the whole text (ties: starting first)
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if hits:
        end, start, stop = min(hits, key=lambda h: (h[0], h[1]))
        expected = (text[:end] if include else text[:start], stop)
    else:
        expected = (text, None)
    points = sorted(set(c for c in cuts if c <= len(text)))
    deltas = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    assert run_stream(stops, deltas, include) == expected


def test_no_rescan_of_earlier_text():
    stop = "<|stop|>"
    m = StopStringMatcher([stop, "zz"])
    n = 5000
    for _ in range(n):
        emit, matched = m.feed("x")
        assert emit == "x" and matched is None
    # each window is the new text plus at most len(longest stop) - 1 held characters
    assert m.chars_scanned <= n * len(stop)
    m2 = StopStringMatcher([stop])
    m2.feed("y" * 10000)
    before = m2.chars_scanned
    m2.feed("a")
    assert m2.chars_scanned - before <= len(stop)


def test_finished_matcher_ignores_later_text():
    m = StopStringMatcher(["."])
    assert m.feed("one. two") == ("one", ".")
    assert m.finished and m.matched == "."
    assert m.feed("three.") == ("", None)
    assert m.flush() == ""


def test_no_stops_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("anything ###") == ("anything ###", None)
    assert m.flush() == ""


def test_can_stop_false_ignores_stops_that_end_early():
    m = StopStringMatcher(["ab", "abcd"])
    # "ab" completes while stopping is not allowed yet (min_tokens): ignored for good
    emit1, matched1 = m.feed("xab", can_stop=False)
    assert matched1 is None
    emit2, matched2 = m.feed("c", can_stop=True)
    assert matched2 is None
    emit3, matched3 = m.feed("d", can_stop=True)
    assert matched3 == "abcd"  # started before min_tokens, ended after: it counts
    assert emit1 + emit2 + emit3 == "x"


def test_can_stop_false_then_new_occurrence_matches():
    m = StopStringMatcher(["END"])
    e1, m1 = m.feed("a END b", can_stop=False)
    e2, m2 = m.feed(" END", can_stop=True)
    assert m1 is None and m2 == "END"
    assert e1 + e2 == "a END b "


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet="abE", max_size=30),
    stops=st.lists(st.text(alphabet="abE", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    num_early=st.integers(0, 6),
)
def test_can_stop_false_matches_a_reference(text, stops, cuts, num_early):
    points = sorted(set(c for c in cuts if c <= len(text)))
    deltas = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    num_early = min(num_early, len(deltas))
    boundary = sum(len(d) for d in deltas[:num_early])  # stops ending at or before it are ignored
    hits = []
    for s in stops:
        start = text.find(s, max(0, boundary - len(s) + 1))
        if start >= 0:
            hits.append((start + len(s), start, s))
    m = StopStringMatcher(stops)
    out, matched = [], None
    for i, d in enumerate(deltas):
        emit, matched = m.feed(d, can_stop=i >= num_early)
        out.append(emit)
        if matched is not None:
            break
    else:
        out.append(m.flush())
    if hits:
        end, start, stop = min(hits)
        assert ("".join(out), matched) == (text[:start], stop)
    else:
        assert ("".join(out), matched) == (text, None)

"""Stop strings: honoured across token boundaries, never partially streamed, never emitted."""
from __future__ import annotations

import pytest

from kvforge.engine.stop import StopStringMatcher


def run(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, int | None, list[str]]:
    """Feed text piece by piece like a streaming engine; return (final text, stop index, emits)."""
    text, emitted, emits = "", 0, []
    for piece in pieces:
        text += piece
        out, stop = matcher.check(text, emitted)
        emits.append(out)
        emitted += len(out)
        if stop is not None:
            return text[:stop], stop, emits
    return text[:emitted], None, emits


def test_stop_spanning_tokens_is_cut_and_not_emitted() -> None:
    final, stop, emits = run(StopStringMatcher(["\n\nUser:"]), ["Sure", ".\n", "\nUs", "er:", " more"])
    assert final == "Sure." and stop == 5
    assert "".join(emits) == "Sure."
    assert emits == ["Sure", ".", "", ""]  # "\n" held back until "\nUs" ... "er:" confirms


def test_partial_prefix_released_when_disproved() -> None:
    final, stop, emits = run(StopStringMatcher(["STOP"]), ["ab S", "T", "x", "yz"])
    assert stop is None and final == "ab STxyz"
    assert emits == ["ab ", "", "STx", "yz"]


def test_earliest_of_several_stops_wins() -> None:
    m = StopStringMatcher(["world", "lo w"])
    out, stop = m.check("hello world", 0)
    assert (out, stop) == ("hel", 3) and m.matched_stop("hello world", 3) == "lo w"


def test_include_stop_str_in_output() -> None:
    m = StopStringMatcher(["END"], include_stop_str_in_output=True)
    final, stop, _ = run(m, ["a E", "ND b"])
    assert final == "a END" and stop == 5 and m.matched_stop("a END b", 5) == "END"


def test_stop_at_very_start_and_no_stops() -> None:
    assert StopStringMatcher(["x"]).check("xyz", 0) == ("", 0)
    empty = StopStringMatcher([])
    assert not empty and empty.check("anything", 3) == ("thing", None)
    assert StopStringMatcher(None).check("abc", 0) == ("abc", None)


def test_held_back_tail_is_bounded_by_longest_stop() -> None:
    m = StopStringMatcher(["abcd", "zz"])
    assert m.check("xxabc", 0) == ("xx", None)
    assert m.check("xxabz", 0) == ("xxab", None)
    assert m.check("xxabcabc", 2) == ("abc", None)


@pytest.mark.parametrize("bad", ["stop", [""], ["ok", 3], [None], 5, {"a": 1}])
def test_invalid_stop_rejected(bad) -> None:
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(bad)

"""Stop strings on streamed text: the output equals the whole text cut at the first stop, for any split."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer_numba.server.stop_strings import StopStringFilter, partial_suffix_len


def run(text: str, stops: list[str], cuts: list[int]) -> tuple[str, list[str], str | None]:
    f = StopStringFilter(stops)
    released, pieces, last = [], [], 0
    for cut in [*cuts, len(text)]:
        pieces.append(text[last:cut])
        last = cut
    for piece in pieces:
        released.append(f.push(piece))
    released.append(f.flush())
    return "".join(released), released, f.matched


def expected(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if s and s in text]
    return text[:min(hits)] if hits else text


TEXTS = ["Hello world. STOP here", "ab\nEND\nmore", "no stop at all", "xxSTOxxSTOP", "stop at the end STOP",
         "毕老师ß END é"]
STOPS = [["STOP"], ["\nEND"], ["STOP", "END"], ["ST", "STOP"], ["at the"], [" END", "é"]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text,stops", list(zip(TEXTS, STOPS)), ids=[repr(t[:8]) for t in TEXTS])
def test_any_split_gives_the_cut_text(text, stops, seed):
    rng = np.random.default_rng(seed)
    cuts = sorted(rng.choice(np.arange(1, len(text)), size=min(4, len(text) - 1), replace=False).tolist())
    out, released, matched = run(text, stops, cuts)
    assert out == expected(text, stops)
    assert (matched is not None) == (out != text)
    for piece in released[:-1]:   # no released piece ends with the start of a stop string it then completes
        assert not any(s in piece for s in stops)


def test_partial_match_is_held_then_released():
    f = StopStringFilter(["</end>"])
    assert f.push("abc</e") == "abc"
    assert f.push("x") == "</ex"
    assert f.push("</en") == ""
    assert f.flush() == "</en"


def test_after_a_match_everything_is_dropped():
    f = StopStringFilter(["##"])
    assert f.push("a#") == "a"
    assert f.push("#b") == ""
    assert f.matched == "##"
    assert f.push("more") == "" and f.flush() == ""


def test_partial_suffix_len():
    assert partial_suffix_len("hello </thi", ["</think>"]) == 5
    assert partial_suffix_len("hello", ["</think>"]) == 0
    assert partial_suffix_len("a<", ["<tool_call>", "</think>"]) == 1
    assert partial_suffix_len("</think>", ["</think>"]) == 0   # a whole marker is a match, not a prefix

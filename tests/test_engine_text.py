"""Host-side pieces of the engine without a model: stop strings across arbitrary text boundaries, incremental
detokenization (split UTF-8 characters, ids the tokenizer lacks), the page/slot allocator."""

import random

import pytest

from qwen_jax.checkpoint import load_tokenizer
from qwen_jax.engine.state import IndexPool
from qwen_jax.engine.text import Detokenizer, StopStrings
from tests.conftest import CAPTURES


def _stream(stops, pieces):
    s = StopStrings(stops)
    out, hit = [], False
    for p in pieces:
        text, hit = s.feed(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(s.flush())
    return "".join(out), hit


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_match_whatever_the_split(seed):
    rng = random.Random(seed)
    alphabet = "ab c\n"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(3)})
    cuts = sorted(rng.sample(range(1, len(text)), 15))
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    want = (text[:min(hits)], True) if hits else (text, False)
    assert _stream(stops, pieces) == want


def test_stop_string_prefix_is_held_back_until_resolved():
    s = StopStrings(("</end>",))
    assert s.feed("hello </") == ("hello ", False)  # "</" might start the stop string
    assert s.feed("e") == ("", False)
    assert s.feed("x") == ("</ex", False)  # resolved: not a stop string after all
    assert s.feed("ok </en") == ("ok ", False)
    assert s.feed("d> tail") == ("", True)


def test_detokenizer_streams_the_full_decode():
    tok = load_tokenizer(CAPTURES / "tiny")
    text = "Copyright © 2024 — naïve café, ünïcödé ✓ and the GNU General Public License."
    ids = tok(text, add_special_tokens=False)["input_ids"] + [493, 505, 511] + tok("done", add_special_tokens=False)[
        "input_ids"]
    for skip in (True, False):
        d = Detokenizer(tok, skip_special_tokens=skip)
        parts = [d.add(t) for t in ids]
        assert all("\ufffd" not in p for p in parts)  # a split character waits for its last byte
        assert "".join(parts) + d.flush() == tok.decode([t for t in ids if t < len(tok)],
                                                        skip_special_tokens=skip)
    assert Detokenizer(tok).add(505) == ""  # in the model's vocabulary, not the tokenizer's


def test_index_pool_hands_out_and_takes_back():
    pool = IndexPool(5, "pages")
    assert (pool.total, pool.free) == (4, 4)
    a = pool.take(3)
    assert a == [1, 2, 3] and pool.take(2) is None and pool.free == 1
    pool.give_back(a)
    assert pool.free == 4 and pool.take(4) == [1, 2, 3, 4]
    with pytest.raises(AssertionError):
        pool.give_back([1, 1])
    pool.share([2, 3])  # a second holder: the index is free once both gave it back
    assert pool.holders(2) == 2 and pool.holders(1) == 1
    pool.give_back([1, 2, 3])
    assert pool.free == 1 and pool.holders(2) == 1
    pool.give_back([2, 3])
    assert pool.free == 3
    with pytest.raises(AssertionError):
        pool.share([2])
    with pytest.raises(AssertionError):
        pool.give_back([4, 4])

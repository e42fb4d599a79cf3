"""qwen_jax.numrange: numeric bounds as automata over a number's text, checked exhaustively against exact decimal
comparisons (Python's Decimal) on every text of up to 4 bytes over the number alphabet."""

import itertools
import re
from decimal import Decimal

import numpy as np
import pytest

from qwen_jax import numrange

NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?\Z")
TEXTS = ["".join(t) for n in range(1, 5) for t in itertools.product("-.0123456789", repeat=n)]
VALUES = [0, 1, -1, 5, -5, 10, 99, -100, 0.5, -0.5, 1.25, -1.25, 0.05, 3.14159, -0.001, 7, 0.1, -2.75, 1e-40, 1e40,
          -1e40, 123456]


def _decimal(v) -> Decimal:
    return Decimal(repr(v)) if isinstance(v, float) else Decimal(v)


def _run(auto, texts: list[str]) -> np.ndarray:
    """Whether the automaton accepts each text (all of the same length: one numpy step a byte)."""
    data = np.array([list(t.encode()) for t in texts], np.int64)
    state = np.full(len(texts), auto.start, np.int64)
    for k in range(data.shape[1]):
        alive = state >= 0
        state[alive] = auto.table[state[alive], data[alive, k]]
        state[~alive] = -1
    return np.where(state >= 0, auto.accept[np.maximum(state, 0)], False)


def _wanted(text: str, integer: bool, lower, upper, max_bytes: int) -> bool:
    if not NUMBER.match(text) or len(text) > max_bytes or (integer and "." in text):
        return False
    v = Decimal(text)
    if text.startswith("-") and v == 0:
        return False  # no "-0"
    if lower is not None and (v < lower[0] or (lower[1] and v == lower[0])):
        return False
    return upper is None or not (v > upper[0] or (upper[1] and v == upper[0]))


def test_texts_in_the_bounds_exactly():
    rng = np.random.default_rng(0)
    by_length = {n: [t for t in TEXTS if len(t) == n] for n in range(1, 5)}
    cases = [(None, None, False), (None, None, True)]
    for _ in range(60):
        lo, hi = (None if rng.random() < 0.2 else (_decimal(VALUES[rng.integers(len(VALUES))]), rng.random() < 0.5)
                  for _ in range(2))
        cases.append((lo, hi, bool(rng.random() < 0.3)))
    empty = 0
    for lower, upper, integer in cases:
        auto = numrange.bounded_number(integer, lower, upper, 5)
        for texts in by_length.values():
            want = np.array([_wanted(t, integer, lower, upper, 5) for t in texts])
            got = np.zeros(len(texts), bool) if auto is None else _run(auto, texts)
            bad = [t for t, a, b in zip(texts, got, want) if a != b]
            assert not bad, (lower, upper, integer, bad[:5])
        if auto is None:
            empty += 1
        else:  # every state reaches an accepting one (nothing to get stuck in)
            live = auto.accept.copy()
            for _ in range(len(live)):
                live |= ((auto.table >= 0) & live[np.maximum(auto.table, 0)]).any(axis=1)
            assert live.all()
    assert 0 < empty < len(cases) // 2


def test_long_bounds_and_fractions():
    """Bounds past what max_bytes can write: the side below a huge bound is everything, above it nothing; a bound's
    fraction longer than any text's compares as cut there."""
    assert numrange.bounded_number(False, (Decimal("1e40"), False), None, 8) is None
    everything = numrange.bounded_number(False, None, None, 8)
    below = numrange.bounded_number(False, None, (Decimal("1e40"), True), 8)
    texts = [t for t in TEXTS if len(t) == 4]
    np.testing.assert_array_equal(_run(below, texts), _run(everything, texts))
    tiny = numrange.bounded_number(False, (Decimal("1e-40"), False), None, 5)
    assert list(_run(tiny, ["0.01", "0.00", "-0.1"])) == [True, False, False]
    at_most = numrange.bounded_number(False, None, (Decimal("0.0" + "0" * 50 + "1"), False), 5)
    assert list(_run(at_most, ["0.00", "0.01", "-1.5"])) == [True, False, True]


def test_bounds_from_a_schema():
    assert numrange.bounds({"type": "number"}, "#") is None
    assert numrange.bounds({"minimum": 2, "maximum": 2.5}, "#") == ((Decimal(2), False), (Decimal("2.5"), False))
    assert numrange.bounds({"minimum": 2, "exclusiveMinimum": True}, "#") == ((Decimal(2), True), None)
    # both kinds: the tighter holds (strict wins a tie)
    assert numrange.bounds({"minimum": 3, "exclusiveMinimum": 3}, "#") == ((Decimal(3), True), None)
    assert numrange.bounds({"maximum": 3, "exclusiveMaximum": 4}, "#") == (None, (Decimal(3), False))
    assert numrange.bounds({"minimum": 0.1}, "#")[0] == (Decimal("0.1"), False)  # the float's shortest decimal
    for schema, message in (({"minimum": "1"}, "'minimum' must be a number"),
                            ({"maximum": float("inf")}, "'maximum' must be a number"),
                            ({"exclusiveMinimum": True}, "needs 'minimum'"),
                            ({"exclusiveMaximum": [1]}, "'exclusiveMaximum' must be a number")):
        with pytest.raises(ValueError, match=message):
            numrange.bounds(schema, "#")

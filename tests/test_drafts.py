"""Copy drafts: the index's proposals (qwen_jax.engine.drafts)."""

import pytest

from qwen_jax.engine.drafts import CopyIndex


def test_propose_copies_what_followed_the_last_match():
    idx = CopyIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 50, 1, 2, 3, 4, 5, 6, 7], n=8)
    assert idx.propose(3) == []  # its last 8 tokens (50 1 2 ... 7) occur nowhere else
    idx.append(8)  # now its last 8 (1 2 ... 8) repeat the start, which 9 10 11 50 1 2 ... followed
    assert idx.propose(3) == [9, 10, 11]
    assert idx.propose(6) == [9, 10, 11, 50, 1, 2]
    assert idx.propose(100) == [9, 10, 11, 50, 1, 2, 3, 4, 5, 6, 7, 8]  # up to the history's end
    assert idx.propose(0) == []


def test_propose_prefers_the_latest_match_with_a_full_continuation():
    a = [7] * 7
    idx = CopyIndex(a + [1, 20, 21, 22] + a + [1, 30, 31, 32, 33] + a + [1], n=8)
    assert idx.propose(4) == [30, 31, 32, 33]  # the latest occurrence holds 4 tokens after it
    assert idx.propose(12) == [30, 31, 32, 33] + a + [1]  # the latest still has 12 after it
    assert idx.propose(30) == [20, 21, 22] + a + [1, 30, 31, 32, 33] + a + [1]  # none has 30: the longest


def test_propose_needs_the_whole_match():
    idx = CopyIndex([1, 2, 3, 4, 5, 6, 7, 8, 9] + [0, 2, 3, 4, 5, 6, 7, 8], n=8)  # 7 of 8 tokens match
    assert idx.propose(4) == []
    assert idx.may_propose()  # the last 7 (2..8) occurred with a token after them
    idx2 = CopyIndex([1, 2, 3, 4, 5, 6, 7, 8, 9], n=8)
    assert not idx2.may_propose() and idx2.propose(4) == []


def test_periodic_history_copies_its_period():
    idx = CopyIndex([5, 6, 7] * 6, n=4)
    assert idx.propose(7) == [5, 6, 7, 5, 6, 7, 5]


def test_copy_index_errors():
    with pytest.raises(ValueError, match="match length"):
        CopyIndex(n=1)
    with pytest.raises(ValueError, match="limit"):
        CopyIndex([1, 2, 3]).propose(-1)

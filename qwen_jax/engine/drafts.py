"""Copy drafts: a stream's next tokens guessed from its own history (prompt lookup).

The engine's `copy_drafts` (off by default) uses it: `Engine._window_call` verifies the proposals as chain
windows in the draft program, whose rows are computed as the serial steps at their positions
(`model.verify(chain=True)`), so drafting changes nothing but speed.

When the last `n` tokens of a stream (prompt + reply, the pending token included) occurred earlier in that
history, the tokens that followed the earlier occurrence are a good guess for what follows now: code being edited,
a document quoted back, a list repeated with changes. The engine verifies such a guess as a chain window
(`[pending] + drafts`, one forward for all its rows), samples every row with the keyed sampler at its absolute
position and keeps the rows up to the first draft that differs from the sample of the row before it. Then what a
stream produces is what serial decoding produces, and the drafts only decide how many tokens one forward yields.

The index keys every (n - 1)-gram of the history by where it ends; an n-gram match is an (n - 1)-gram occurrence
followed by the same token. Both questions the engine asks are then one dictionary lookup:
- `may_propose()` while the stream's newest token is still on the device: did the last n - 1 known tokens occur
  earlier with a token after them? (If so, the pending token is likely that token, and the engine fetches it.)
- `propose(limit)` with the whole history known: the continuation of the latest earlier occurrence of the last n
  tokens that has `limit` tokens after it, else of the one with the most (the earliest).
"""

from __future__ import annotations

from collections.abc import Iterable

MIN_MATCH = 8  # tokens that must repeat before a copy is proposed
SCAN = 64  # the most recent occurrences of a key looked at (a long run of one token has thousands)


class CopyIndex:
    def __init__(self, tokens: Iterable[int] = (), *, n: int = MIN_MATCH):
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"copy drafts: the match length must be an integer >= 2, got {n!r}")
        self.n = n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # (n - 1)-gram -> the positions just past each occurrence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        self.tokens.append(int(token))
        end = len(self.tokens)
        k = self.n - 1
        if end >= k:
            self._ends.setdefault(tuple(self.tokens[end - k:]), []).append(end)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def truncate(self, size: int) -> None:
        """Drop the tokens past the first `size` (undoes `extend`)."""
        k = self.n - 1
        while len(self.tokens) > size:
            end = len(self.tokens)
            if end >= k:
                key = tuple(self.tokens[end - k:])
                self._ends[key].pop()
                if not self._ends[key]:
                    del self._ends[key]
            self.tokens.pop()

    def propose_after(self, assumed: list[int], limit: int) -> list[int]:
        """`propose(limit)` as if `assumed` followed the history (tokens of calls still on the device, taken as
        right); the index is left as it was."""
        if not assumed:
            return self.propose(limit)
        size = len(self.tokens)
        self.extend(assumed)
        try:
            return self.propose(limit)
        finally:
            self.truncate(size)

    def may_propose(self) -> bool:
        """Whether the last n - 1 tokens occurred earlier with a token after them (the suffix itself excluded)."""
        k = self.n - 1
        if len(self.tokens) < k + 1:
            return False
        ends = self._ends.get(tuple(self.tokens[-k:]), ())
        return len(ends) >= 2  # the last entry is the suffix itself

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens copied from after an earlier occurrence of the last n tokens ([] when none)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"copy drafts: limit must be a non-negative integer, got {limit!r}")
        size, k = len(self.tokens), self.n - 1
        if limit == 0 or size < self.n + 1:
            return []
        last = self.tokens[-1]
        ends = self._ends.get(tuple(self.tokens[size - 1 - k:size - 1]), ())
        best = None  # (tokens after the match, -its position)
        for end in reversed(ends[-SCAN:]):
            # end: just past an (n - 1)-gram equal to the one before the last token; the match needs the same
            # token after it, and something after that (the current suffix ends at size - 1 and has nothing).
            if end >= size - 1 or self.tokens[end] != last:
                continue
            after = min(size - end - 1, limit)
            if after == limit:
                best = (after, end)
                break
            if best is None or after > best[0]:
                best = (after, end)
        if best is None:
            return []
        after, end = best
        return self.tokens[end + 1:end + 1 + after]

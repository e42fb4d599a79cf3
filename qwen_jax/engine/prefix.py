"""The exact prompt cache: model states kept at prompt prefixes, so a later prompt that extends one skips its prefill.

What an entry holds: the prefix's token ids (a multiple of `align` long), a kept GDN slot with the recurrent states
and conv windows after that prefix (copied from the stream's slot right after the prompt chunk that ended there),
and one share of the KV pages of its positions (the stream's own pages; the stream writes only at positions past
the prefix, and `align` is a multiple of the page size, so no page holds both).

Why a resumed prompt is the fresh one, bit for bit: prompt chunks are cut on the grid of absolute positions, and a
chunk's rows and the state it leaves do not depend on where the chunks before it were cut (programs docstring;
tests/test_programs.py). A resumed stream runs the same chunks from the prefix on that a fresh one runs once its
prefill has passed there, from the same state (a copy) and the same K/V (the same pages).

Where states are kept (`keep_points`), each a multiple of `align` below the prompt's last token (at least one
prompt token is always left to run, which yields the first reply token):
  * the last grid point before the prompt's end: a follow-up turn repeats the whole earlier prompt (chat
    templates render the history first), and the point is at least one token short of the end, where a
    template may render the next turn differently (a generation prompt that the history does not repeat);
  * the last grid point at or before the last user message's start (the ids of `<|im_start|>user`, when the
    tokenizer has `<|im_start|>`): prompts that share a system prompt and earlier turns share it.
Replies are never kept: a decode step and a prompt chunk compute the same position with different kernels, so a
state after decoded tokens is not the state a prompt pass would reach.

Lookup: the longest entry the prompt strictly extends. Eviction (when a kept slot or KV pages are needed): entries
never hit go first, oldest first; then the least recently used."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(eq=False)  # entries are compared by identity
class Entry:
    tokens: np.ndarray  # [n] int32, n a multiple of the cache's align
    slot: int  # the kept GDN slot holding the state after these tokens
    pages: list[int]  # the KV pages of positions 0 .. n - 1, in order (one share held by the entry)
    hits: int = 0
    used: int = 0  # the cache's clock at the last add or hit

    def __len__(self) -> int:
        return len(self.tokens)


class PrefixCache:
    """Entries over the kept slots `slots`; lengths are multiples of `align`. Bookkeeping only: the engine copies
    states and holds / gives back the pages."""

    def __init__(self, slots: Sequence[int], align: int, user_marker: Sequence[int] | None = None):
        if not slots:
            raise ValueError("a prompt cache needs at least one kept slot")
        self.align = align
        self.user_marker = np.asarray(user_marker, np.int32) if user_marker else None  # <|im_start|>user ids
        self._free_slots = sorted(slots, reverse=True)
        self.entries: list[Entry] = []
        self._clock = 0
        self.hits = 0
        self.hit_tokens = 0

    @property
    def capacity(self) -> int:
        return len(self._free_slots) + len(self.entries)

    def keep_points(self, prompt: np.ndarray, after: int = 0) -> list[int]:
        """Where a prompt's state is kept (module docstring): grid points in (after, len(prompt)), ascending, those
        already cached left out."""
        n = len(prompt)
        points = {(n - 1) // self.align * self.align}
        m = self.user_marker
        if m is not None and n >= len(m):
            at = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(prompt, len(m)) == m).all(axis=1))
            if at.size:
                points.add(int(at[-1]) // self.align * self.align)
        return sorted(p for p in points if after < p < n and not self.find(prompt[:p]))

    def find(self, tokens: np.ndarray) -> Entry | None:
        """The entry of exactly these tokens, or None."""
        for e in self.entries:
            if len(e) == len(tokens) and np.array_equal(e.tokens, tokens):
                return e
        return None

    def lookup(self, prompt: np.ndarray) -> Entry | None:
        """The longest entry the prompt strictly extends (one token or more left), or None."""
        best = None
        for e in self.entries:
            if len(e) < len(prompt) and (best is None or len(e) > len(best)) \
                    and np.array_equal(prompt[:len(e)], e.tokens):
                best = e
        return best

    def hit(self, entry: Entry) -> None:
        """A stream resumed from `entry`."""
        self._clock += 1
        entry.used = self._clock
        entry.hits += 1
        self.hits += 1
        self.hit_tokens += len(entry)

    def take_slot(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def give_slot(self, slot: int) -> None:
        """A slot from `take_slot` that no entry took."""
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)

    def add(self, tokens: np.ndarray, slot: int, pages: list[int]) -> Entry:
        if len(tokens) % self.align or not len(tokens):
            raise AssertionError(f"a kept prefix of {len(tokens)} tokens is not on the {self.align}-grid")
        self._clock += 1
        e = Entry(np.array(tokens, np.int32), slot, list(pages), used=self._clock)
        self.entries.append(e)
        return e

    def victim(self, keep: Entry | None = None) -> Entry | None:
        """The entry to evict next (never `keep`), or None when there is none."""
        others = [e for e in self.entries if e is not keep]
        if not others:
            return None
        return min(others, key=lambda e: (e.hits > 0, e.used))

    def remove(self, entry: Entry) -> list[int]:
        """Drop an entry; its slot is free again. -> its pages, for the caller to give back."""
        self.entries.remove(entry)
        self.give_slot(entry.slot)
        return entry.pages


def user_marker(tokenizer) -> list[int] | None:
    """The ids a chat template renders a user message's start as (`<|im_start|>` then "user"), or None when the
    tokenizer has no `<|im_start|>` token."""
    if tokenizer is None:
        return None
    try:
        start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        user = tokenizer.encode("user", add_special_tokens=False)
    except Exception:  # a tokenizer without these methods: no user points
        return None
    if not isinstance(start, int) or start < 0 or start == getattr(tokenizer, "unk_token_id", None) or not user:
        return None
    return [start, *user]

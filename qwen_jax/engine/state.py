"""Host-side bookkeeping of the device pools: KV pages and GDN slots. Index 0 of each pool is the dummy that
padding rows point at, so it is never handed out."""

from __future__ import annotations


class IndexPool:
    """A free list over indices 1..size-1. Lowest indices are handed out first, so a lone request always lands
    on the same slot and pages (handy when reading traces; exactness does not depend on it)."""

    def __init__(self, size: int, what: str):
        if size < 2:
            raise ValueError(f"{what}: need at least 2 (index 0 is the dummy), got {size}")
        self.what = what
        self.total = size - 1
        self._free = list(range(size - 1, 0, -1))
        self._held: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n indices, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        got = [self._free.pop() for _ in range(n)]
        self._held.update(got)
        return got

    def give_back(self, indices: list[int]) -> None:
        for i in indices:
            if i not in self._held:
                raise AssertionError(f"{self.what}: index {i} returned twice or never taken")
            self._held.remove(i)
        self._free.extend(sorted(indices, reverse=True))
        self._free.sort(reverse=True)
